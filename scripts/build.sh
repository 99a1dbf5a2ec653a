#!/usr/bin/env bash
# Configures and builds msa (Release) into ./build. Extra arguments go to cmake, e.g.
# -DMSA_CUDA=OFF. CUDA is built when nvcc is found (MSA_CUDA=AUTO).
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
ninja -C build -j "$(nproc)"
