#!/usr/bin/env bash
# The sanitizer and fuzz step of CI (scripts/test.sh runs it last), CPU only:
#   1. builds msa, its CPU tests and the libFuzzer targets of tests/fuzz once with clang,
#      AddressSanitizer and UndefinedBehaviorSanitizer into build-asan/ (ccache when present;
#      no network);
#   2. runs the CPU test suite there (ctest -LE gpu; the parity tests, which check numerics
#      against Python, and the package consumer, an uninstrumented project, run in the main
#      build's suite);
#   3. runs every fuzz target for SECONDS (default 60) from its seed corpus in
#      tests/fuzz/corpus/, and prints one line per target: executions, coverage (libFuzzer's
#      final cov: and ft:) and crashes.
# Exits non-zero when the build, a test or a fuzz target fails (a crash, a sanitizer report,
# a leak, a broken invariant, a timeout or the memory limit); the inputs that did it are
# kept in build-asan/fuzz/artifacts/.
#
# usage: scripts/sanitize_and_fuzz.sh [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-60}"
build=build-asan
targets=(fuzz_safetensors fuzz_config fuzz_tokenizer fuzz_chat_template fuzz_op_inputs fuzz_serve_request
         fuzz_image_decode)
jobs="$(nproc)"
start=$(date +%s)

for tool in clang clang++; do
  command -v "$tool" >/dev/null || { echo "sanitize_and_fuzz: $tool not found (scripts/install_deps.sh installs it)" >&2; exit 1; }
done

# -O1 with line tables: readable reports at a fraction of -O0's test time. No -DNDEBUG:
# assertions (nlohmann::json's among them) are findings too.
cmake -S . -B "$build" -G Ninja -DMSA_CUDA=OFF -DMSA_FUZZ=ON -DMSA_BUILD_TESTS=ON \
  -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -gline-tables-only" \
  -DCMAKE_CXX_FLAGS="-fsanitize=address,undefined,fuzzer-no-link -fno-sanitize-recover=all -fno-omit-frame-pointer" \
  >/dev/null
ninja -C "$build" -j "$jobs"
built=$(date +%s)

export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:strict_string_checks=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
echo "sanitize_and_fuzz: the CPU test suite under ASan+UBSan"
# The serve load test with 24 of its 200 requests: under the sanitizers the server is ~10x
# slower, and here it looks for memory errors and races, not throughput.
MSA_SERVE_LOAD_REQUESTS=24 ctest --test-dir "$build" -LE gpu -E "parity|package_consumer" -j "$jobs" --output-on-failure
tested=$(date +%s)

out="$build/fuzz"
rm -rf "$out"
mkdir -p "$out/artifacts"
summary=()
failed=0
for target in "${targets[@]}"; do
  binary="$build/tests/fuzz/$target"
  [ -x "$binary" ] || { echo "sanitize_and_fuzz: $binary was not built" >&2; exit 1; }
  mkdir -p "$out/corpus/$target"
  log="$out/$target.log"
  echo "sanitize_and_fuzz: $target for ${seconds}s"
  rc=0
  # New inputs go to build-asan/fuzz/corpus (the committed seeds stay as they are).
  "$binary" -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=25 -print_final_stats=1 \
    -artifact_prefix="$out/artifacts/$target-" "$out/corpus/$target" "tests/fuzz/corpus/$target" \
    >"$log" 2>&1 &
  pid=$!
  wait "$pid" || rc=$?
  # The target's scratch files (tests/fuzz/fuzz_util.h); libFuzzer ends without atexit.
  rm -rf "/dev/shm/msa_fuzz_$pid" "${TMPDIR:-/tmp}/msa_fuzz_$pid"
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -n 1)
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -n 1 | grep -o '[0-9]*')
  ft=$(grep -o 'ft: [0-9]*' "$log" | tail -n 1 | grep -o '[0-9]*')
  crashes=$(find "$out/artifacts" -name "$target-*" | wc -l)
  if [ "$rc" -ne 0 ] || [ "$crashes" -ne 0 ]; then
    failed=1
    [ "$crashes" -ne 0 ] || crashes=1
    echo "sanitize_and_fuzz: $target FAILED (exit $rc); the end of its log ($log):" >&2
    tail -n 40 "$log" >&2
  fi
  summary+=("$(printf '%-20s execs %-9s cov %-6s ft %-7s crashes %s' "$target" "${execs:-?}" "${cov:-?}" "${ft:-?}" "$crashes")")
done
end=$(date +%s)

echo "sanitize_and_fuzz: per target (${seconds}s each, ASan+UBSan):"
printf '  %s\n' "${summary[@]}"
echo "sanitize_and_fuzz: build $((built - start)) s, tests $((tested - built)) s, fuzzing $((end - tested)) s, total $((end - start)) s"
exit "$failed"
