// preprocessor_config.json / video_preprocessor_config.json / processor_config.json ->
// ImageProcessorConfig, VideoProcessorConfig: the keys transformers' MiniMax-M3 processor
// classes take from those files, each type- and range-checked.
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>

#include "core/json_parse.h"
#include "core/text_file.h"
#include "msa/vision_media.h"

namespace msa::vision {
namespace {

using json = nlohmann::json;

// Processor configs are a few hundred bytes; a megabyte means something else.
constexpr uint64_t kMaxConfigBytes = 1 << 20;

// Bounds far above any real setting that keep every product below int64 overflow
// (pixels of a frame times frames times patch values).
constexpr int64_t kMaxPixelBound = int64_t{1} << 32;

[[noreturn]] void field_error(const std::string& origin, const std::string& field,
                              const std::string& expected, const json& got) {
  throw Error(origin + ": field '" + field + "': expected " + expected + ", got " +
              json_excerpt(got));
}

// Reads fields of one processor object; a field that is absent or null keeps its default.
class Fields {
 public:
  Fields(const json& object, std::string origin) : object_(object), origin_(std::move(origin)) {}

  const json* find(const std::string& name) const {
    const auto it = object_.find(name);
    return it == object_.end() || it->is_null() ? nullptr : &*it;
  }
  void integer(const std::string& name, int64_t& value, int64_t min, int64_t max) const {
    if (const json* v = find(name)) {
      const std::optional<int64_t> got = json_integral(*v);
      if (!got || *got < min || *got > max)
        field_error(origin_, name, "an integer in [" + std::to_string(min) + ", " + std::to_string(max) + "]", *v);
      value = *got;
    }
  }
  void positive_number(const std::string& name, double& value, double max) const {
    if (const json* v = find(name)) {
      const std::optional<double> got = json_number(*v);
      if (!got || !std::isfinite(*got) || *got <= 0 || *got > max)
        field_error(origin_, name, "a number in (0, " + msa::detail::concat(max) + "]", *v);
      value = *got;
    }
  }
  void boolean(const std::string& name, bool& value) const {
    if (const json* v = find(name)) {
      if (!v->is_boolean()) field_error(origin_, name, "true or false", *v);
      value = v->get<bool>();
    }
  }
  // One number for all three channels, or a list of three.
  void channels(const std::string& name, std::array<double, 3>& value, bool positive) const {
    const json* v = find(name);
    if (!v) return;
    const std::string expected = std::string(positive ? "positive" : "finite") +
                                 " numbers (one, or a list of 3) of magnitude at most 1000";
    const auto read = [&](const json& item) {
      const std::optional<double> got = json_number(item);
      if (!got || !std::isfinite(*got) || std::abs(*got) > 1000 || (positive && *got <= 0))
        field_error(origin_, name, expected, *v);
      return *got;
    };
    if (v->is_array()) {
      if (v->size() != 3) field_error(origin_, name, expected, *v);
      for (size_t c = 0; c < 3; ++c) value[c] = read((*v)[c]);
    } else {
      value.fill(read(*v));
    }
  }
  const std::string& origin() const { return origin_; }

 private:
  const json& object_;
  std::string origin_;
};

// The keys both processors read the same way.
void read_pixel_settings(const Fields& f, PixelSettings& p) {
  f.integer("patch_size", p.patch_size, 1, 1024);
  f.integer("temporal_patch_size", p.temporal_patch_size, 1, 64);
  f.integer("merge_size", p.merge_size, 1, 64);
  f.channels("image_mean", p.image_mean, /*positive=*/false);
  f.channels("image_std", p.image_std, /*positive=*/true);
  f.positive_number("rescale_factor", p.rescale_factor, 1e6);
  f.boolean("do_resize", p.do_resize);
  f.boolean("do_rescale", p.do_rescale);
  f.boolean("do_normalize", p.do_normalize);
  // Only bicubic is implemented (PIL's code 3, what both classes default to); another
  // filter would give other pixels, so it is refused rather than ignored.
  if (const json* v = f.find("resample"); v && json_integral(*v) != std::optional<int64_t>(3))
    field_error(f.origin(), "resample", "3 (bicubic, the only filter implemented)", *v);
  f.integer("min_pixels", p.min_pixels, 1, kMaxPixelBound);
  f.integer("max_pixels", p.max_pixels, 1, kMaxPixelBound);
}

json parse_object(std::string_view text, const std::string& origin) {
  json value;
  try {
    value = parse_json_limited(text);
  } catch (const JsonParseError& e) {
    throw Error(origin + ": " + e.what());
  }
  if (!value.is_object()) throw Error(origin + ": expected a JSON object, got " + json_excerpt(value));
  return value;
}

bool is_file(const std::filesystem::path& path) {
  std::error_code ignored;
  return std::filesystem::is_regular_file(path, ignored);
}

// The processor's object from a model directory, in from_pretrained's order; nullopt when
// no file has one.
struct FoundConfig {
  json object;
  std::string origin;
};
std::optional<FoundConfig> find_processor_object(const std::string& model_dir,
                                                 const char* nested_key,
                                                 std::initializer_list<const char*> files) {
  const std::filesystem::path dir(model_dir);
  std::error_code error;
  if (!std::filesystem::is_directory(dir, error))
    throw Error("model directory '" + model_dir + "': not a directory");
  const std::filesystem::path processor = dir / "processor_config.json";
  if (is_file(processor)) {
    const std::string origin = "processor config '" + processor.string() + "'";
    json all = parse_object(read_text_file(processor.string(), origin, kMaxConfigBytes), origin);
    if (const auto it = all.find(nested_key); it != all.end() && !it->is_null()) {
      if (!it->is_object())
        throw Error(origin + ": field '" + nested_key + "': expected an object, got " + json_excerpt(*it));
      return FoundConfig{*it, origin + " (\"" + nested_key + "\")"};
    }
  }
  for (const char* file : files) {
    const std::filesystem::path path = dir / file;
    if (!is_file(path)) continue;
    const std::string origin = "processor config '" + path.string() + "'";
    return FoundConfig{parse_object(read_text_file(path.string(), origin, kMaxConfigBytes), origin),
                       origin};
  }
  return std::nullopt;
}

ImageProcessorConfig image_config_from(const json& object, const std::string& origin) {
  ImageProcessorConfig config;
  config.origin = origin;
  PixelSettings& p = config.pixels;
  const Fields f(object, origin);
  // The image processor keeps its bounds in size {shortest_edge, longest_edge} (pixels, not
  // edges); min_pixels / max_pixels, read below, override them. The released checkpoint's
  // "size": [672, 672] was never used, and transformers replaces it by the defaults.
  if (const json* size = f.find("size")) {
    const bool legacy = size->is_array() && *size == json::array({672, 672});
    if (!legacy) {
      if (!size->is_object())
        field_error(origin, "size", "an object {\"shortest_edge\", \"longest_edge\"} (pixels)", *size);
      const Fields size_fields(*size, origin);
      const bool has_min = size_fields.find("shortest_edge") != nullptr;
      const bool has_max = size_fields.find("longest_edge") != nullptr;
      size_fields.integer("shortest_edge", p.min_pixels, 1, kMaxPixelBound);
      size_fields.integer("longest_edge", p.max_pixels, 1, kMaxPixelBound);
      // transformers' resize needs both; a size without them works only when min_pixels
      // and max_pixels stand in.
      if ((!has_min && !f.find("min_pixels")) || (!has_max && !f.find("max_pixels")))
        field_error(origin, "size", "shortest_edge and longest_edge (or min_pixels and max_pixels next to it)", *size);
    }
  }
  read_pixel_settings(f, p);
  return config;
}

VideoProcessorConfig video_config_from(const json& object, const std::string& origin) {
  VideoProcessorConfig config;
  config.origin = origin;
  const Fields f(object, origin);
  // The video processor resizes by min_pixels / max_pixels only; its size field is unused.
  read_pixel_settings(f, config.pixels);
  f.positive_number("fps", config.fps, 1000);
  f.integer("num_frames", config.num_frames, 0, 1 << 20);
  f.integer("min_frames", config.min_frames, 1, 1 << 20);
  f.integer("max_frames", config.max_frames, 1, 1 << 20);
  // null means one segment per video in transformers; 0 says the same here.
  if (const auto it = object.find("vision_segment_max_frames"); it != object.end() && it->is_null())
    config.vision_segment_max_frames = 0;
  f.integer("vision_segment_max_frames", config.vision_segment_max_frames, 0, 1 << 20);
  if (config.min_frames > config.max_frames)
    throw Error(origin + ": fields 'min_frames' (" + std::to_string(config.min_frames) +
                ") and 'max_frames' (" + std::to_string(config.max_frames) +
                "): expected min_frames <= max_frames");
  return config;
}

}  // namespace

ImageProcessorConfig parse_image_processor_config(std::string_view json_text, const std::string& origin) {
  return image_config_from(parse_object(json_text, origin), origin);
}

VideoProcessorConfig parse_video_processor_config(std::string_view json_text, const std::string& origin) {
  return video_config_from(parse_object(json_text, origin), origin);
}

ImageProcessorConfig load_image_processor_config(const std::string& model_dir) {
  const std::optional<FoundConfig> found =
      find_processor_object(model_dir, "image_processor", {"preprocessor_config.json"});
  return found ? image_config_from(found->object, found->origin) : ImageProcessorConfig{};
}

VideoProcessorConfig load_video_processor_config(const std::string& model_dir) {
  const std::optional<FoundConfig> found = find_processor_object(
      model_dir, "video_processor", {"video_preprocessor_config.json", "preprocessor_config.json"});
  return found ? video_config_from(found->object, found->origin) : VideoProcessorConfig{};
}

}  // namespace msa::vision
