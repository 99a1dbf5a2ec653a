// MiniMax-M3's media front end on the CPU: PNG / JPEG images and video (a file through FFmpeg,
// or a folder of frames) to the vision tower's pixel patches, as transformers'
// MiniMaxM3VLImageProcessor and MiniMaxM3VLVideoProcessor compute them (docs/vision.md).
//
//   auto config = msa::vision::load_image_processor_config(model_dir);   // defaults without a file
//   auto image = msa::vision::decode_image("cat.png");
//   auto patches = msa::vision::preprocess_image(image, config);
//   // patches.pixel_values f32 [grid_t * grid_h * grid_w, 3 * 2 * 14 * 14], grid (1, h, w)
//
// Every failure is an msa::Error naming the file or field, what was expected and what came;
// no input makes a decoder abort or allocate beyond DecodeLimits.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "msa/tensor.h"

namespace msa::vision {

// 8-bit RGB, rows top to bottom, each pixel R, G, B (height * width * 3 bytes).
struct Rgb8Image {
  int64_t width = 0, height = 0;
  std::vector<uint8_t> rgb;
};

// What one decode may allocate. Checked from the header (PNG IHDR, JPEG SOF, the video
// stream's parameters) before any pixel buffer exists.
struct DecodeLimits {
  // width * height of one image or video frame: 2^28 pixels is 768 MiB of RGB (a decode
  // holds at most 4 bytes a pixel: RGBA or CMYK before conversion).
  int64_t max_pixels = int64_t{1} << 28;
  // Either side of an image or frame (libpng's own default limit; JPEG allows 65500).
  int64_t max_side = 1000000;
  // An image file is read into memory whole before decoding.
  int64_t max_file_bytes = int64_t{1} << 30;
};

// Which codecs this build has (PNG: libpng, JPEG: libjpeg-turbo, video files: FFmpeg's
// libavformat / libavcodec / libswscale). Without one, decoding that format is an msa::Error
// saying so; folders of frames need only the image codecs.
struct MediaSupport {
  bool png = false, jpeg = false, video_files = false;
};
MediaSupport media_support();

// Decodes a PNG or JPEG file (recognised by its first bytes, not its name) to RGB8 the way
// transformers loads an image file (load_image: PIL's Image.open, convert("RGB"); the
// processors' own loader, torchvision's RGB decode, gives the same pixels):
//   - grey (1, 2, 4, 8 bit), palette and RGB as they are; 16-bit samples keep their high
//     byte (PIL does so for RGB, RGBA and grey+alpha; for 16-bit grey without alpha PIL
//     clips values above 255 to white, which msa does not copy);
//   - alpha (an alpha channel, or a tRNS chunk) is dropped, as convert("RGB") does (only a
//     PIL image with alpha handed to a processor directly is composited onto white there);
//   - JPEG: grey, YCbCr, RGB; CMYK and YCCK as Adobe's inverted CMYK (PIL's convention,
//     for every 4-channel JPEG), converted to RGB with PIL's formula;
//   - EXIF orientation is ignored (transformers' loaders apply it), as are gamma and ICC
//     profiles (PIL ignores them too).
// Missing, unreadable, empty, truncated or corrupt files, formats other than PNG / JPEG and
// images beyond `limits` are msa::Error naming the file. libjpeg warnings that mean lost
// data (premature end, corrupt entropy data) are errors too.
Rgb8Image decode_image(const std::string& path, const DecodeLimits& limits = {});
// The same from bytes in memory; `name` is what errors call them.
Rgb8Image decode_image_bytes(const uint8_t* data, size_t size, const std::string& name,
                             const DecodeLimits& limits = {});

// What images and video frames share: the resize bounds and the patch geometry.
struct PixelSettings {
  int64_t min_pixels = 0;  // smart_resize's bounds on height * width after resizing
  int64_t max_pixels = 0;
  int64_t patch_size = 14;
  int64_t temporal_patch_size = 2;
  int64_t merge_size = 2;
  std::array<double, 3> image_mean = {0.48145466, 0.4578275, 0.40821073};  // OpenAI CLIP
  std::array<double, 3> image_std = {0.26862954, 0.26130258, 0.27577711};
  double rescale_factor = 1.0 / 255.0;
  bool do_resize = true, do_rescale = true, do_normalize = true;

  int64_t factor() const { return patch_size * merge_size; }  // sides are multiples of it
  int64_t patch_values() const { return 3 * temporal_patch_size * patch_size * patch_size; }
};

// MiniMaxM3VLImageProcessor's settings. The defaults are the class's (transformers 5.24):
// min_pixels 56 * 56, max_pixels 451584 (672^2).
struct ImageProcessorConfig {
  PixelSettings pixels{.min_pixels = 56 * 56, .max_pixels = 451584};
  std::string origin = "defaults";  // the file the values came from
};

// MiniMaxM3VLVideoProcessor's settings (class defaults: min_pixels 4 * 28^2, max_pixels
// 768 * 28^2 per frame, fps 1, 4 to 768 frames, segments of at most 4 temporal patches).
struct VideoProcessorConfig {
  PixelSettings pixels{.min_pixels = 4 * 28 * 28, .max_pixels = 768 * 28 * 28};
  double fps = 1.0;           // frames sampled per second of video
  int64_t num_frames = 0;     // > 0: sample exactly this many frames instead (fps unused)
  int64_t min_frames = 4;     // the sampled count is clamped to [min_frames, max_frames]
  int64_t max_frames = 768;   // (and to the frames the video has)
  int64_t vision_segment_max_frames = 4;  // temporal patches per ViT segment; 0: one segment
  std::string origin = "defaults";
};

// Reads the processor settings of a model directory the way transformers' from_pretrained
// looks for them: processor_config.json's "image_processor" / "video_processor" object,
// else preprocessor_config.json (images) or video_preprocessor_config.json, then
// preprocessor_config.json (videos); the class defaults when none is there. Keys read:
// size {shortest_edge, longest_edge} (images; the legacy [672, 672] means the defaults),
// min_pixels, max_pixels, patch_size, temporal_patch_size, merge_size, image_mean,
// image_std, rescale_factor, do_resize, do_rescale, do_normalize, resample (must be 3,
// bicubic), and for videos fps, num_frames, min_frames, max_frames,
// vision_segment_max_frames. Other keys are ignored; a bad value is an msa::Error naming
// the file and the field.
ImageProcessorConfig load_image_processor_config(const std::string& model_dir);
VideoProcessorConfig load_video_processor_config(const std::string& model_dir);
// One processor's JSON object as text (no file lookup); `origin` names it in errors.
ImageProcessorConfig parse_image_processor_config(std::string_view json_text,
                                                  const std::string& origin);
VideoProcessorConfig parse_video_processor_config(std::string_view json_text,
                                                  const std::string& origin);

// transformers' smart_resize: the {height, width} nearest to the input's aspect ratio with
// both sides multiples of `factor` and height * width within [min_pixels, max_pixels]
// (the rounding exactly as Python's: round half to even, floor, ceil on doubles). An aspect
// ratio above 200 is an msa::Error.
std::pair<int64_t, int64_t> smart_resize(int64_t height, int64_t width, int64_t factor,
                                         int64_t min_pixels, int64_t max_pixels);

// torchvision.transforms.v2.functional.resize(uint8 image, bicubic, antialias=True) on the
// CPU, bit for bit: PIL-style separable antialiased bicubic (a = -0.5) with weights in f64
// rounded to int16 fixed point, horizontal pass first into a uint8 intermediate, each pass
// rounded and clamped to [0, 255]. An axis whose size does not change is not filtered.
Rgb8Image resize_bicubic_antialias(const Rgb8Image& image, int64_t height, int64_t width);

// The vision tower's input.
struct PixelPatches {
  // f32 [grid_t * grid_h * grid_w, 3 * temporal_patch_size * patch_size^2]. Rows: for each
  // temporal patch t, each merge_size x merge_size window in raster order, each patch of the
  // window in raster order (patch row h = merge_size * window_row + mh, likewise w). Within
  // a row: [channel][frame of the pair][patch_size][patch_size].
  Tensor pixel_values;
  int64_t grid_t = 0, grid_h = 0, grid_w = 0;
  // The resized RGB8 image (one), or the video's sampled frames after resizing (before
  // padding to an even count).
  std::vector<Rgb8Image> resized;
  // Video: the time in seconds of each temporal patch (its first frame's index in the
  // source / the source's frame rate), what the chat template prints as "]<]{t:.1f} seconds[>[".
  std::vector<double> timestamps;
};

// An image: resized to smart_resize's size, rescaled and normalised, its frame repeated
// temporal_patch_size times (grid_t = 1).
PixelPatches preprocess_image(const Rgb8Image& image, const ImageProcessorConfig& config);

// How load_video reads a video.
struct VideoLoadOptions {
  double sample_fps = 0;  // frames per second to sample; 0: the config's fps
  // The frame rate of a folder of frames (timestamps and sampling follow it); 0: the
  // sampling rate, i.e. the folder holds frames already sampled (all are used, up to
  // max_frames).
  double folder_fps = 0;
  // Store each frame at the processor's size as it is decoded (the resize is per frame, so
  // the patches are the same; a 1080p frame takes 6 MB, a resized one at most 1.8 MB).
  bool resize_on_load = true;
  DecodeLimits limits;
  int64_t max_stored_bytes = int64_t{1} << 32;  // all stored frames together
};

// Sampled frames of a video.
struct VideoFrames {
  std::vector<Rgb8Image> frames;       // in order; all the same size
  std::vector<int64_t> frame_indices;  // each frame's index in the source
  int64_t source_frames = 0;           // frames in the source
  double source_fps = 0;               // the source's frame rate
  int64_t source_width = 0, source_height = 0;  // the frames' size before any resize
  std::string origin;                  // the file or folder
};

// Reads a video file (through FFmpeg) or a folder of frames (its .png / .jpg / .jpeg files
// in natural order: "f2" before "f10"), keeping the frames sample_frame_indices picks.
// A video without frames, a folder without image files, frames of different sizes and a
// video file in a build without FFmpeg are msa::Error naming the file.
VideoFrames load_video(const std::string& file_or_dir, const VideoProcessorConfig& config,
                       const VideoLoadOptions& options = {});

// Which frames of a source with `total_frames` at `source_fps` to keep: n = num_frames if
// > 0, else max(1, int(total_frames / source_fps * target_fps)) (transformers'
// default_sample_indices_fn), clamped to [min_frames, max_frames] and to total_frames
// (transformers applies neither clamp: it raises when n > total_frames), then indices
// i * total_frames / n (integer division) for i < n.
std::vector<int64_t> sample_frame_indices(int64_t total_frames, double source_fps,
                                          double target_fps, int64_t num_frames,
                                          int64_t min_frames, int64_t max_frames);

// A video: every frame resized to smart_resize's size of the source frame size, rescaled
// and normalised; an odd count padded by repeating the last frame; pairs of frames are
// temporal patches (grid_t = padded count / temporal_patch_size).
PixelPatches preprocess_video(const VideoFrames& video, const VideoProcessorConfig& config);

// The ViT's attention segments of a video grid: consecutive runs of at most
// `max_temporal_patches` temporal patches (0: one segment), as {t, h, w} each (what
// transformers' video processor returns as video_grid_thw).
std::vector<std::array<int64_t, 3>> video_segments(int64_t grid_t, int64_t grid_h,
                                                   int64_t grid_w,
                                                   int64_t max_temporal_patches);

}  // namespace msa::vision
