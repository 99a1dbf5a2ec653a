// Images and videos in a prompt (`msa run --image/--video`, `msa attn-map --image`): the
// files decoded and preprocessed with the model directory's processor settings, the prompt
// text built the way MiniMaxM3VLProcessor builds it, and the visual rows at its placeholders.
//
//   PromptMedia media = load_prompt_media(model_dir, {.images = {"a.png"}});
//   MediaPrompt prompt = build_media_prompt(tokenizer, "What is this?", media, vision_config,
//                                           PromptLayout::chat_template);
//   std::vector<VisualRows> rows = encode_prompt_media(model, prompt.tokens, media);
//
// transformers' processor replaces each image marker `]<]image[>[` of the (chat-rendered) text
// with `]<]start of image[>[` + N x `]<]image[>[` + `]<]end of image[>[`, N = t*h*w / merge^2,
// and each video marker with, per temporal patch, `]<]{seconds:.1f} seconds[>[` (the patch's
// first frame's time) + `]<]start of image[>[` + h*w / merge^2 x `]<]video[>[` +
// `]<]end of image[>[`. msa does the same on the text, then tokenizes it.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "msa/model.h"
#include "msa/vision_media.h"
#ifdef MSA_WITH_TOKENIZER
#include "msa/tokenizer.h"
#endif

namespace msa::cli {

inline constexpr std::string_view kImageMarker = "]<]image[>[";
inline constexpr std::string_view kVideoMarker = "]<]video[>[";
inline constexpr std::string_view kVisionStart = "]<]start of image[>[";
inline constexpr std::string_view kVisionEnd = "]<]end of image[>[";

// The media files of a command line.
struct PromptMediaFiles {
  std::vector<std::string> images;  // --image, in order
  std::vector<std::string> videos;  // --video: files or folders of frames, in order
  double video_fps = 0;             // --fps: frames sampled per second; 0: the config's
  double folder_fps = 0;            // --folder-fps: a frames folder's rate; 0: video_fps
};

// Decoded and preprocessed media, images first then videos (the order of their markers).
struct PromptMedia {
  std::vector<vision::PixelPatches> images, videos;
  std::vector<std::string> image_files, video_files;
  int64_t image_merge_size = 2, video_merge_size = 2;  // the processors' merge_size
  bool empty() const { return images.empty() && videos.empty(); }
};

// Reads every file with the processor settings of `model_dir` (load_image_processor_config,
// load_video_processor_config). Errors are msa::Error naming the file.
PromptMedia load_prompt_media(const std::string& model_dir, const PromptMediaFiles& files);

// The placeholder tokens one image / video stands for: t*h*w / merge^2 (a video's per
// temporal patch: h*w / merge^2).
int64_t image_placeholder_count(const vision::PixelPatches& image, int64_t merge_size);
int64_t video_placeholder_count(const vision::PixelPatches& video, int64_t merge_size);

// transformers' MiniMaxM3VLProcessor.replace_image_token / replace_video_token: the text one
// marker becomes. A video's timestamps are printed when it has one per temporal patch.
std::string image_placeholder_text(const vision::PixelPatches& image, int64_t merge_size);
std::string video_placeholder_text(const vision::PixelPatches& video, int64_t merge_size);

// `text` with its k-th image marker replaced by image k's placeholder text and its k-th video
// marker by video k's. Marker counts that differ from the media are an msa::Error naming both
// counts (`what` names the text: "--prompt", "the rendered chat template").
std::string expand_media_markers(std::string_view text, const PromptMedia& media,
                                 const std::string& what);

// Where the media go in a --prompt text.
enum class PromptLayout {
  chat_template,  // one user message whose content items are the images, videos, then the text
  raw,            // markers, then the text, tokenized with the tokenizer's special tokens (BOS)
};

#ifdef MSA_WITH_TOKENIZER
struct MediaPrompt {
  std::vector<int32_t> tokens;
  PromptLayout layout = PromptLayout::raw;  // what was used
  std::string text;                         // the text that was tokenized
};

// The prompt ids of `prompt_text` with `media`. A text that holds markers itself keeps them
// where they are (one per medium); otherwise the media go before the text. `layout`
// chat_template needs a tokenizer with a chat template (else the raw layout is used): the
// template is rendered with messages = [{"role": "user", "content": [{"type": "image"}...,
// {"type": "video"}..., {"type": "text", "text": prompt_text}]}] and add_generation_prompt, and
// must print one marker per item; the result is tokenized without added special tokens (the
// template writes BOS). The tokenizer must map the four vision tokens to `vision`'s ids.
MediaPrompt build_media_prompt(const Tokenizer& tokenizer, std::string_view prompt_text,
                               const PromptMedia& media, const VisionConfig& vision,
                               PromptLayout layout);
#endif

// Checks that the prompt's image and video placeholder counts are what `media` needs, before
// anything is encoded: "the prompt holds 5 image placeholder tokens (id 500), the 1 image(s)
// need 16 (a.png: 16)"; placeholders without media, and media without placeholders, too.
// `what` names the prompt ("--prompt-tokens").
void check_placeholder_counts(std::span<const int32_t> prompt, const VisionConfig& vision,
                              const PromptMedia& media, const std::string& what);

// Encodes the media with the model's vision tower (CPU; images in one call, videos in one)
// and places their rows at the prompt's placeholders (place_visual_rows).
std::vector<VisualRows> encode_prompt_media(const Model& model, std::span<const int32_t> prompt,
                                            const PromptMedia& media);

// The prompt positions [begin, end) of image `index`'s placeholder tokens (they are
// consecutive). An msa::Error when the prompt has fewer images.
std::pair<int64_t, int64_t> image_placeholder_span(std::span<const int32_t> prompt,
                                                   const VisionConfig& vision,
                                                   const PromptMedia& media, int64_t index);

}  // namespace msa::cli
