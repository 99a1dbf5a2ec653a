#!/usr/bin/env bash
# The main job on a fresh machine: install what is missing, build the `msa` tool, run
# `msa bench` on its built-in default workload (CPU; arguments are passed to `msa bench`).
# Builds into build-run/, with the CUDA kernels only where a GPU is present.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
cuda=OFF
if command -v nvcc >/dev/null 2>&1 && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  cuda=ON
fi
echo "==> configuring build-run/ (CUDA kernels: $cuda)"
cmake -S . -B build-run -G Ninja -DCMAKE_BUILD_TYPE=Release -DMSA_CUDA=$cuda -DMSA_BUILD_TESTS=OFF >/dev/null
echo "==> building the msa tool on $(nproc) cores"
set +e
ninja -C build-run -j "$(nproc)" msa_cli 2>&1 | tee build-run/build.log |
  awk '/^\[[0-9]+\/[0-9]+\]/ { if (++n % 10 == 1) { print "    " $1; fflush() } }'
status=${PIPESTATUS[0]}
set -e
if [ "$status" -ne 0 ]; then
  grep -E "error|FAILED" -A3 build-run/build.log | head -40 >&2
  echo "the build failed (full log: build-run/build.log)" >&2
  exit 1
fi
echo "==> msa bench $*"
exec ./build-run/tools/msa bench "$@"
