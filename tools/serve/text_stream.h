// Generated token ids -> the text a client sees, one token at a time, with stop strings.
//
// Incremental detokenization: byte-level BPE tokens can end inside a UTF-8 character, so a
// token's text is only settled once the decoded window no longer ends in U+FFFD (the
// replacement the decoder puts for an unfinished character; the same rule as vLLM's and
// text-generation-inference's detokenizers). Each step decodes a short window of ids, never
// the whole output again.
//
// Special tokens are dropped (the eos token, pads), except the markers the output parser
// needs (<mm:think>, ]<]minimax[>[, ...). Stop strings: the text ends before the first
// match and the match is not returned (OpenAI's rule); a tail that may still grow into a
// stop string is held back while streaming.
#pragma once
#include <cstdint>
#include <set>
#include <string>
#include <vector>

namespace msa {
class Tokenizer;
}

namespace msa::serve {

class TextStream {
 public:
  // tokenizer may be null (a build without the tokenizer): the text stays empty.
  TextStream(const Tokenizer* tokenizer, std::vector<std::string> stop, std::set<int32_t> kept_special);

  struct Piece {
    std::string text;
    bool stopped = false;  // a stop string matched: text ends before it, nothing follows
  };
  Piece push(int32_t token);
  Piece finish();  // the held-back rest, at the end of the output

 private:
  Piece settle(bool at_end);

  const Tokenizer* tokenizer_;
  std::vector<std::string> stop_;
  std::set<int32_t> kept_special_;
  std::vector<int32_t> ids_;
  size_t prefix_offset_ = 0, read_offset_ = 0;
  std::string text_;      // all settled text
  size_t returned_ = 0;   // bytes of text_ already returned
  size_t searched_ = 0;   // stop strings cannot start before this byte
  bool stopped_ = false;
};

}  // namespace msa::serve
