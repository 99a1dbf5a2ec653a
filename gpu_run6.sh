#!/usr/bin/env bash
set -uo pipefail
source scripts/gpu_check_lib.sh
R=/tmp/r6; mkdir -p $R
configure_gpu_build $R/build.log
build_gpu_targets $R/build.log msa_cli
cd build-gpu
timeout 300 ./tools/msa bench --device cuda --training --training-seqs 32768,131072,8x16384 --cudnn 0 --dense-max-context 1 --matmul-size 4096 --repeats 5 --json $R/train.jsonl > $R/bench.txt 2> $R/bench.err; echo "rc $?" >> $R/bench.txt
grep -A6 "the student LSE" $R/bench.txt; grep -A6 "handed over by" $R/bench.txt | tail -4; tail -2 $R/bench.txt
tar czf $OUT/r.tgz -C /tmp r6
