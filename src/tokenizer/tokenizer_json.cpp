// tokenizer.json -> Tokenizer::Impl, checking every field this implementation relies on.
#include <cstdint>
#include <climits>

#include "core/json_parse.h"
#include "msa/error.h"
#include "tokenizer/tokenizer_impl.h"

namespace msa::tok {
namespace {

BpeConfig read_bpe(const Json& model) {
  const std::string field = "model";
  if (!model.is_object()) MSA_FAIL("tokenizer field 'model': expected an object");
  if (model.contains("type") && model["type"] != "BPE")
    MSA_FAIL("tokenizer field 'model.type': model '", json_excerpt(model["type"]),
             "' not supported (supported: BPE)");
  require_object(model, field,
                 {"type", "dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix",
                  "fuse_unk", "byte_fallback", "ignore_merges", "vocab", "merges"});
  require_default(model, field, "dropout", Json(0.0));
  require_default(model, field, "continuing_subword_prefix", Json(""));
  require_default(model, field, "end_of_word_suffix", Json(""));
  require_default(model, field, "byte_fallback", Json(false));

  BpeConfig config;
  config.fuse_unk = bool_field(model, field, "fuse_unk", false);
  config.ignore_merges = bool_field(model, field, "ignore_merges", false);
  if (model.contains("unk_token") && !model["unk_token"].is_null())
    config.unk_token = string_field(model, field, "unk_token");

  if (!model.contains("vocab") || !model["vocab"].is_object())
    MSA_FAIL("tokenizer field 'model.vocab': expected an object {token: id}");
  config.vocab.reserve(model["vocab"].size());
  for (const auto& [token, id] : model["vocab"].items()) {
    const std::optional<int64_t> value = json_integral(id);
    if (!value || *value < 0 || *value > INT32_MAX)
      MSA_FAIL("tokenizer field 'model.vocab': id of '", token,
               "': expected an integer in [0, 2^31 - 1], got ", json_excerpt(id));
    config.vocab.emplace_back(token, static_cast<int32_t>(*value));
  }

  if (!model.contains("merges") || !model["merges"].is_array())
    MSA_FAIL("tokenizer field 'model.merges': expected an array");
  const Json& merges = model["merges"];
  config.merges.reserve(merges.size());
  for (size_t i = 0; i < merges.size(); ++i) {
    const Json& merge = merges[i];
    if (merge.is_string()) {  // "left right"
      const std::string text = merge.get<std::string>();
      const size_t space = text.find(' ');
      if (space == std::string::npos || text.find(' ', space + 1) != std::string::npos)
        MSA_FAIL("tokenizer field 'model.merges[", i, "]': expected \"left right\", got ", json_excerpt(merge));
      config.merges.emplace_back(text.substr(0, space), text.substr(space + 1));
    } else if (merge.is_array() && merge.size() == 2 && merge[0].is_string() && merge[1].is_string()) {
      config.merges.emplace_back(merge[0].get<std::string>(), merge[1].get<std::string>());
    } else {
      MSA_FAIL("tokenizer field 'model.merges[", i, "]': expected \"left right\" or [left, right], got ",
               json_excerpt(merge));
    }
  }
  return config;
}

std::vector<AddedToken> read_added_tokens(const Json& root) {
  std::vector<AddedToken> tokens;
  if (!root.contains("added_tokens") || root["added_tokens"].is_null()) return tokens;
  const Json& list = root["added_tokens"];
  if (!list.is_array()) MSA_FAIL("tokenizer field 'added_tokens': expected an array");
  for (size_t i = 0; i < list.size(); ++i) {
    const std::string field = "added_tokens[" + std::to_string(i) + "]";
    const Json& item = list[i];
    require_object(item, field, {"id", "content", "single_word", "lstrip", "rstrip", "normalized", "special"});
    const std::optional<int64_t> id = item.contains("id") ? json_integral(item["id"]) : std::nullopt;
    if (!id || *id < 0 || *id > INT32_MAX)
      MSA_FAIL("tokenizer field '", field, ".id': expected an integer in [0, 2^31 - 1], got ",
               item.contains("id") ? json_excerpt(item["id"]) : std::string("none"));
    AddedToken token;
    token.id = static_cast<int32_t>(*id);
    token.content = string_field(item, field, "content");
    if (token.content.empty()) MSA_FAIL("tokenizer field '", field, ".content': empty");
    token.special = bool_field(item, field, "special", false);
    token.single_word = bool_field(item, field, "single_word", false);
    token.lstrip = bool_field(item, field, "lstrip", false);
    token.rstrip = bool_field(item, field, "rstrip", false);
    token.normalized = bool_field(item, field, "normalized", !token.special);
    tokens.push_back(std::move(token));
  }
  return tokens;
}

}  // namespace

std::shared_ptr<const Tokenizer::Impl> load_tokenizer_json(const Json& root, const std::string& origin) {
  try {
    require_object(root, "<root>",
                   {"version", "truncation", "padding", "added_tokens", "normalizer", "pre_tokenizer",
                    "model", "post_processor", "decoder"});
    for (const char* key : {"truncation", "padding"})
      if (root.contains(key) && !root[key].is_null())
        MSA_FAIL("tokenizer field '", key, "': not supported (expected null)");
    if (!root.contains("model")) MSA_FAIL("tokenizer field 'model': missing");

    auto impl = std::make_shared<Tokenizer::Impl>();
    impl->model = std::make_unique<BpeModel>(read_bpe(root["model"]));
    impl->normalizer = Normalizer::from_json(root.value("normalizer", Json()), "normalizer");
    impl->pre_tokenizer = PreTokenizer::from_json(root.value("pre_tokenizer", Json()), "pre_tokenizer");
    impl->post_processor = PostProcessor::from_json(root.value("post_processor", Json()), "post_processor");
    impl->decoder = Decoder::from_json(root.value("decoder", Json()), "decoder");

    impl->added = read_added_tokens(root);
    std::vector<const AddedToken*> raw, normalized;
    std::vector<std::string> raw_patterns, normalized_patterns;
    for (size_t i = 0; i < impl->added.size(); ++i) {
      const AddedToken& token = impl->added[i];
      // One id, one string: a second meaning of an id (or a second id of a string) would
      // make encode and decode disagree with each other and with `tokenizers`.
      const std::string field = "added_tokens[" + std::to_string(i) + "]";
      if (const auto it = impl->added_by_id.find(token.id);
          it != impl->added_by_id.end() && impl->added[it->second].content != token.content)
        MSA_FAIL("tokenizer field '", field, ".id': id ", token.id, " of '", token.content,
                 "' is already the id of added token '", impl->added[it->second].content, "'");
      if (const auto it = impl->added_by_content.find(token.content);
          it != impl->added_by_content.end() && it->second != token.id)
        MSA_FAIL("tokenizer field '", field, ".content': '", token.content, "' is already added with id ",
                 it->second, ", not ", token.id);
      if (const std::string* in_vocab = impl->model->id_to_token(token.id);
          in_vocab && *in_vocab != token.content)
        MSA_FAIL("tokenizer field '", field, ".id': id ", token.id, " of '", token.content,
                 "' is the id of '", *in_vocab, "' in model.vocab");
      impl->added_by_id[token.id] = i;
      impl->added_by_content[token.content] = token.id;
      if (token.normalized) {
        normalized.push_back(&token);
        normalized_patterns.push_back(impl->normalizer.apply(token.content));
      } else {
        raw.push_back(&token);
        raw_patterns.push_back(token.content);
      }
    }
    impl->raw_matcher = AddedTokenMatcher(std::move(raw), std::move(raw_patterns));
    impl->normalized_matcher = AddedTokenMatcher(std::move(normalized), std::move(normalized_patterns));
    return impl;
  } catch (const Json::exception& e) {
    MSA_FAIL(origin, ": malformed tokenizer: ", e.what());
  } catch (const Error& e) {
    MSA_FAIL(origin, ": ", e.what());
  }
}

}  // namespace msa::tok
