#include "msa/tokenizer.h"

#include <cstdint>
#include <filesystem>

#include "core/json_parse.h"
#include "core/text_file.h"
#include "msa/error.h"
#include "tokenizer/tokenizer_impl.h"
#include "tokenizer/unicode_bytes.h"

namespace msa {
namespace {

std::string read_file(const std::string& path) { return read_text_file(path, "'" + path + "'"); }

tok::Json parse_json(std::string_view text, const std::string& origin) {
  try {
    return parse_json_limited(text);
  } catch (const JsonParseError& e) {
    MSA_FAIL(origin, ": ", e.what());
  }
}

// A token string of tokenizer_config.json: "text" or {"content": "text", ...}.
std::string config_token(const tok::Json& config, const char* key) {
  if (!config.contains(key)) return "";
  const auto& value = config[key];
  if (value.is_string()) return value.get<std::string>();
  if (value.is_object() && value.contains("content") && value["content"].is_string())
    return value["content"].get<std::string>();
  return "";
}

// The chat template of tokenizer_config.json: a string, or a list of {name, template}
// of which the one named "default" is used.
std::optional<std::string> config_chat_template(const tok::Json& config, const std::string& origin) {
  if (!config.contains("chat_template") || config["chat_template"].is_null()) return std::nullopt;
  const auto& value = config["chat_template"];
  if (value.is_string()) return value.get<std::string>();
  if (value.is_array()) {
    for (const auto& item : value)
      if (item.is_object() && item.contains("name") && item["name"] == "default" &&
          item.contains("template") && item["template"].is_string())
        return item["template"].get<std::string>();
  }
  MSA_FAIL(origin, ": field 'chat_template': expected a string or a list with a \"default\" entry");
}

}  // namespace

void Tokenizer::Impl::encode_plain(std::string_view text, std::vector<int32_t>& ids) const {
  for (const std::string& word : pre_tokenizer.split(text)) {
    if (pre_tokenizer.byte_level()) {
      model->tokenize(tok::bytes_to_byte_level(word), ids);
    } else {
      model->tokenize(word, ids);
    }
  }
}

Tokenizer::Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}

Tokenizer Tokenizer::from_json_string(std::string_view json_text, const std::string& origin) {
  return Tokenizer(tok::load_tokenizer_json(parse_json(json_text, origin), origin));
}

Tokenizer Tokenizer::from_file(const std::string& tokenizer_json) {
  return from_json_string(read_file(tokenizer_json), tokenizer_json);
}

Tokenizer Tokenizer::from_model_dir(const std::string& dir) {
  namespace fs = std::filesystem;
  Tokenizer tokenizer = from_file((fs::path(dir) / "tokenizer.json").string());
  const fs::path config_path = fs::path(dir) / "tokenizer_config.json";
  std::optional<std::string> chat_template;
  std::string template_origin;
  if (std::error_code ignored; fs::exists(config_path, ignored)) {
    const std::string origin = config_path.string();
    const tok::Json config = parse_json(read_file(origin), origin);
    if (!config.is_object()) MSA_FAIL(origin, ": expected a JSON object");
    tokenizer.bos_token_ = config_token(config, "bos_token");
    tokenizer.eos_token_ = config_token(config, "eos_token");
    chat_template = config_chat_template(config, origin);
    template_origin = origin + " chat_template";
  }
  // A separate chat_template.jinja takes precedence, as in transformers.
  const fs::path jinja_path = fs::path(dir) / "chat_template.jinja";
  if (std::error_code ignored; fs::exists(jinja_path, ignored)) {
    chat_template = read_file(jinja_path.string());
    template_origin = jinja_path.string();
  }
  if (chat_template) {
    try {
      tokenizer.chat_template_ = ChatTemplate::from_string(std::move(*chat_template));
    } catch (const Error& e) {
      MSA_FAIL(template_origin, ": ", e.what());
    }
  }
  return tokenizer;
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  if (!tok::is_valid_utf8(text)) MSA_CHECK_ARG(false, "text", "valid UTF-8", "invalid bytes");
  std::vector<int32_t> ids;
  for (const tok::Segment& raw : impl_->raw_matcher.split(text)) {
    if (raw.id) {
      ids.push_back(*raw.id);
      continue;
    }
    const std::string normalized = impl_->normalizer.apply(text.substr(raw.begin, raw.end - raw.begin));
    const std::string_view piece = normalized;
    for (const tok::Segment& seg : impl_->normalized_matcher.split(piece)) {
      if (seg.id) {
        ids.push_back(*seg.id);
      } else {
        impl_->encode_plain(piece.substr(seg.begin, seg.end - seg.begin), ids);
      }
    }
  }
  if (add_special_tokens) ids = impl_->post_processor.apply(std::move(ids));
  return ids;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  std::vector<const std::string*> tokens;
  tokens.reserve(ids.size());
  for (int32_t id : ids) {
    if (auto it = impl_->added_by_id.find(id); it != impl_->added_by_id.end()) {
      const tok::AddedToken& token = impl_->added[it->second];
      if (!(skip_special_tokens && token.special)) tokens.push_back(&token.content);
      continue;
    }
    const std::string* token = impl_->model->id_to_token(id);
    if (token == nullptr) MSA_CHECK_ARG(false, "ids", "token ids of this vocabulary", id);
    tokens.push_back(token);
  }
  return impl_->decoder.decode(tokens);
}

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  if (auto it = impl_->added_by_content.find(std::string(token)); it != impl_->added_by_content.end())
    return it->second;
  return impl_->model->token_to_id(token);
}

std::string Tokenizer::id_to_token(int32_t id) const {
  if (auto it = impl_->added_by_id.find(id); it != impl_->added_by_id.end())
    return impl_->added[it->second].content;
  if (const std::string* token = impl_->model->id_to_token(id)) return *token;
  MSA_CHECK_ARG(false, "id", "a token id of this vocabulary", id);
}

bool Tokenizer::is_special(int32_t id) const {
  auto it = impl_->added_by_id.find(id);
  return it != impl_->added_by_id.end() && impl_->added[it->second].special;
}

size_t Tokenizer::vocab_size() const {
  int32_t max_id = impl_->model->max_id();
  for (const auto& token : impl_->added) max_id = std::max(max_id, token.id);
  return size_t(max_id + 1);
}

bool Tokenizer::has_chat_template() const { return chat_template_.has_value(); }

void Tokenizer::set_chat_template(ChatTemplate chat_template) { chat_template_ = std::move(chat_template); }

std::string Tokenizer::apply_chat_template(std::span<const ChatMessage> messages,
                                           bool add_generation_prompt) const {
  if (!chat_template_) MSA_FAIL("apply_chat_template: this tokenizer has no chat template");
  nlohmann::ordered_json context = nlohmann::ordered_json::object();
  context["messages"] = nlohmann::ordered_json::array();
  for (const ChatMessage& message : messages)
    context["messages"].push_back({{"role", message.role}, {"content", message.content}});
  context["add_generation_prompt"] = add_generation_prompt;
  context["bos_token"] = bos_token_;
  context["eos_token"] = eos_token_;
  return chat_template_->render_json(context.dump());
}

}  // namespace msa
