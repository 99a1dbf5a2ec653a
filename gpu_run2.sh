#!/usr/bin/env bash
set -uo pipefail
source scripts/gpu_check_lib.sh
R=/tmp/r2; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > $R/device.txt
date -u > $R/start.txt
configure_gpu_build $R/build.log
build_gpu_targets $R/build.log test_cuda_kl test_cuda_backward test_training_smoke test_cuda_device_api msa_cli
date -u >> $R/start.txt
cd build-gpu
timeout 100 ./tests/test_cuda_kl --gtest_filter='*GpuKlTeacher*' > $R/kl_teacher.txt 2>&1; echo "rc $?" >> $R/kl_teacher.txt
tail -3 $R/kl_teacher.txt
timeout 220 ./tools/msa bench --device cuda --training --training-seqs 32768,131072,8x16384 --cudnn 1 --dense-repeats 3 --matmul-size 8192 --repeats 5 --json $R/train.jsonl > $R/bench.txt 2> $R/bench.err; echo "rc $?" >> $R/bench.txt
grep -A6 "handed over by" $R/bench.txt; grep -A6 "speed-up vs cuDNN |" $R/bench.txt | head -8; tail -2 $R/bench.txt
timeout 100 ./tests/test_cuda_backward > $R/backward.txt 2>&1; echo "rc $?" >> $R/backward.txt
tail -3 $R/backward.txt
date -u >> $R/start.txt
tar czf $OUT/r.tgz -C /tmp r2
