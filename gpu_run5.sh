#!/usr/bin/env bash
set -uo pipefail
source scripts/gpu_check_lib.sh
R=/tmp/r5; mkdir -p $R
configure_gpu_build $R/build.log
build_gpu_targets $R/build.log msa_cli
cd build-gpu
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu)
timeout 400 $NCU --clock-control none --cache-control none --kernel-name regex:kl_given_teacher_kernel --launch-count 1 \
  --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis --section LaunchStats --section SchedulerStats \
  ./tools/msa bench --device cuda --training --training-seqs 32768 --cudnn 0 --dense-max-context 1 --repeats 1 --warmup 1 > $R/ncu.txt 2>&1; echo "rc $?" >> $R/ncu.txt
grep -E "kl_given|kl_entries|Duration|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|Issue Slots Busy|Eligible Warps|No Eligible|Warp Cycles Per Issued|Achieved Occupancy|Stall|L1/TEX Hit|L2 Hit|rc " $R/ncu.txt | head -60
tar czf $OUT/r.tgz -C /tmp r5
