#include "tokenizer/post_processor.h"

#include <cstdint>
#include <climits>

#include "core/json_parse.h"
#include "msa/error.h"

namespace msa::tok {

PostProcessor PostProcessor::from_json(const Json& value, const std::string& field) {
  PostProcessor post;
  if (!value.is_null()) post.add(value, field);
  return post;
}

void PostProcessor::add(const Json& value, const std::string& field) {
  const std::string type = type_of(value, field);
  if (type == "ByteLevel") {
    require_object(value, field, {"type", "add_prefix_space", "trim_offsets", "use_regex"});
  } else if (type == "Sequence") {
    require_object(value, field, {"type", "processors"});
    if (!value.contains("processors") || !value["processors"].is_array())
      MSA_FAIL("tokenizer field '", field, ".processors': expected an array");
    for (size_t i = 0; i < value["processors"].size(); ++i)
      add(value["processors"][i], field + ".processors[" + std::to_string(i) + "]");
  } else if (type == "TemplateProcessing") {
    require_object(value, field, {"type", "single", "pair", "special_tokens"});
    const Json& single = value.contains("single") ? value["single"] : Json();
    const Json& specials = value.contains("special_tokens") ? value["special_tokens"] : Json::object();
    if (!single.is_array()) MSA_FAIL("tokenizer field '", field, ".single': expected an array");
    std::vector<Piece> pieces;
    for (size_t i = 0; i < single.size(); ++i) {
      const std::string where = field + ".single[" + std::to_string(i) + "]";
      const Json& item = single[i];
      if (!item.is_object())
        MSA_FAIL("tokenizer field '", where, "': expected an object, got ", json_excerpt(item));
      if (item.contains("Sequence")) {
        if (item["Sequence"].value("id", "") != "A")
          MSA_FAIL("tokenizer field '", where, ".Sequence.id': only sequence A is supported");
        pieces.push_back({true, {}});
      } else if (item.contains("SpecialToken") && item["SpecialToken"].contains("id") &&
                 item["SpecialToken"]["id"].is_string()) {
        const std::string name = item["SpecialToken"]["id"].get<std::string>();
        if (!specials.contains(name) || !specials[name].contains("ids") || !specials[name]["ids"].is_array())
          MSA_FAIL("tokenizer field '", field, ".special_tokens': no ids for '", name, "'");
        std::vector<int32_t> ids;
        for (const Json& id : specials[name]["ids"]) {
          const std::optional<int64_t> value = json_integral(id);
          if (!value || *value < 0 || *value > INT32_MAX)
            MSA_FAIL("tokenizer field '", field, ".special_tokens.", name,
                     ".ids': expected integers in [0, 2^31 - 1], got ", json_excerpt(id));
          ids.push_back(static_cast<int32_t>(*value));
        }
        pieces.push_back({false, std::move(ids)});
      } else {
        MSA_FAIL("tokenizer field '", where, "': expected Sequence or SpecialToken, got ", json_excerpt(item));
      }
    }
    templates_.push_back(std::move(pieces));
  } else {
    MSA_FAIL("tokenizer field '", field, ".type': post-processor '", type,
             "' not supported (supported: null, TemplateProcessing, ByteLevel, Sequence)");
  }
}

std::vector<int32_t> PostProcessor::apply(std::vector<int32_t> ids) const {
  for (const auto& pieces : templates_) {
    std::vector<int32_t> out;
    for (const Piece& piece : pieces) {
      const auto& src = piece.is_sequence ? ids : piece.ids;
      out.insert(out.end(), src.begin(), src.end());
    }
    ids = std::move(out);
  }
  return ids;
}

}  // namespace msa::tok
