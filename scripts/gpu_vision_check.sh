#!/usr/bin/env bash
# On the H200 machine: the vision tower on the GPU. Builds `msa` and test_cuda_vision with
# CUDA (build-gpu/, the folder scripts/gpu_check.sh uses: incremental when it exists), runs
# the vision GPU test (CUDA tower against the CPU), makes an m3-vision model (3.4 GB bf16:
# M3's ViT widths with 4 layers, m3-layer's text model; kept in MSA_VISION_MODEL, default
# /tmp/msa-m3-vision) and runs `msa run --image` on it with --device cuda and --device cpu
# (the generated token ids side by side), the same with a video (a folder of 4 frames), then `msa bench-model --vision` on cuda (672 x 672
# image and 64-frame 448 x 448 video). Everything lands in OUT_DIR/vision:
#   device.txt build.txt test.txt make_model.txt run_{cuda,cpu}.txt run_video_{cuda,cpu}.txt
#   bench.txt bench.jsonl
# Without network: pass the prefix scripts/pack_deps.sh makes as MSA_DEPS_PREFIX (default
# .deps/prefix when it exists). Environment: MSA_SKIP_VISION_BENCH=1, MSA_VISION_BENCH_ARGS
# (extra bench-model flags, e.g. --layers 32).
#
# usage: scripts/gpu_vision_check.sh OUT_DIR     (e.g. "$OUT")
set -uo pipefail
cd "$(dirname "$0")/.."
root=${1:?usage: scripts/gpu_vision_check.sh OUT_DIR}
source scripts/gpu_check_lib.sh
out="$(results_dir "$root/vision")"
model="${MSA_VISION_MODEL:-/tmp/msa-m3-vision}"
image=docs/images/attn_map_image_layer.png  # 606 x 456, in the repository
status=0

device_info "$out"

step "build (msa_cli, test_cuda_vision)"
configure_gpu_build "$out/build.txt"
build_gpu_targets "$out/build.txt" msa_cli test_cuda_vision
msa=build-gpu/tools/msa

step "test_cuda_vision"
build-gpu/tests/test_cuda_vision > "$out/test.txt" 2>&1 || status=1
grep -E "^\[  (PASSED|FAILED|  OK|SKIPPED) |max\|d\||Failure|Expected|Which is|expected" "$out/test.txt" | head -60

step "model (m3-vision, $model)"
if [ ! -f "$model/config.json" ]; then
  "$msa" make-model --config m3-vision --out "$model" > "$out/make_model.txt" 2>&1 ||
    { cat "$out/make_model.txt"; exit 1; }
fi
cat "$out/make_model.txt" 2>/dev/null

step "msa run --image (cuda, then cpu)"
for device in cuda cpu; do
  "$msa" run --model "$model" --image "$image" --prompt "What is in the picture?" --max-tokens 4 \
    --device "$device" > "$out/run_$device.txt" 2>&1 || { echo "run --device $device failed"; status=1; }
  echo "$device: $(head -1 "$out/run_$device.txt")"
  tail -1 "$out/run_$device.txt"
done
[ "$(head -1 "$out/run_cuda.txt" | cut -d' ' -f1)" = "$(head -1 "$out/run_cpu.txt" | cut -d' ' -f1)" ] ||
  echo "note: the first generated token differs between cuda and cpu (bf16 vs f32: a near tie, or a bug)"

step "msa run --video (a folder of 4 frames; cuda, then cpu)"
frames="$model-frames"
mkdir -p "$frames"
for i in 1 2 3 4; do cp "$image" "$frames/frame_$i.png"; done
for device in cuda cpu; do
  "$msa" run --model "$model" --video "$frames" --fps 2 --prompt "What happens in the video?" --max-tokens 4 \
    --device "$device" > "$out/run_video_$device.txt" 2>&1 || { echo "run --video --device $device failed"; status=1; }
  echo "$device: $(head -1 "$out/run_video_$device.txt")"
  tail -1 "$out/run_video_$device.txt"
done

if [ "${MSA_SKIP_VISION_BENCH:-0}" != 1 ]; then
  step "bench-model --vision (cuda)"
  # shellcheck disable=SC2086  # MSA_VISION_BENCH_ARGS is a list of flags
  "$msa" bench-model --vision --device cuda --config m3-vision --json "$out/bench.jsonl" \
    ${MSA_VISION_BENCH_ARGS:-} > "$out/bench.txt" 2>&1 || { echo "bench failed"; status=1; }
  cat "$out/bench.txt"
fi
exit $status
