#!/usr/bin/env bash
# The main job on a fresh machine: install what is missing, build, run `msa bench` on its
# built-in default workload. Arguments are passed to `msa bench`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
scripts/build.sh
./build/msa bench "$@"
