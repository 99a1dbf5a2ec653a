#!/usr/bin/env bash
# The Python package in CI (CPU-only): builds `msa` with pip (no build isolation, CUDA off) into
# build/python-venv and runs its pytest suite (tests/python; GPU tests skip without a device).
# build/python-venv layers on build/parity-venv (scripts/install_deps.sh --tests: the pinned
# torch, numpy, pytest, tqdm of tests/parity/requirements-model.txt) through a .pth file, so no
# second torch is installed; the package's own build and example needs are pinned in
# tests/python/requirements.txt. The CMake build folder persists (build/python-cpu) and ccache
# serves repeated runs.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$(pwd)"
say() { echo "==> $*"; }
start=$(date +%s)

parity="$root/build/parity-venv"
if ! "$parity/bin/python" -c "import torch" 2>/dev/null; then
  scripts/install_deps.sh --tests
fi
venv="$root/build/python-venv"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
"$parity/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' > "$site/_msa_parity_venv.pth"

requirements="$root/tests/python/requirements.txt"
hash="$(sha256sum "$requirements" | cut -d' ' -f1)"
if [ "$(cat "$venv/.requirements.sha256" 2>/dev/null)" != "$hash" ]; then
  say "installing the Python package's build and test requirements into build/python-venv"
  "$venv/bin/pip" install -q --disable-pip-version-check --no-deps -r "$requirements"
  echo "$hash" > "$venv/.requirements.sha256"
fi

say "building the msa Python package (CPU-only) with pip"
"$venv/bin/pip" install -q --disable-pip-version-check --no-build-isolation --no-deps \
  -Ccmake.define.MSA_CUDA=OFF -Cbuild-dir="$root/build/python-cpu" "$root"
built=$(date +%s)

say "pytest tests/python"
cd "$root/tests/python"
status=0
"$venv/bin/python" -m pytest -q -p no:cacheprovider . || status=$?
echo "python package: build $((built - start)) s, tests $(( $(date +%s) - built )) s"
exit $status
