#!/usr/bin/env bash
# ctest entry of the transformers parity tests (the text model, the vision tower): runs pytest
# in the venv that scripts/install_deps.sh builds. Usage: run_parity.sh PYTHON MSA_CLI
set -euo pipefail
python="$1"
export MSA_CLI="$2"
if [ ! -x "$python" ]; then
  echo "parity tests: no Python reference at $python; run scripts/install_deps.sh" >&2
  exit 1
fi
export PYTHONDONTWRITEBYTECODE=1
cd "$(dirname "$0")"
exec "$python" -m pytest -q -p no:cacheprovider -s test_m3_parity.py test_m3_vision_parity.py
