// Visual rows and the prompt: placing an image's or video's rows at its placeholder tokens,
// cutting them to a prefill chunk, and checking a forward step's rows before they replace
// token embeddings.
#include <algorithm>
#include <string>

#include "model/step_batch.h"
#include "msa/model_vision.h"

namespace msa {
namespace {

bool is_placeholder(int32_t token, const VisionConfig& v) {
  return token == v.image_token_id || token == v.video_token_id;
}

// A tensor of visual rows: f32 [n, hidden], n >= 1, contiguous, on the CPU.
void check_rows_tensor(const Tensor& rows, int64_t hidden, const std::string& name) {
  if (!rows.defined() || rows.dim() != 2 || rows.size(1) != hidden || rows.size(0) < 1)
    throw_arg_error(name, "f32 rows [n >= 1, hidden = " + std::to_string(hidden) + "]",
                    rows.defined() ? shape_string(rows.shape()) : "none");
  if (rows.dtype() != DType::f32) throw_arg_error(name, "dtype f32", dtype_name(rows.dtype()));
  if (rows.device() != Device::cpu || !rows.is_contiguous())
    throw_arg_error(name, "a contiguous CPU tensor", "another layout");
}

// The runs of one placeholder id in the prompt take the tensors' rows in order.
void place(std::span<const int32_t> prompt, int32_t placeholder, std::span<const Tensor> sources,
           int64_t hidden, const char* what, std::vector<VisualRows>& out) {
  int64_t available = 0;
  for (size_t i = 0; i < sources.size(); ++i) {
    check_rows_tensor(sources[i], hidden, std::string(what) + "[" + std::to_string(i) + "]");
    available += sources[i].size(0);
  }
  const int64_t wanted = std::count(prompt.begin(), prompt.end(), placeholder);
  if (wanted != available)
    throw Error("the prompt has " + std::to_string(wanted) + " " + what +
                " placeholder tokens (id " + std::to_string(placeholder) + "), the " + what +
                "s give " + std::to_string(available) + " rows");
  size_t source = 0;
  int64_t used = 0;  // rows of sources[source] already placed
  const int64_t n = static_cast<int64_t>(prompt.size());
  for (int64_t t = 0; t < n;) {
    if (prompt[t] != placeholder) {
      ++t;
      continue;
    }
    while (used == sources[source].size(0)) ++source, used = 0;
    // A run of placeholders, cut where the current tensor's rows end.
    int64_t end = t;
    while (end < n && prompt[end] == placeholder && used + (end - t) < sources[source].size(0)) ++end;
    out.push_back({.first_token = t, .rows = sources[source].slice0(used, used + (end - t))});
    used += end - t;
    t = end;
  }
}

}  // namespace

std::vector<VisualRows> place_visual_rows(std::span<const int32_t> prompt,
                                          const VisionConfig& config, int64_t hidden,
                                          std::span<const Tensor> images,
                                          std::span<const Tensor> videos) {
  std::vector<VisualRows> out;
  place(prompt, config.image_token_id, images, hidden, "image", out);
  place(prompt, config.video_token_id, videos, hidden, "video", out);
  std::sort(out.begin(), out.end(),
            [](const VisualRows& a, const VisualRows& b) { return a.first_token < b.first_token; });
  return out;
}

std::vector<VisualRows> visual_rows_in_range(std::span<const VisualRows> prompt_rows,
                                             int64_t begin, int64_t end) {
  std::vector<VisualRows> out;
  for (const VisualRows& span : prompt_rows) {
    const int64_t first = span.first_token, last = first + span.rows.size(0);
    const int64_t a = std::max(first, begin), b = std::min(last, end);
    if (a >= b) continue;
    out.push_back({.first_token = a - begin, .rows = span.rows.slice0(a - first, b - first)});
  }
  return out;
}

namespace model {

std::vector<PackedVisualRows> check_visual_rows(std::span<const VisualRows> visual,
                                                std::span<const int32_t> tokens,
                                                const ModelConfig& config, const std::string& name,
                                                int64_t first_row) {
  std::vector<PackedVisualRows> packed;
  if (visual.empty()) return packed;
  if (!config.vision)
    throw_arg_error(name, "no visual rows (the model's config.json has no vision_config)",
                    std::to_string(visual.size()) + " spans");
  const int64_t n = static_cast<int64_t>(tokens.size());
  std::vector<bool> covered(static_cast<size_t>(n), false);
  for (size_t i = 0; i < visual.size(); ++i) {
    const std::string at = name + "[" + std::to_string(i) + "]";
    check_rows_tensor(visual[i].rows, config.hidden_size, at + ".rows");
    const int64_t first = visual[i].first_token, count = visual[i].rows.size(0);
    if (first < 0 || first > n - count)
      throw_arg_error(at + ".first_token",
                      "a token index with first_token + rows (" + std::to_string(count) +
                          ") <= the tokens (" + std::to_string(n) + ")",
                      first);
    for (int64_t t = first; t < first + count; ++t) {
      if (covered[t])
        throw_arg_error(at, "rows for tokens no other span covers", "a second span for token " + std::to_string(t));
      covered[t] = true;
      if (!is_placeholder(tokens[t], *config.vision))
        throw_arg_error(at, "rows for image (" + std::to_string(config.vision->image_token_id) +
                                ") or video (" + std::to_string(config.vision->video_token_id) +
                                ") placeholder tokens",
                        "token " + std::to_string(tokens[t]) + " at index " + std::to_string(t));
    }
    packed.push_back({.row = first_row + first, .count = count, .data = visual[i].rows.data<float>()});
  }
  return packed;
}

}  // namespace model
}  // namespace msa
