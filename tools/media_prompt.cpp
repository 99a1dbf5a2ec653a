#include "media_prompt.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <optional>
#include <tuple>

#include <nlohmann/json.hpp>

#include "msa/error.h"

namespace msa::cli {
namespace {

// Rows of f32 [rows, values] tensors one after another (the encode call's pixel_values).
Tensor concat_rows(const std::vector<vision::PixelPatches>& media) {
  int64_t rows = 0;
  const int64_t values = media.front().pixel_values.size(1);
  for (const vision::PixelPatches& m : media) rows += m.pixel_values.size(0);
  Tensor out = Tensor::zeros({rows, values}, DType::f32);
  float* dst = out.data<float>();
  for (const vision::PixelPatches& m : media) {
    const Tensor part = m.pixel_values.to(DType::f32);  // contiguous
    std::memcpy(dst, part.data<float>(), static_cast<size_t>(part.numel()) * sizeof(float));
    dst += part.numel();
  }
  return out;
}

std::vector<VisionGrid> grids_of(const std::vector<vision::PixelPatches>& media) {
  std::vector<VisionGrid> grids;
  for (const vision::PixelPatches& m : media) grids.push_back({.t = m.grid_t, .h = m.grid_h, .w = m.grid_w});
  return grids;
}

int64_t count_of(std::span<const int32_t> prompt, int32_t id) {
  return std::count(prompt.begin(), prompt.end(), id);
}

// "a.png: 16, b.png: 4"
std::string per_file(const std::vector<std::string>& files, const std::vector<int64_t>& counts) {
  std::string text;
  for (size_t i = 0; i < files.size(); ++i)
    text += (i ? ", " : "") + files[i] + ": " + std::to_string(counts[i]);
  return text;
}

}  // namespace

PromptMedia load_prompt_media(const std::string& model_dir, const PromptMediaFiles& files) {
  PromptMedia media;
  if (!files.images.empty()) {
    const vision::ImageProcessorConfig config = vision::load_image_processor_config(model_dir);
    media.image_merge_size = config.pixels.merge_size;
    for (const std::string& path : files.images) {
      media.images.push_back(vision::preprocess_image(vision::decode_image(path), config));
      media.image_files.push_back(path);
    }
  }
  if (!files.videos.empty()) {
    const vision::VideoProcessorConfig config = vision::load_video_processor_config(model_dir);
    media.video_merge_size = config.pixels.merge_size;
    vision::VideoLoadOptions options;
    options.sample_fps = files.video_fps;
    options.folder_fps = files.folder_fps;
    for (const std::string& path : files.videos) {
      media.videos.push_back(vision::preprocess_video(vision::load_video(path, config, options), config));
      media.video_files.push_back(path);
    }
  }
  return media;
}

int64_t image_placeholder_count(const vision::PixelPatches& image, int64_t merge_size) {
  return image.grid_t * image.grid_h * image.grid_w / (merge_size * merge_size);
}

int64_t video_placeholder_count(const vision::PixelPatches& video, int64_t merge_size) {
  return video.grid_t * (video.grid_h * video.grid_w / (merge_size * merge_size));
}

std::string image_placeholder_text(const vision::PixelPatches& image, int64_t merge_size) {
  std::string text(kVisionStart);
  const int64_t n = image_placeholder_count(image, merge_size);
  text.reserve(text.size() + static_cast<size_t>(n) * kImageMarker.size() + kVisionEnd.size());
  for (int64_t i = 0; i < n; ++i) text += kImageMarker;
  text += kVisionEnd;
  return text;
}

std::string video_placeholder_text(const vision::PixelPatches& video, int64_t merge_size) {
  const int64_t per_frame = video.grid_h * video.grid_w / (merge_size * merge_size);
  // transformers prints a timestamp only when the video has metadata (fps and frame
  // indices); msa's front end always knows them.
  const bool timestamps = static_cast<int64_t>(video.timestamps.size()) == video.grid_t;
  std::string text;
  for (int64_t t = 0; t < video.grid_t; ++t) {
    if (timestamps) {
      // Python's f"{x:.1f}" and printf's "%.1f" both round the double's exact value half to
      // even, so the texts agree.
      char seconds[64];
      std::snprintf(seconds, sizeof(seconds), "%.1f", video.timestamps[static_cast<size_t>(t)]);
      text += "]<]" + std::string(seconds) + " seconds[>[";
    }
    text += kVisionStart;
    for (int64_t i = 0; i < per_frame; ++i) text += kVideoMarker;
    text += kVisionEnd;
  }
  return text;
}

std::string expand_media_markers(std::string_view text, const PromptMedia& media, const std::string& what) {
  // Count first: a mismatch names both counts before any expansion.
  const auto count = [&](std::string_view marker) {
    int64_t n = 0;
    for (size_t at = text.find(marker); at != std::string_view::npos; at = text.find(marker, at + marker.size())) ++n;
    return n;
  };
  const int64_t image_markers = count(kImageMarker), video_markers = count(kVideoMarker);
  const auto mismatch = [&](const char* kind, std::string_view marker, int64_t markers, size_t given,
                            const char* flag) {
    throw Error(what + ": holds " + std::to_string(markers) + " " + kind + " marker(s) ('" +
                std::string(marker) + "'), expected one per " + flag + ", got " + std::to_string(given) +
                " " + flag + " file(s)");
  };
  if (image_markers != static_cast<int64_t>(media.images.size()))
    mismatch("image", kImageMarker, image_markers, media.images.size(), "--image");
  if (video_markers != static_cast<int64_t>(media.videos.size()))
    mismatch("video", kVideoMarker, video_markers, media.videos.size(), "--video");
  std::string out;
  size_t image = 0, video = 0, at = 0;
  while (at < text.size()) {
    const size_t next_image = text.find(kImageMarker, at), next_video = text.find(kVideoMarker, at);
    const size_t next = std::min(next_image, next_video);
    if (next == std::string_view::npos) {
      out += text.substr(at);
      break;
    }
    out += text.substr(at, next - at);
    if (next == next_image) {
      out += image_placeholder_text(media.images[image++], media.image_merge_size);
      at = next + kImageMarker.size();
    } else {
      out += video_placeholder_text(media.videos[video++], media.video_merge_size);
      at = next + kVideoMarker.size();
    }
  }
  return out;
}

#ifdef MSA_WITH_TOKENIZER
MediaPrompt build_media_prompt(const Tokenizer& tokenizer, std::string_view prompt_text,
                               const PromptMedia& media, const VisionConfig& vision, PromptLayout layout) {
  // The markers must be the config's ids, or the rows would land on other tokens.
  for (const auto& [token, id, field] :
       {std::tuple{kImageMarker, vision.image_token_id, "image_token_id"},
        std::tuple{kVideoMarker, vision.video_token_id, "video_token_id"},
        std::tuple{kVisionStart, vision.vision_start_token_id, "vision_start_token_id"},
        std::tuple{kVisionEnd, vision.vision_end_token_id, "vision_end_token_id"}}) {
    const std::optional<int32_t> found = tokenizer.token_to_id(token);
    if (found != id)
      throw Error("the tokenizer has " +
                  (found ? "'" + std::string(token) + "' as id " + std::to_string(*found)
                         : "no token '" + std::string(token) + "'") +
                  ", expected it as id " + std::to_string(id) + " (config.json " + field + ")");
  }
  const bool placed_by_user = prompt_text.find(kImageMarker) != std::string_view::npos ||
                              prompt_text.find(kVideoMarker) != std::string_view::npos;
  MediaPrompt prompt;
  if (layout == PromptLayout::chat_template && tokenizer.chat_template()) {
    using Json = nlohmann::ordered_json;
    Json content;
    if (placed_by_user) {
      content = std::string(prompt_text);
    } else {
      content = Json::array();
      for (size_t i = 0; i < media.images.size(); ++i) content.push_back({{"type", "image"}});
      for (size_t i = 0; i < media.videos.size(); ++i) content.push_back({{"type", "video"}});
      content.push_back({{"type", "text"}, {"text", std::string(prompt_text)}});
    }
    const Json context = {{"messages", Json::array({{{"role", "user"}, {"content", content}}})},
                          {"add_generation_prompt", true},
                          {"bos_token", tokenizer.bos_token()},
                          {"eos_token", tokenizer.eos_token()}};
    const std::string rendered = tokenizer.chat_template()->render_json(context.dump());
    prompt.layout = PromptLayout::chat_template;
    prompt.text = expand_media_markers(rendered, media,
                                       "the chat template's text (a template that prints no marker "
                                       "for image / video content items needs --raw-prompt)");
    prompt.tokens = tokenizer.encode(prompt.text, /*add_special_tokens=*/false);
  } else {
    std::string text;
    if (!placed_by_user) {
      for (size_t i = 0; i < media.images.size(); ++i) text += kImageMarker;
      for (size_t i = 0; i < media.videos.size(); ++i) text += kVideoMarker;
    }
    text += prompt_text;
    prompt.layout = PromptLayout::raw;
    prompt.text = expand_media_markers(text, media, "--prompt");
    prompt.tokens = tokenizer.encode(prompt.text, /*add_special_tokens=*/true);
  }
  return prompt;
}
#endif

void check_placeholder_counts(std::span<const int32_t> prompt, const VisionConfig& vision,
                              const PromptMedia& media, const std::string& what) {
  const auto check = [&](const char* kind, int32_t id, const std::vector<vision::PixelPatches>& list,
                         const std::vector<std::string>& files, int64_t merge, bool video, const char* flag) {
    std::vector<int64_t> needs;
    int64_t total = 0;
    for (const vision::PixelPatches& m : list) {
      needs.push_back(video ? video_placeholder_count(m, merge) : image_placeholder_count(m, merge));
      total += needs.back();
    }
    const int64_t held = count_of(prompt, id);
    if (held == total) return;
    std::string message = what + ": the prompt holds " + std::to_string(held) + " " + kind +
                          " placeholder tokens (id " + std::to_string(id) + "), ";
    if (list.empty())
      message += std::string("but no ") + flag + " was given (0 " + kind + "s need 0)";
    else
      message += "the " + std::to_string(list.size()) + " " + flag + " file(s) need " +
                 std::to_string(total) + " (" + per_file(files, needs) + ")";
    throw Error(message);
  };
  check("image", vision.image_token_id, media.images, media.image_files, media.image_merge_size, false, "--image");
  check("video", vision.video_token_id, media.videos, media.video_files, media.video_merge_size, true, "--video");
}

std::vector<VisualRows> encode_prompt_media(const Model& model, std::span<const int32_t> prompt,
                                            const PromptMedia& media) {
  std::vector<Tensor> images, videos;
  if (!media.images.empty()) images = model.encode_vision(concat_rows(media.images), grids_of(media.images));
  if (!media.videos.empty()) videos = model.encode_vision(concat_rows(media.videos), grids_of(media.videos));
  return place_visual_rows(prompt, *model.config().vision, model.config().hidden_size, images, videos);
}

std::pair<int64_t, int64_t> image_placeholder_span(std::span<const int32_t> prompt, const VisionConfig& vision,
                                                   const PromptMedia& media, int64_t index) {
  MSA_CHECK_ARG(index >= 0 && index < static_cast<int64_t>(media.images.size()), "image",
                "an image index below " + std::to_string(media.images.size()), index);
  int64_t skip = 0;  // placeholder tokens of the images before `index`
  for (int64_t i = 0; i < index; ++i)
    skip += image_placeholder_count(media.images[static_cast<size_t>(i)], media.image_merge_size);
  const int64_t n = image_placeholder_count(media.images[static_cast<size_t>(index)], media.image_merge_size);
  int64_t seen = 0, begin = -1;
  for (int64_t p = 0; p < static_cast<int64_t>(prompt.size()); ++p) {
    if (prompt[static_cast<size_t>(p)] != vision.image_token_id) continue;
    if (seen == skip) begin = p;
    if (++seen == skip + n) {
      if (p - begin + 1 != n)
        throw Error("image " + std::to_string(index) + " ('" + media.image_files[static_cast<size_t>(index)] +
                    "'): its " + std::to_string(n) + " placeholder tokens are not consecutive in the prompt");
      return {begin, p + 1};
    }
  }
  throw Error("image " + std::to_string(index) + " ('" + media.image_files[static_cast<size_t>(index)] +
              "'): the prompt holds " + std::to_string(seen) + " image placeholder tokens, expected at least " +
              std::to_string(skip + n));
}

}  // namespace msa::cli
