// `msa preprocess`: an image or a video to the vision tower's pixel patches, written to a
// safetensors file (the parity tests compare it with transformers' processors; docs/vision.md).
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cli_args.h"
#include "commands.h"
#include "msa/ops.h"
#include "msa/safetensors.h"
#include "msa/vision_media.h"
#include "output_paths.h"

namespace msa::cli {
namespace {

constexpr const char* kPreprocessUsage =
    "usage: msa preprocess (--image FILE | --video FILE|DIR) --out OUT.safetensors [--model DIR]\n"
    "                      [--fps F] [--folder-fps F] [--keep-decoded] [--threads N]\n"
    "  the vision tower's input as MiniMax-M3's processors make it: tensors pixel_values\n"
    "  (f32 [patches, 3 * 2 * 14 * 14]), grid_thw (i64 [1, 3]) and resized (u8 [frames, H, W, 3]);\n"
    "  a video also timestamps (f64 seconds per temporal patch), frame_indices (i64) and\n"
    "  segments_thw (i64 [segments, 3], the ViT's attention segments)\n"
    "  (--model: the processor settings of a model directory, else the defaults; --fps: frames\n"
    "  sampled per second, default the config's; --folder-fps: the frame rate of a folder of\n"
    "  frames, default --fps; --keep-decoded: also `decoded`, the image as decoded, u8 [H, W, 3])\n";

Tensor image_tensor(const vision::Rgb8Image& image) {
  Tensor out = Tensor::zeros({image.height, image.width, 3}, DType::u8);
  std::memcpy(out.raw(), image.rgb.data(), image.rgb.size());
  return out;
}

Tensor frames_tensor(const std::vector<vision::Rgb8Image>& frames) {
  const vision::Rgb8Image& first = frames.front();
  Tensor out = Tensor::zeros({static_cast<int64_t>(frames.size()), first.height, first.width, 3}, DType::u8);
  auto* dst = static_cast<uint8_t*>(out.raw());
  for (const vision::Rgb8Image& frame : frames) {
    std::memcpy(dst, frame.rgb.data(), frame.rgb.size());
    dst += frame.rgb.size();
  }
  return out;
}

Tensor grid_tensor(const vision::PixelPatches& patches) {
  return Tensor::from_vector(std::vector<int64_t>{patches.grid_t, patches.grid_h, patches.grid_w}, {1, 3});
}

int preprocess(Args& args) {
  const std::string image_path = args.get_string("image", "");
  const std::string video_path = args.get_string("video", "");
  const std::string out = args.get_string("out");
  const std::string model_dir = args.get_string("model", "");
  const double fps = args.get_double("fps", 0, 0, 1e6, /*min_open=*/true);
  const double folder_fps = args.get_double("folder-fps", 0, 0, 1e6, /*min_open=*/true);
  const bool fps_given = args.has("fps"), folder_fps_given = args.has("folder-fps");
  const bool keep_decoded = args.get_switch("keep-decoded");
  set_num_threads(args.get_threads());
  args.finish();
  if (image_path.empty() == video_path.empty())
    throw UsageError("expected one of --image and --video");
  if (!image_path.empty() && (fps_given || folder_fps_given))
    throw UsageError("--fps and --folder-fps apply to --video only");
  if (!video_path.empty() && keep_decoded) throw UsageError("--keep-decoded applies to --image only");
  std::vector<NamedPath> inputs;
  if (!image_path.empty()) inputs.push_back({"image", image_path});
  if (!video_path.empty()) inputs.push_back({"video", video_path});
  if (!model_dir.empty()) inputs.push_back({"model", model_dir});
  check_output_path("out", out, inputs);

  std::vector<std::pair<std::string, Tensor>> tensors;
  std::map<std::string, std::string> metadata;
  if (!image_path.empty()) {
    const vision::ImageProcessorConfig config =
        model_dir.empty() ? vision::ImageProcessorConfig{} : vision::load_image_processor_config(model_dir);
    const vision::Rgb8Image image = vision::decode_image(image_path);
    const vision::PixelPatches patches = vision::preprocess_image(image, config);
    tensors = {{"pixel_values", patches.pixel_values},
               {"grid_thw", grid_tensor(patches)},
               {"resized", frames_tensor(patches.resized)}};
    if (keep_decoded) tensors.emplace_back("decoded", image_tensor(image));
    metadata["config"] = config.origin;
    std::printf("%s: %lldx%lld -> %lldx%lld, grid %lldx%lldx%lld (%lld patches, %lld tokens)\n",
                image_path.c_str(), static_cast<long long>(image.width),
                static_cast<long long>(image.height), static_cast<long long>(patches.resized[0].width),
                static_cast<long long>(patches.resized[0].height), static_cast<long long>(patches.grid_t),
                static_cast<long long>(patches.grid_h), static_cast<long long>(patches.grid_w),
                static_cast<long long>(patches.pixel_values.size(0)),
                static_cast<long long>(patches.pixel_values.size(0) / (config.pixels.merge_size * config.pixels.merge_size)));
  } else {
    const vision::VideoProcessorConfig config =
        model_dir.empty() ? vision::VideoProcessorConfig{} : vision::load_video_processor_config(model_dir);
    vision::VideoLoadOptions options;
    options.sample_fps = fps;
    options.folder_fps = folder_fps;
    const vision::VideoFrames video = vision::load_video(video_path, config, options);
    const vision::PixelPatches patches = vision::preprocess_video(video, config);
    std::vector<int64_t> segments;
    for (const auto& segment :
         vision::video_segments(patches.grid_t, patches.grid_h, patches.grid_w, config.vision_segment_max_frames))
      segments.insert(segments.end(), segment.begin(), segment.end());
    const auto segment_count = static_cast<int64_t>(segments.size() / 3);
    tensors = {{"pixel_values", patches.pixel_values},
               {"grid_thw", grid_tensor(patches)},
               {"resized", frames_tensor(patches.resized)},
               {"timestamps", Tensor::from_vector(patches.timestamps, {static_cast<int64_t>(patches.timestamps.size())})},
               {"frame_indices", Tensor::from_vector(video.frame_indices, {static_cast<int64_t>(video.frame_indices.size())})},
               {"segments_thw", Tensor::from_vector(segments, {segment_count, 3})}};
    metadata["config"] = config.origin;
    metadata["source_fps"] = msa::detail::concat(video.source_fps);
    metadata["source_frames"] = std::to_string(video.source_frames);
    std::printf("%s: %lld of %lld frames at %g fps, %lldx%lld -> %lldx%lld, grid %lldx%lldx%lld\n",
                video_path.c_str(), static_cast<long long>(video.frames.size()),
                static_cast<long long>(video.source_frames), video.source_fps,
                static_cast<long long>(video.source_width), static_cast<long long>(video.source_height),
                static_cast<long long>(patches.resized[0].width), static_cast<long long>(patches.resized[0].height),
                static_cast<long long>(patches.grid_t), static_cast<long long>(patches.grid_h),
                static_cast<long long>(patches.grid_w));
  }
  save_safetensors(out, tensors, metadata);
  return 0;
}

}  // namespace
}  // namespace msa::cli

int run_preprocess_command(int argc, char** argv) {
  using namespace msa::cli;
  return run_reporting_errors("preprocess", kPreprocessUsage, [&] {
    Args args(argc, argv, {"help", "keep-decoded"});
    if (args.has("help")) {
      std::fputs(kPreprocessUsage, stdout);
      return 0;
    }
    return preprocess(args);
  });
}
