#!/usr/bin/env bash
set -uo pipefail
source scripts/gpu_check_lib.sh
R=/tmp/r7; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > $R/device.txt
date -u > $R/start.txt
configure_gpu_build $R/build.log
build_gpu_targets $R/build.log test_cuda_kl test_training_smoke test_cuda_device_api msa_cli
cd build-gpu
timeout 60 ./tests/test_training_smoke --gtest_filter='Gpu*' > $R/smoke.txt 2>&1; echo "rc $?" >> $R/smoke.txt
grep -E "step \]|OK|FAILED|Failure" -A3 $R/smoke.txt | head -20; tail -2 $R/smoke.txt
timeout 60 ./tests/test_cuda_kl --gtest_filter='*GpuKlTeacher*:*GpuKlIndexer*' > $R/kl.txt 2>&1; echo "rc $?" >> $R/kl.txt
tail -2 $R/kl.txt
timeout 60 ./tests/test_cuda_device_api > $R/device_api.txt 2>&1; echo "rc $?" >> $R/device_api.txt
tail -2 $R/device_api.txt
timeout 260 ./tools/msa bench --device cuda --training --training-seqs 32768,131072,8x16384 --cudnn 1 --dense-repeats 3 --matmul-size 8192 --repeats 5 --json $R/train.jsonl > $R/bench.txt 2> $R/bench.err; echo "rc $?" >> $R/bench.txt
grep -A6 "speed-up vs cuDNN |" $R/bench.txt | head -6; grep -A6 "index LSE (the KL" $R/bench.txt; grep -A6 "handed over by" $R/bench.txt | tail -4; tail -2 $R/bench.txt
date -u >> $R/start.txt
tar czf $OUT/r.tgz -C /tmp r7
