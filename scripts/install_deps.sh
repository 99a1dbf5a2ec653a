#!/usr/bin/env bash
# Installs what msa needs, when it is missing. Without arguments: what the build and the main
# job (`msa bench`) need. With --tests: also the test tools (GoogleTest, the cuDNN frontend
# headers of the GPU benchmark's baseline, the pinned Python environments of the parity tests).
set -euo pipefail
tests=0
[ "${1:-}" = --tests ] && tests=1
say() { echo "==> $*"; }
# libopenblas-openmp-dev: the model's GEMMs (OpenMP build, so it shares our OpenMP threads).
# libcpp-httplib-dev: the HTTP server of `msa serve` (docs/serve.md).
# libpng-dev, libjpeg-dev (libjpeg-turbo): images for the vision tower; pkg-config and
# FFmpeg's libavformat/libavcodec/libswscale/libavutil: video files (docs/vision.md; the
# build works without FFmpeg, taking folders of frames only).
packages=(cmake ninja-build g++ ccache nlohmann-json3-dev libpcre2-dev libunistring-dev
          libopenblas-openmp-dev libcpp-httplib-dev libpng-dev libjpeg-dev pkg-config
          libavformat-dev libavcodec-dev libswscale-dev libavutil-dev)
# The tests: GoogleTest; Python for the parity tests; clang, libclang-rt-dev (sanitizer and
# libFuzzer runtimes) and libomp-dev (clang's OpenMP) for the ASan + UBSan build and the fuzz
# targets of scripts/sanitize_and_fuzz.sh.
[ "$tests" = 1 ] && packages+=(libgtest-dev libgmock-dev python3 python3-venv python3-pip
                               clang libclang-rt-dev libomp-dev)
missing=()
for package in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" ||
    missing+=("$package")
done
if [ ${#missing[@]} -gt 0 ]; then
  say "installing Debian packages: ${missing[*]}"
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${missing[@]}" >/dev/null
fi

[ "$tests" = 1 ] || exit 0

# The header-only cuDNN frontend (C++ graph API over cuDNN 9), used by the cuDNN dense
# baseline of `msa bench --device cuda`. Fetched from its PyPI wheel into .deps/ when
# missing; the build skips the baseline when it is absent (no network: not an error).
cudnn_frontend_version=1.32.0
cudnn_frontend_dir="$(dirname "$0")/../.deps/cudnn_frontend"
if [ ! -f "$cudnn_frontend_dir/include/cudnn_frontend.h" ]; then
  say "fetching nvidia-cudnn-frontend==$cudnn_frontend_version headers into .deps/"
  tmp="$(mktemp -d)"
  if python3 -m pip download -q --no-deps --only-binary=:all: \
       "nvidia-cudnn-frontend==$cudnn_frontend_version" -d "$tmp" &&
     wheel="$(ls "$tmp"/nvidia_cudnn_frontend-*.whl | head -n 1)" && [ -n "$wheel" ]; then
    mkdir -p "$cudnn_frontend_dir"
    # The wheel is a zip; its C++ headers sit under include/ (python3 needs no unzip).
    python3 - "$wheel" "$cudnn_frontend_dir" <<'PY'
import sys, zipfile
wheel, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.startswith("include/")]
    if not names:
        sys.exit(f"{wheel}: no include/ folder")
    z.extractall(dest, members=names)
PY
  else
    echo "warning: could not fetch nvidia-cudnn-frontend; the cuDNN baseline will be skipped" >&2
  fi
  rm -rf "$tmp"
fi

# Python packages of the tokenizer parity test (tokenizers, jinja2), in the venv build/venv
# (Debian's python3 refuses `pip install --user`). pip skips what is already installed.
venv="$(dirname "$0")/../build/venv"
if [ ! -x "$venv/bin/python3" ]; then
  say "creating the Python venv $venv (tokenizer parity: tokenizers, jinja2)"
  python3 -m venv "$venv"
fi
"$venv/bin/python3" -m pip install -q --disable-pip-version-check \
  -r "$(dirname "$0")/../tests/parity/requirements-tokenizer.txt"

# The openai client of the `msa serve` protocol and load tests (tests/serve), pinned in
# tests/serve/requirements.txt, in build/serve-venv; rebuilt when the pins change.
serve_requirements="$(cd "$(dirname "$0")/.." && pwd)/tests/serve/requirements.txt"
serve_venv="$(cd "$(dirname "$0")/.." && pwd)/build/serve-venv"
serve_hash="$(sha256sum "$serve_requirements" | cut -d' ' -f1)"
if [ "$(cat "$serve_venv/.requirements.sha256" 2>/dev/null)" != "$serve_hash" ]; then
  say "installing the openai client for the serve tests into build/serve-venv"
  python3 -m venv --clear "$serve_venv"
  if "$serve_venv/bin/pip" install -q --disable-pip-version-check --no-deps -r "$serve_requirements" &&
     "$serve_venv/bin/python" -c "import openai"; then
    echo "$serve_hash" > "$serve_venv/.requirements.sha256"
  else
    echo "warning: the serve-test environment did not install; serve_protocol and serve_load will fail" >&2
  fi
fi

# The Python reference of the model and media parity tests (transformers, torch, torchvision
# on the CPU), pinned in tests/parity/requirements-model.txt, in build/parity-venv; rebuilt
# when the pins change.
repo_root="$(cd "$(dirname "$0")/.." && pwd)"
parity_requirements="$repo_root/tests/parity/requirements-model.txt"
parity_venv="$repo_root/build/parity-venv"
parity_hash="$(sha256sum "$parity_requirements" | cut -d' ' -f1)"
if [ "$(cat "$parity_venv/.requirements.sha256" 2>/dev/null)" != "$parity_hash" ]; then
  say "installing the parity-test Python environment into build/parity-venv (~1 GB download)"
  python3 -m venv --clear "$parity_venv"
  if "$parity_venv/bin/pip" install -q --disable-pip-version-check --no-deps \
       -r "$parity_requirements" &&
     "$parity_venv/bin/python" -c "import torch, torchvision, PIL, transformers" ; then
    echo "$parity_hash" > "$parity_venv/.requirements.sha256"
  else
    echo "warning: the parity-test environment did not install; model_parity_transformers and vision_parity_transformers will fail" >&2
  fi
fi
