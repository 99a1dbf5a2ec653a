#!/usr/bin/env bash
# ctest entry of the transformers parity tests: runs pytest in the venv that
# scripts/install_deps.sh builds. Usage: run_parity.sh PYTHON MSA_CLI [TEST_FILE]
# (TEST_FILE: default test_m3_parity.py, the text model; test_vision_parity.py the media input)
set -euo pipefail
python="$1"
export MSA_CLI="$2"
test_file="${3:-test_m3_parity.py}"
if [ ! -x "$python" ]; then
  echo "parity tests: no Python reference at $python; run scripts/install_deps.sh" >&2
  exit 1
fi
export PYTHONDONTWRITEBYTECODE=1
cd "$(dirname "$0")"
exec "$python" -m pytest -q -p no:cacheprovider -s "$test_file"
