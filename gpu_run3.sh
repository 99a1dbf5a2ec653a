#!/usr/bin/env bash
set -uo pipefail
source scripts/gpu_check_lib.sh
R=/tmp/r3; mkdir -p $R
date -u > $R/start.txt
configure_gpu_build $R/build.log
build_gpu_targets $R/build.log test_cuda_kl test_cuda_backward test_training_smoke test_cuda_device_api
date -u >> $R/start.txt
cd build-gpu
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
F='Shapes/GpuKlTeacher.FromTheBackwardMatchesReference/Hkv2_G4_D128_Di128_B128*:Shapes/GpuKlTeacher.FromTheBackwardMatchesReference/Hkv1_G8_D128_Di128_B64*'
for tool in memcheck racecheck synccheck; do
  timeout 150 $SAN --tool $tool --error-exitcode 7 ./tests/test_cuda_kl --gtest_filter="$F" > $R/san_$tool.txt 2>&1; echo "rc $?" >> $R/san_$tool.txt
  echo "== $tool"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED|rc " $R/san_$tool.txt | tail -4
done
timeout 150 ./tests/test_cuda_kl --gtest_filter='-*GpuKlTeacher*' > $R/kl_all.txt 2>&1; echo "rc $?" >> $R/kl_all.txt
tail -3 $R/kl_all.txt
timeout 60 ./tests/test_cuda_device_api > $R/device_api.txt 2>&1; echo "rc $?" >> $R/device_api.txt
tail -3 $R/device_api.txt
timeout 120 ./tests/test_training_smoke --gtest_filter='Gpu*' > $R/smoke.txt 2>&1; echo "rc $?" >> $R/smoke.txt
tail -3 $R/smoke.txt
date -u >> $R/start.txt
tar czf $OUT/r.tgz -C /tmp r3
