// The loaded tokenizer: the BPE model, the added tokens and the pipeline around them.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "msa/tokenizer.h"
#include "tokenizer/added_vocab.h"
#include "tokenizer/bpe_model.h"
#include "tokenizer/decoder.h"
#include "tokenizer/normalizer.h"
#include "tokenizer/post_processor.h"
#include "tokenizer/pre_tokenizer.h"

namespace msa {

struct Tokenizer::Impl {
  std::unique_ptr<tok::BpeModel> model;
  std::vector<tok::AddedToken> added;                // in tokenizer.json order
  std::unordered_map<int32_t, size_t> added_by_id;   // id -> index into `added`
  std::unordered_map<std::string, int32_t> added_by_content;
  tok::AddedTokenMatcher raw_matcher;         // tokens with normalized = false
  tok::AddedTokenMatcher normalized_matcher;  // tokens with normalized = true
  tok::Normalizer normalizer;
  tok::PreTokenizer pre_tokenizer;
  tok::PostProcessor post_processor;
  tok::Decoder decoder;

  // Appends the ids of text that holds no added token.
  void encode_plain(std::string_view text, std::vector<int32_t>& ids) const;
};

namespace tok {
// Builds the tokenizer from the parsed tokenizer.json; `origin` names it in errors.
std::shared_ptr<const Tokenizer::Impl> load_tokenizer_json(const Json& root, const std::string& origin);
}  // namespace tok

}  // namespace msa
