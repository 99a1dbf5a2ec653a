#!/usr/bin/env bash
# On the H200 (no network; Python with torch, nanobind, scikit-build-core, pytest, numpy,
# matplotlib, tqdm already installed): builds the msa Python package with the CUDA kernels,
# runs the GPU pytest suite, the package benchmark and the training example on the GPU, and
# writes every log and plot into OUT_DIR (default gpu-python-results). About 5 minutes:
#   build   ~1-2 min on 16 cores (ccache and build/python-gpu make re-runs fast)
#   tests   ~1 min (tests/python, GPU and CPU)       bench  ~1 min       train  <= 3 min
# Usage: scripts/gpu_python_check.sh [OUT_DIR]  (python3 on the PATH is the interpreter used)
# MSA_SKIP_PY_BENCH=1 leaves the benchmark out (tests and the training example only).
set -uo pipefail
cd "$(dirname "$0")/.."
root="$(pwd)"
out="$(mkdir -p "${1:-gpu-python-results}" && cd "${1:-gpu-python-results}" && pwd)"
py=python3
step() { echo; echo "=== $* ($(date +%T)) ==="; }
status=0

step "device and tools"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/device.txt"
$py - <<'PY' 2>&1 | tee -a "$out/device.txt"
import importlib, sys
print("python", sys.version.split()[0])
for name in ("torch", "nanobind", "scikit_build_core", "pytest", "numpy", "matplotlib", "tqdm"):
    try:
        m = importlib.import_module(name)
        print(name, getattr(m, "__version__", "?"))
    except Exception as e:
        print(name, "MISSING", e)
PY

step "build (pip, no build isolation, CUDA on)"
# MSA_NATIVE=OFF as scripts/gpu_check.sh builds, so that ccache can share its objects.
if $py -m pip install --no-index --no-build-isolation --no-deps -v \
     -Ccmake.define.MSA_CUDA=ON -Ccmake.define.MSA_NATIVE=OFF -Cbuild-dir="$root/build/python-gpu" \
     "$root" > "$out/build.log" 2>&1; then
  tail -1 "$out/build.log"
else
  grep -E "error|Error" -A3 "$out/build.log" | head -40; echo "build failed: $out/build.log"; exit 1
fi
(cd /tmp && $py -c "import msa, msa.torch; print('msa', msa.__version__, 'cuda build:', msa.built_with_cuda())") \
  | tee -a "$out/device.txt"

step "pytest tests/python (GPU tests included)"
(cd tests/python && timeout 420 $py -m pytest -q -p no:cacheprovider -rs . > "$out/pytest.log" 2>&1) || status=1
tail -15 "$out/pytest.log"

if [ "${MSA_SKIP_PY_BENCH:-0}" != 1 ]; then
step "benchmark (bench/python/bench_msa_python.py)"
# The C++ decode step of the same machine, for the graph-replay comparison: scripts/gpu_check.sh's
# build (build-gpu) when present.
cpp=()
if [ -x build-gpu/tools/msa ]; then
  timeout 120 build-gpu/tools/msa bench --device cuda --contexts none --decode-contexts 8192,131072 \
    --batches 1 --queries 1 --cudnn 0 --json "$out/bench_cpp_decode.jsonl" > "$out/bench_cpp_decode.md" 2>&1 &&
    cpp=(--cpp-json "$out/bench_cpp_decode.jsonl")
fi
timeout 240 $py bench/python/bench_msa_python.py --out "$out/bench_python.md" "${cpp[@]}" > "$out/bench_python.log" 2>&1 || status=1
cat "$out/bench_python.md" 2>/dev/null || tail -20 "$out/bench_python.log"
fi

step "training example on the GPU (needles in 8K-32K tokens; stops once recall >= 0.9 holds)"
# stdout: one line per logged step and the summary; stderr (the tqdm bar, errors) to a file
timeout 300 $py examples/train_msa_lm.py --preset h200 --stop-at-target --out "$out/train" \
  2> "$out/train_stderr.log" | tee "$out/train_progress.log" || { status=1; tail -20 "$out/train_stderr.log"; }
$py - "$out/train/summary.json" <<'PY' || status=1
import json, sys
s = json.load(open(sys.argv[1]))
ok = s["final_recall"] >= s["config"]["target_recall"] and s["final_lm_loss"] < 0.5 * s["first_lm_loss"]
print(f"training: recall {s['first_recall']:.3f} -> {s['final_recall']:.3f} (chance {s['chance_recall']:.3f}), "
      f"LM loss {s['first_lm_loss']:.3f} -> {s['final_lm_loss']:.4f}, {s['steps_run']} steps in {s['seconds']} s: "
      + ("OK" if ok else "FAILED (target: recall >= 0.9, loss halved)"))
sys.exit(0 if ok else 1)
PY
echo
echo "logs and plots: $out (train/train_msa_lm.png, train/train_log.jsonl)"
exit $status
