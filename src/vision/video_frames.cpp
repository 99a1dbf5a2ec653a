// load_video and sample_frame_indices: which frames of a video file or a folder of frames
// to keep, and keeping them (at the processor's size with resize_on_load) within a budget.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>

#include "msa/vision_media.h"
#include "vision/video_file.h"

namespace msa::vision {
namespace {

namespace fs = std::filesystem;

bool is_frame_file(const fs::path& path) {
  std::string extension = path.extension().string();
  for (char& c : extension) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  const std::string stem = path.filename().string();
  return !stem.empty() && stem[0] != '.' &&
         (extension == ".png" || extension == ".jpg" || extension == ".jpeg");
}

// Natural order: runs of digits compare as numbers ("f2" < "f10"; "f02" and "f2" by
// length of the run, then by text), everything else byte by byte.
bool natural_less(const std::string& a, const std::string& b) {
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    const bool digit_a = std::isdigit(static_cast<unsigned char>(a[i])) != 0;
    const bool digit_b = std::isdigit(static_cast<unsigned char>(b[j])) != 0;
    if (digit_a && digit_b) {
      size_t end_a = i, end_b = j;
      while (end_a < a.size() && std::isdigit(static_cast<unsigned char>(a[end_a]))) ++end_a;
      while (end_b < b.size() && std::isdigit(static_cast<unsigned char>(b[end_b]))) ++end_b;
      size_t lead_a = i, lead_b = j;  // skip leading zeros to compare values
      while (lead_a + 1 < end_a && a[lead_a] == '0') ++lead_a;
      while (lead_b + 1 < end_b && b[lead_b] == '0') ++lead_b;
      const std::string_view value_a(a.data() + lead_a, end_a - lead_a);
      const std::string_view value_b(b.data() + lead_b, end_b - lead_b);
      if (value_a.size() != value_b.size()) return value_a.size() < value_b.size();
      if (value_a != value_b) return value_a < value_b;
      if (end_a - i != end_b - j) return end_a - i < end_b - j;
      i = end_a;
      j = end_b;
    } else {
      if (a[i] != b[j]) return static_cast<unsigned char>(a[i]) < static_cast<unsigned char>(b[j]);
      ++i;
      ++j;
    }
  }
  return a.size() - i < b.size() - j;
}

std::vector<fs::path> list_frame_files(const std::string& dir, const std::string& name) {
  std::vector<fs::path> files;
  std::error_code error;
  fs::directory_iterator it(dir, error);
  if (error) throw Error(name + ": cannot list it (" + error.message() + ")");
  for (; it != fs::directory_iterator(); it.increment(error)) {
    if (error) throw Error(name + ": cannot list it (" + error.message() + ")");
    std::error_code type_error;
    if (is_frame_file(it->path()) && fs::is_regular_file(it->path(), type_error))
      files.push_back(it->path());
  }
  std::sort(files.begin(), files.end(), [](const fs::path& a, const fs::path& b) {
    return natural_less(a.filename().string(), b.filename().string());
  });
  return files;
}

// Keeps decoded frames: the first fixes the source size (and the resize target); every
// later one must match; the stored bytes stay within the budget.
class FrameStore {
 public:
  FrameStore(VideoFrames& video, const VideoProcessorConfig& config, const VideoLoadOptions& options,
             std::string name)
      : video_(video), config_(config), options_(options), name_(std::move(name)) {}

  // The bytes `count` frames of width x height will take once stored; refuses more than
  // the budget before anything is decoded.
  void reserve(int64_t count, int64_t width, int64_t height) {
    const auto [h, w] = stored_size(height, width);
    const int64_t per_frame = h * w * 3;
    if (per_frame > 0 && count > options_.max_stored_bytes / per_frame)
      throw Error(name_ + ": " + std::to_string(count) + " frames of " + std::to_string(w) + "x" +
                  std::to_string(h) + " take more than " + std::to_string(options_.max_stored_bytes) +
                  " bytes (VideoLoadOptions::max_stored_bytes; sample fewer frames: fps, max_frames)");
    video_.frames.reserve(static_cast<size_t>(count));
  }

  void keep(int64_t index, Rgb8Image frame) {
    if (video_.frames.empty()) {
      video_.source_width = frame.width;
      video_.source_height = frame.height;
      target_ = stored_size(frame.height, frame.width);
    } else if (frame.width != video_.source_width || frame.height != video_.source_height) {
      throw Error(name_ + ": frame " + std::to_string(index) + " is " + std::to_string(frame.width) +
                  "x" + std::to_string(frame.height) + ", the first kept frame " +
                  std::to_string(video_.source_width) + "x" + std::to_string(video_.source_height) +
                  " (expected frames of one size)");
    }
    if (options_.resize_on_load) frame = resize_bicubic_antialias(frame, target_.first, target_.second);
    stored_bytes_ += static_cast<int64_t>(frame.rgb.size());
    if (stored_bytes_ > options_.max_stored_bytes)
      throw Error(name_ + ": the kept frames take more than " + std::to_string(options_.max_stored_bytes) +
                  " bytes (VideoLoadOptions::max_stored_bytes)");
    video_.frames.push_back(std::move(frame));
    video_.frame_indices.push_back(index);
  }

 private:
  std::pair<int64_t, int64_t> stored_size(int64_t height, int64_t width) const {
    if (!options_.resize_on_load) return {height, width};
    const PixelSettings& p = config_.pixels;
    if (!p.do_resize) return {height, width};
    return smart_resize(height, width, p.factor(), p.min_pixels, p.max_pixels);
  }

  VideoFrames& video_;
  const VideoProcessorConfig& config_;
  const VideoLoadOptions& options_;
  std::string name_;
  std::pair<int64_t, int64_t> target_{0, 0};
  int64_t stored_bytes_ = 0;
};

void check_rate(double fps, const std::string& what) {
  if (!(fps > 0) || !std::isfinite(fps) || fps > 1e6)
    throw Error(what + ": expected a frame rate in (0, 1e6], got " + msa::detail::concat(fps));
}

}  // namespace

std::vector<int64_t> sample_frame_indices(int64_t total_frames, double source_fps, double target_fps,
                                          int64_t num_frames, int64_t min_frames, int64_t max_frames) {
  MSA_CHECK_ARG(total_frames >= 1 && total_frames <= (int64_t{1} << 40), "total_frames", "[1, 2^40]",
                total_frames);
  MSA_CHECK_ARG(source_fps > 0 && std::isfinite(source_fps), "source_fps", "a positive frame rate", source_fps);
  MSA_CHECK_ARG(target_fps > 0 && std::isfinite(target_fps), "target_fps", "a positive frame rate", target_fps);
  MSA_CHECK_ARG(num_frames >= 0, "num_frames", ">= 0 (0: sample by fps)", num_frames);
  MSA_CHECK_ARG(min_frames >= 1 && max_frames >= min_frames && max_frames <= (int64_t{1} << 20),
                "min_frames, max_frames", "1 <= min_frames <= max_frames <= 2^20",
                std::to_string(min_frames) + ", " + std::to_string(max_frames));
  int64_t count = num_frames;
  if (count == 0) {
    // Python's int() truncates; the order of the operations is transformers'.
    const double estimate = static_cast<double>(total_frames) / source_fps * target_fps;
    count = estimate >= static_cast<double>(max_frames) ? max_frames
                                                        : std::max<int64_t>(1, static_cast<int64_t>(estimate));
  }
  count = std::min(std::clamp(count, min_frames, max_frames), total_frames);
  std::vector<int64_t> indices(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) indices[static_cast<size_t>(i)] = i * total_frames / count;
  return indices;
}

VideoFrames load_video(const std::string& file_or_dir, const VideoProcessorConfig& config,
                       const VideoLoadOptions& options) {
  MSA_CHECK_ARG(options.sample_fps >= 0 && std::isfinite(options.sample_fps), "sample_fps",
                ">= 0 (0: the config's fps)", options.sample_fps);
  const double sample_fps = options.sample_fps > 0 ? options.sample_fps : config.fps;
  check_rate(sample_fps, "video sampling rate");
  MSA_CHECK_ARG(options.folder_fps >= 0 && std::isfinite(options.folder_fps), "folder_fps",
                ">= 0 (0: the sampling rate)", options.folder_fps);
  VideoFrames video;
  std::error_code error;
  const fs::file_status status = fs::status(file_or_dir, error);
  if (status.type() == fs::file_type::directory) {
    const std::string name = "frames folder '" + file_or_dir + "'";
    video.origin = name;
    const std::vector<fs::path> files = list_frame_files(file_or_dir, name);
    if (files.empty()) throw Error(name + ": no frames (expected .png, .jpg or .jpeg files)");
    video.source_frames = static_cast<int64_t>(files.size());
    video.source_fps = options.folder_fps > 0 ? options.folder_fps : sample_fps;
    check_rate(video.source_fps, name + " frame rate");
    const std::vector<int64_t> wanted =
        sample_frame_indices(video.source_frames, video.source_fps, sample_fps, config.num_frames,
                             config.min_frames, config.max_frames);
    FrameStore store(video, config, options, name);
    for (const int64_t index : wanted) {
      Rgb8Image frame = decode_image(files[static_cast<size_t>(index)].string(), options.limits);
      if (video.frames.empty()) store.reserve(static_cast<int64_t>(wanted.size()), frame.width, frame.height);
      store.keep(index, std::move(frame));
    }
    return video;
  }
  const std::string name = "video '" + file_or_dir + "'";
  video.origin = name;
  if (status.type() == fs::file_type::not_found || status.type() == fs::file_type::none)
    throw Error(name + ": no such file or folder");
  if (status.type() != fs::file_type::regular)
    throw Error(name + ": expected a video file or a folder of frames, got another kind of file");
#ifdef MSA_WITH_FFMPEG
  FrameStore store(video, config, options, name);
  detail::read_video_file(
      file_or_dir, name, options.limits,
      [&](const detail::VideoStreamInfo& info) {
        video.source_frames = info.frames;
        video.source_fps = info.fps;
        check_rate(info.fps, name + " frame rate");
        std::vector<int64_t> wanted = sample_frame_indices(info.frames, info.fps, sample_fps, config.num_frames,
                                                           config.min_frames, config.max_frames);
        store.reserve(static_cast<int64_t>(wanted.size()), info.width, info.height);
        return wanted;
      },
      [&](int64_t index, Rgb8Image frame) { store.keep(index, std::move(frame)); });
  return video;
#else
  throw Error(name + ": a video file, but msa was built without FFmpeg (libavformat-dev, libavcodec-dev, "
              "libswscale-dev, libavutil-dev); a folder of frames works without it");
#endif
}

}  // namespace msa::vision
