#!/usr/bin/env bash
# On the H200 machine: `msa serve --device cuda` with the m3-layer preset. Builds `msa` with
# CUDA (build-gpu/, the folder scripts/gpu_check.sh uses: incremental when it exists), makes
# an m3-layer model (3 GB, kept in MSA_SERVE_MODEL, default /tmp/msa-m3-layer), starts the
# server, runs a short protocol check with the Python standard library
# (scripts/serve_check.py: the machine has no openai package), stops it, and runs
# `msa bench-serve` (bounded: each cell issues no new request after MSA_SERVE_CELL_SECONDS,
# default 15). Everything lands in OUT_DIR:
#   configure.log build.log make_model.log serve.log serve_check.txt bench_serve.md
#   bench_serve.err h200_serve.jsonl
# Without network: pass the prefix scripts/pack_deps.sh makes (GoogleTest, nlohmann-json,
# the header-only cpp-httplib, PCRE2 and libunistring for the tokenizer) as MSA_DEPS_PREFIX
# (default .deps/prefix when it exists).
# Environment: MSA_SERVE_BENCH_ARGS (replaces the default cells), MSA_SERVE_CACHE_TOKENS
# (default 1200000: 32 requests of 32K + 256 tokens), MSA_SKIP_SERVE_BENCH=1.
#
# usage: scripts/gpu_serve_check.sh OUT_DIR
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_check_lib.sh
out="$(results_dir "${1:?usage: scripts/gpu_serve_check.sh OUT_DIR}")"
model="${MSA_SERVE_MODEL:-/tmp/msa-m3-layer}"
cache_tokens="${MSA_SERVE_CACHE_TOKENS:-1200000}"
status=0
server=""
cleanup() { [ -n "$server" ] && kill "$server" 2>/dev/null && wait "$server" 2>/dev/null; }
trap cleanup EXIT

device_info "$out"

step "build (msa_cli, CUDA)"
configure_gpu_build "$out/configure.log"
grep -E "msa: (serve|tokenizer|CUDA)" "$out/configure.log"
grep -q "msa: serve ON" "$out/configure.log" ||
  { echo "msa serve is not built: cpp-httplib not found (MSA_DEPS_PREFIX from scripts/pack_deps.sh)"; exit 1; }
build_gpu_targets "$out/build.log" msa_cli
msa=build-gpu/tools/msa

step "model (m3-layer, $model)"
if [ ! -f "$model/config.json" ]; then
  "$msa" make-model --config m3-layer --out "$model" > "$out/make_model.log" 2>&1 ||
    { cat "$out/make_model.log"; exit 1; }
fi
cat "$out/make_model.log" 2>/dev/null

step "serve + protocol check"
"$msa" serve --model "$model" --device cuda --port 0 --cache-tokens "$cache_tokens" --max-batch 32 \
  --chunk 2048 --max-step-tokens 8192 > "$out/serve.log" 2>&1 &
server=$!
port=""
for _ in $(seq 1 600); do
  port=$(grep -o 'listening on http://127.0.0.1:[0-9]*' "$out/serve.log" | grep -o '[0-9]*$' || true)
  [ -n "$port" ] && break
  kill -0 "$server" 2>/dev/null || break
  sleep 0.2
done
if [ -z "$port" ]; then
  echo "msa serve did not start:"; tail -20 "$out/serve.log"; exit 1
fi
head -1 "$out/serve.log"
timeout 300 python3 scripts/serve_check.py "http://127.0.0.1:$port" "$msa" "$model" cuda \
  2>&1 | tee "$out/serve_check.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
kill "$server"; wait "$server" 2>/dev/null; server=""

if [ "${MSA_SKIP_SERVE_BENCH:-0}" != 1 ]; then
  step "bench-serve (m3-layer, cuda)"
  # shellcheck disable=SC2086  # MSA_SERVE_BENCH_ARGS is a list of flags
  timeout 900 "$msa" bench-serve --model "$model" --device cuda --cache-tokens "$cache_tokens" --max-batch 32 \
    --chunk 2048 --max-step-tokens 8192 --json "$out/h200_serve.jsonl" --label "m3-layer, H200" \
    ${MSA_SERVE_BENCH_ARGS:---concurrency 1,8,32 --prompt-tokens 1024,32768 --output-tokens 256 --cell-seconds ${MSA_SERVE_CELL_SECONDS:-15}} \
    > "$out/bench_serve.md" 2> "$out/bench_serve.err"
  echo "exit $?"; tail -8 "$out/bench_serve.err"; cat "$out/bench_serve.md"
fi
exit $status
