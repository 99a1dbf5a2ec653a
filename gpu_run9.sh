#!/usr/bin/env bash
set -uo pipefail
source scripts/gpu_check_lib.sh
R=/tmp/r9; mkdir -p $R
configure_gpu_build $R/build.log
build_gpu_targets $R/build.log test_cuda_kl msa_cli
cd build-gpu
timeout 130 ./tests/test_cuda_kl > $R/kl.txt 2>&1; echo "rc $?" >> $R/kl.txt
grep -E "FAILED|Failure" -A3 $R/kl.txt | head; tail -2 $R/kl.txt
timeout 100 ./tools/msa bench --device cuda --training --training-seqs 32768,131072,8x16384 --cudnn 0 --dense-max-context 1 --matmul-size 4096 --repeats 5 --json $R/train.jsonl > $R/bench.txt 2> $R/bench.err; echo "rc $?" >> $R/bench.txt
grep -A6 "index LSE (the KL" $R/bench.txt; grep -A6 "handed over by" $R/bench.txt | tail -4; tail -2 $R/bench.txt
tar czf $OUT/r.tgz -C /tmp r9
