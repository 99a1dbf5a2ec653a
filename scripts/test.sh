#!/usr/bin/env bash
# Build and run the whole test suite on a fresh machine. GPU tests (label "gpu") run only
# where a CUDA device is present; everything else runs everywhere.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh --tests
scripts/build.sh
exclude=()
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "no CUDA device: skipping tests labelled gpu"
  exclude=(-LE gpu)
fi
ctest --test-dir build --output-on-failure -j "$(nproc)" "${exclude[@]}"
scripts/test_python.sh  # the Python package (msa.torch, msa.vllm): CPU build + pytest
# The CPU suite again under ASan + UBSan, and each fuzz target for 60 s (docs/hardening.md).
scripts/sanitize_and_fuzz.sh 60
