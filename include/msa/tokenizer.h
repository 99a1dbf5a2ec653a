// The model's tokenizer: byte-level BPE read from a Hugging Face `tokenizer.json`
// (GPT-2 / GPT-4o / MiniMax style), and the chat template the model ships.
//
// Encoding follows `tokenizers`: added tokens are cut out of the text first (leftmost,
// longest first), the rest is normalized (None or NFC), split by the pre-tokenizer
// (a regex Split and/or ByteLevel), mapped byte -> printable character, and merged by BPE
// in merge-rank order. Decoding maps ids back to token strings, drops special tokens when
// asked, and turns the byte-level characters back into bytes (invalid UTF-8 becomes
// U+FFFD, as Rust's from_utf8_lossy does).
//
// A field of tokenizer.json this implementation does not support is an msa::Error that
// names the field, never a silently different tokenization.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace msa {

// One chat turn. `content` is plain text; richer messages (tool calls, lists of parts) go
// through ChatTemplate::render_json.
struct ChatMessage {
  std::string role;
  std::string content;
};

// A Jinja chat template (the subset chat templates use: {{ }}, {% for/if/elif/else/set %},
// whitespace control, loop.*, filters trim/length/tojson/..., raise_exception).
class ChatTemplate {
 public:
  // Parses the template; a syntax error is an msa::Error with the line number.
  static ChatTemplate from_string(std::string source);

  // Renders with the variables of `context_json`, a JSON object such as
  // {"messages": [...], "add_generation_prompt": true, "bos_token": "..."}.
  // raise_exception("...") in the template and runtime type errors are msa::Error. So is a
  // render that needs more than `work_limit` units of work (an evaluation step, a list item
  // or 16 bytes of text built or visited: 2^24 units bound a render to a few hundred MB and
  // about a second) or nests values or blocks too deeply: templates come from model
  // directories and contexts from users.
  static constexpr uint64_t kDefaultWorkLimit = uint64_t{1} << 24;
  std::string render_json(std::string_view context_json,
                          uint64_t work_limit = kDefaultWorkLimit) const;

  const std::string& source() const;

  struct Program;  // the parsed template (defined in src/tokenizer/jinja_*.h)

 private:
  explicit ChatTemplate(std::shared_ptr<const Program> program);
  std::shared_ptr<const Program> program_;
};

class Tokenizer {
 public:
  // Reads a tokenizer.json file.
  static Tokenizer from_file(const std::string& tokenizer_json);
  // Reads `dir`/tokenizer.json and, when present, the chat template from
  // `dir`/chat_template.jinja or `dir`/tokenizer_config.json ("chat_template"), and the
  // bos/eos token strings from tokenizer_config.json.
  static Tokenizer from_model_dir(const std::string& dir);
  // Parses the text of a tokenizer.json (`origin` names it in errors).
  static Tokenizer from_json_string(std::string_view json_text,
                                   const std::string& origin = "tokenizer.json");

  // add_special_tokens applies the post-processor (e.g. a BOS token), as `tokenizers` does.
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens = false) const;
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens = false) const;

  std::optional<int32_t> token_to_id(std::string_view token) const;
  // The token's string as stored (byte-level characters for model tokens). Unknown id ->
  // msa::Error.
  std::string id_to_token(int32_t id) const;
  bool is_special(int32_t id) const;
  // Model vocabulary plus added tokens (the largest id + 1 when ids have gaps).
  size_t vocab_size() const;

  // The chat template, when the model directory had one.
  bool has_chat_template() const;
  void set_chat_template(ChatTemplate chat_template);
  // Renders the chat template with messages, add_generation_prompt, bos_token and
  // eos_token. No template -> msa::Error.
  std::string apply_chat_template(std::span<const ChatMessage> messages,
                                  bool add_generation_prompt) const;
  // The template itself and the token strings it is rendered with, for contexts richer than
  // apply_chat_template's (tool calls, tools, template switches: `msa serve`).
  const ChatTemplate* chat_template() const { return chat_template_ ? &*chat_template_ : nullptr; }
  const std::string& bos_token() const { return bos_token_; }
  const std::string& eos_token() const { return eos_token_; }

  struct Impl;  // the loaded model and pipeline (defined in src/tokenizer/)

 private:
  explicit Tokenizer(std::shared_ptr<const Impl> impl);
  std::shared_ptr<const Impl> impl_;
  std::optional<ChatTemplate> chat_template_;
  std::string bos_token_, eos_token_;  // from tokenizer_config.json, for the template
};

}  // namespace msa
