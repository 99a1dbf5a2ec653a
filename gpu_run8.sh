#!/usr/bin/env bash
set -uo pipefail
source scripts/gpu_check_lib.sh
R=/tmp/r8; mkdir -p $R
date -u > $R/start.txt
configure_gpu_build $R/build.log
build_gpu_targets $R/build.log test_cuda_kl test_training_smoke test_cuda_device_api test_cuda_backward msa_cli
date -u >> $R/start.txt
cd build-gpu
timeout 60 ./tests/test_cuda_device_api > $R/device_api.txt 2>&1; echo "rc $?" >> $R/device_api.txt
grep -E "OK|FAILED|Failure" -A3 $R/device_api.txt | head -30; tail -2 $R/device_api.txt
timeout 60 ./tests/test_cuda_kl --gtest_filter='*GpuKlTeacher*' > $R/kl.txt 2>&1; echo "rc $?" >> $R/kl.txt
tail -2 $R/kl.txt
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
timeout 90 $SAN --tool memcheck --error-exitcode 7 ./tests/test_cuda_kl --gtest_filter='Shapes/GpuKlTeacher.FromTheBackwardMatchesReference/Hkv2_G4_D128_Di128_B128*' > $R/san.txt 2>&1; echo "rc $?" >> $R/san.txt
grep -E "ERROR SUMMARY|PASSED|rc " $R/san.txt
timeout 60 ./tests/test_training_smoke --gtest_filter='Gpu*' > $R/smoke.txt 2>&1; echo "rc $?" >> $R/smoke.txt
tail -2 $R/smoke.txt
timeout 150 ./tools/msa bench --device cuda --training --training-seqs 32768,131072,8x16384 --cudnn 0 --dense-max-context 1 --matmul-size 4096 --repeats 5 --json $R/train.jsonl > $R/bench.txt 2> $R/bench.err; echo "rc $?" >> $R/bench.txt
grep -A6 "index LSE (the KL" $R/bench.txt; grep -A6 "handed over by" $R/bench.txt | tail -4; tail -2 $R/bench.txt
timeout 60 ./tests/test_cuda_backward > $R/backward.txt 2>&1; echo "rc $?" >> $R/backward.txt
tail -2 $R/backward.txt
date -u >> $R/start.txt
tar czf $OUT/r.tgz -C /tmp r8
