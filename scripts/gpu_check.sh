#!/usr/bin/env bash
# On a machine with an NVIDIA Hopper GPU: build with CUDA, run the GPU tests, the memory and
# race checkers on the small cases, and the CUDA benchmark. Logs go to $1 (default
# ./gpu-results). Extra dependencies without network: pass a prefix holding GoogleTest and
# nlohmann-json as MSA_DEPS_PREFIX (scripts/pack_deps.sh makes one).
# Environment: MSA_SKIP_TESTS=1, MSA_CTEST_ARGS (extra ctest flags, e.g. '-R GpuKl' or a shard
# '-I 1,,2' / '-I 2,,2': the whole suite takes ~10 min on 16 cores, mostly CPU references),
# MSA_TEST_GPUS (e.g. 0,1: one shard per GPU at once, each on nproc / GPUs cores; ~5 min on
# two H200s and 32 cores), MSA_CTEST_JOBS (default: half the cores of a shard; each test's CPU
# side then gets OMP_NUM_THREADS = cores / jobs unless set), MSA_SKIP_SANITIZER=1, MSA_SKIP_BENCH=1, MSA_BENCH_ARGS
# (msa bench flags), MSA_BENCH_TRAINING=1 [MSA_TRAINING_ARGS], MSA_BENCH_MODEL=1 [MSA_MODEL_ARGS].
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-results}
mkdir -p "$out"
prefix_args=()
[ -n "${MSA_DEPS_PREFIX:-}" ] && prefix_args=(-DCMAKE_PREFIX_PATH="$(realpath "$MSA_DEPS_PREFIX")")
step() { echo; echo "=== $* ==="; }

step "device"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$out/device.txt"
nvcc --version | tail -1 | tee -a "$out/device.txt"

step "build"
cmake -S . -B build-gpu -G Ninja -DMSA_CUDA=ON -DMSA_NATIVE=OFF "${prefix_args[@]}" \
  > "$out/configure.log" 2>&1 || { tail -30 "$out/configure.log"; exit 1; }
ninja -C build-gpu -j "$(nproc)" > "$out/build.log" 2>&1 || { grep -E "error|Error" -A3 "$out/build.log" | head -60; exit 1; }
grep -E "registers|spill" "$out/build.log" | sort | uniq | head -40

status=0
if [ "${MSA_SKIP_TESTS:-0}" != 1 ]; then
  step "gpu tests"
  # MSA_TEST_GPUS=0,1[,...]: one ctest shard per listed GPU at once (-I i,,n), each on its
  # share of the cores; else every test on the default GPU.
  IFS=, read -r -a gpus <<< "${MSA_TEST_GPUS:-}"
  shards=${#gpus[@]}
  [ "$shards" -ge 1 ] || { gpus=(""); shards=1; }
  cores=$(( $(nproc) / shards > 0 ? $(nproc) / shards : 1 ))
  jobs=${MSA_CTEST_JOBS:-$(( cores / 2 > 0 ? cores / 2 : 1 ))}
  # The CPU references use OpenMP over every core by default: jobs x nproc spinning threads
  # would oversubscribe the machine, so each test gets its share (an unmeasured guess at the
  # suite's ~10 min, which is mostly CPU references; compare the next full run's time).
  threads=${OMP_NUM_THREADS:-$(( cores / jobs > 0 ? cores / jobs : 1 ))}
  pids=()
  rm -f "$out"/gpu_tests_*.log
  for i in "${!gpus[@]}"; do
    shard_args=() pin=()
    if [ "$shards" -gt 1 ]; then
      shard_args=(-I "$(( i + 1 )),,$shards")
      if command -v taskset > /dev/null && [ "$(nproc)" -ge "$shards" ]; then
        pin=(taskset -c "$(( i * cores ))-$(( (i + 1) * cores - 1 ))")
      fi
    fi
    # shellcheck disable=SC2086  # MSA_CTEST_ARGS is a list of flags
    env ${gpus[$i]:+CUDA_VISIBLE_DEVICES=${gpus[$i]}} OMP_NUM_THREADS="$threads" "${pin[@]}" \
      ctest --test-dir build-gpu -L gpu --output-on-failure -j "$jobs" "${shard_args[@]}" ${MSA_CTEST_ARGS:-} \
      > "$out/gpu_tests_$i.log" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
  cat "$out"/gpu_tests_*.log > "$out/gpu_tests.log"
  grep -E "tests passed|tests failed|Failed|\*\*\*" "$out/gpu_tests.log" | head -40
  grep -h "% of rows differ" "$out/gpu_tests.log" | sort | uniq -c | head -20
fi

if [ "${MSA_SKIP_SANITIZER:-0}" != 1 ]; then
  small='Shapes/GpuMatrix.*/Hkv1_G1*:GpuEmptyRows.*'
  for tool in memcheck racecheck; do
    step "compute-sanitizer $tool (small cases)"
    compute-sanitizer --tool "$tool" --error-exitcode 9 build-gpu/tests/test_cuda_ops \
      --gtest_filter="$small" > "$out/sanitizer_$tool.log" 2>&1
    echo "exit $?"; tail -4 "$out/sanitizer_$tool.log"
    # The decode graph replays (not DecodeGraphPremise: its refused API calls are reported).
    compute-sanitizer --tool "$tool" --error-exitcode 9 build-gpu/tests/test_cuda_graph \
      --gtest_filter='Plans/*' > "$out/sanitizer_graph_$tool.log" 2>&1
    echo "exit $?"; tail -4 "$out/sanitizer_graph_$tool.log"
    # Small cases of the other kernels: both sparse tile engines (wgmma, mma.sync; G 8 and the
    # tile counts' M3 cases take the TMA Q tiles, G 3 the cp.async gathers) and the
    # wgmma pipeline's tile counts, both index-scan engines, the fp8 index scan (varlen split tiles; paged bf16 and fp8 caches), dense decode, the backward, the KL
    # backward, the quantized decode scan and the fp8 K/V decode kernels (key split and rows per
    # warp, both scale layouts). (The fused selected-LSE scan, test_cuda_indexer_lse,
    # has no small case: its path needs >= 2 tiles per SM; only a one-off memcheck run of a
    # full-size case has covered it.)
    for spec in "test_cuda_ops:Shapes/GpuSparseWgmma.*/Hkv1_G3*:Shapes/GpuSparseWgmma.*/Hkv2_G8*:GpuSparseWgmmaTiles.*" \
                "test_cuda_indexer_wgmma:*EdgeLengths*" \
                "test_cuda_indexer_fp8:Shapes/GpuIndexerFp8.EdgeLengthsSplitTilesMatchReference/Hkv1_*:GpuIndexerFp8Paged.Bf16AndFp8CachesMatchReference" \
                "test_cuda_dense_decode:Shapes/GpuDenseDecode.*/*G4*" \
                "test_cuda_dense_wgmma:Shapes/GpuDenseWgmma.*/Hkv2_G4*" \
                "test_cuda_backward:Shapes/GpuBackward.*/Hkv1_G3*:GpuBackwardEmptyRows.*" \
                "test_cuda_kl:Shapes/GpuKl.*/Hkv3_G3*:GpuKlEmptyRows.*" \
                "test_cuda_quantized:GpuQuantizedDecode.MatchesCpuOnTheSameCache:GpuQuantizedDecode.LongChunksWrapTheRings" \
                "test_cuda_fp8_kv:Shapes/GpuFp8KvDecode.*/Hkv2_G4*" \
                "test_cuda_device_api:GpuDeviceApi.PagedDecodeMatchesTheHostOps"; do
      binary=${spec%%:*}
      compute-sanitizer --tool "$tool" --error-exitcode 9 "build-gpu/tests/$binary" \
        --gtest_filter="${spec#*:}" > "$out/sanitizer_${binary}_$tool.log" 2>&1
      echo "$binary exit $?"; tail -2 "$out/sanitizer_${binary}_$tool.log"
    done
  done
fi

if [ "${MSA_SKIP_BENCH:-0}" != 1 ]; then
  step "bench"
  build-gpu/tools/msa bench --device cuda --json "$out/bench_cuda.jsonl" ${MSA_BENCH_ARGS:-} \
    > "$out/bench_cuda.md" 2> "$out/bench_cuda.err"
  echo "exit $?"; tail -5 "$out/bench_cuda.err"; cat "$out/bench_cuda.md"
fi
# Opt-in extra benchmarks (each writes its own table): the training kernels and the CUDA model.
if [ "${MSA_BENCH_TRAINING:-0}" = 1 ]; then
  step "bench training"
  build-gpu/tools/msa bench --device cuda --training --contexts none --decode-contexts none \
    --json "$out/bench_training.jsonl" ${MSA_TRAINING_ARGS:-} > "$out/bench_training.md" 2>&1
  echo "exit $?"; tail -45 "$out/bench_training.md"  # four tables: stages, step vs dense, targets, gates
fi
if [ "${MSA_BENCH_MODEL:-0}" = 1 ]; then
  step "bench model"
  build-gpu/tools/msa bench-model --device cuda --json "$out/bench_model.jsonl" ${MSA_MODEL_ARGS:-} \
    > "$out/bench_model.md" 2>&1
  echo "exit $?"; tail -30 "$out/bench_model.md"
fi
exit $status
