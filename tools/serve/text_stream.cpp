// Incremental detokenization and stop strings (text_stream.h).
#include "text_stream.h"

#include <cstdint>
#include <algorithm>
#include <span>

#ifdef MSA_WITH_TOKENIZER
#include "msa/tokenizer.h"
#endif

namespace msa::serve {
namespace {
constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD

bool ends_with(std::string_view text, std::string_view tail) {
  return text.size() >= tail.size() && text.substr(text.size() - tail.size()) == tail;
}
}  // namespace

TextStream::TextStream(const Tokenizer* tokenizer, std::vector<std::string> stop,
                       std::set<int32_t> kept_special)
    : tokenizer_(tokenizer), stop_(std::move(stop)), kept_special_(std::move(kept_special)) {}

TextStream::Piece TextStream::push(int32_t token) {
  if (stopped_) return {};
#ifdef MSA_WITH_TOKENIZER
  if (!tokenizer_) return {};
  if (tokenizer_->is_special(token) && !kept_special_.count(token)) return {};
  ids_.push_back(token);
  const std::span<const int32_t> ids(ids_);
  const std::string before = tokenizer_->decode(ids.subspan(prefix_offset_, read_offset_ - prefix_offset_));
  const std::string now = tokenizer_->decode(ids.subspan(prefix_offset_));
  if (now.size() > before.size() && !ends_with(now, kReplacement)) {
    text_ += now.substr(before.size());
    prefix_offset_ = read_offset_;
    read_offset_ = ids_.size();
  }
  return settle(false);
#else
  (void)token;
  return {};
#endif
}

TextStream::Piece TextStream::finish() {
  if (stopped_) return {};
#ifdef MSA_WITH_TOKENIZER
  if (tokenizer_ && read_offset_ < ids_.size()) {
    const std::span<const int32_t> ids(ids_);
    const std::string before = tokenizer_->decode(ids.subspan(prefix_offset_, read_offset_ - prefix_offset_));
    const std::string now = tokenizer_->decode(ids.subspan(prefix_offset_));
    if (now.size() > before.size()) text_ += now.substr(before.size());
    read_offset_ = ids_.size();
  }
#endif
  return settle(true);
}

TextStream::Piece TextStream::settle(bool at_end) {
  Piece piece;
  // The earliest stop string that starts at or after searched_.
  size_t first = std::string::npos;
  for (const std::string& stop : stop_) first = std::min(first, text_.find(stop, searched_));
  if (first != std::string::npos) {
    piece.text = text_.substr(returned_, first - returned_);
    piece.stopped = stopped_ = true;
    returned_ = first;
    return piece;
  }
  // Hold back the longest tail that is the start of a stop string.
  size_t keep = 0;
  if (!at_end)
    for (const std::string& stop : stop_)
      for (size_t k = std::min(text_.size(), stop.size() - 1); k > keep; --k)
        if (text_.compare(text_.size() - k, k, stop, 0, k) == 0) {
          keep = k;
          break;
        }
  const size_t settled = std::max(returned_, text_.size() - keep);
  piece.text = text_.substr(returned_, settled - returned_);
  returned_ = settled;
  searched_ = settled;
  return piece;
}

}  // namespace msa::serve
