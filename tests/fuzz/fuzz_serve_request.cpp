// `msa serve`'s readers of what clients send and what the model writes. The first byte picks:
// bit 0 the endpoint (chat / completions); bit 1 whether the rest is also model output for the
// M3 reasoning / tool-call parser, fed in pieces of (byte >> 2) + 1 bytes. The rest is a
// request body: parse_request must accept it or throw ApiError (400) and nothing else; an
// accepted chat request renders through an M3-style chat template (tools, tool calls,
// reasoning), which may refuse it with msa::Error only. The output parser must not lose or
// invent text: content + reasoning never exceed the input.
#include <cstddef>
#include <cstdint>

#include "api_error.h"
#include "fuzz_util.h"
#include "msa/tokenizer.h"
#include "openai_format.h"
#include "output_parser.h"
#include "request_parse.h"

namespace {

// An M3-shaped template: every message field the server passes and the tools.
constexpr const char* kTemplate =
    "{{ bos_token }}{% if tools %}]~b]system\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}[e~[\n"
    "{% endif %}{% for message in messages %}{% if message['role'] == 'assistant' %}]~b]ai\n"
    "{% if message.reasoning_content %}<mm:think>{{ message.reasoning_content }}</mm:think>{% endif %}"
    "{{ message['content'] }}{% if message.tool_calls %}{% for call in message.tool_calls %}"
    "<invoke name=\"{{ call.function.name }}\">{{ call.function.arguments | tojson }}</invoke>{% endfor %}"
    "{% endif %}{% elif message['role'] == 'tool' %}]~b]tool\n{{ message.tool_call_id }} {{ message['content'] }}"
    "{% else %}]~b]{{ message['role'] }}\n{{ message['content'] }}{% endif %}[e~[\n{% endfor %}"
    "{% if add_generation_prompt %}]~b]ai\n{% if thinking_mode == 'enabled' %}<mm:think>{% endif %}{% endif %}";

const msa::ChatTemplate& chat_template() {
  static const msa::ChatTemplate t = msa::ChatTemplate::from_string(kTemplate);
  return t;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace msa::serve;
  if (size == 0) return 0;
  const uint8_t control = data[0];
  const std::string_view body(reinterpret_cast<const char*>(data + 1), size - 1);
  const Endpoint endpoint = (control & 1) ? Endpoint::chat : Endpoint::completions;
  ParseLimits limits;
  limits.vocab_size = 4096;
  limits.max_tokens_limit = 65536;
  limits.tools_supported = true;
  try {
    const ParsedRequest r = parse_request(endpoint, body, limits);
    if (r.max_tokens < 1 || r.max_tokens > limits.max_tokens_limit) msa::fuzz::invariant_failed("max_tokens out of range");
    for (int32_t id : r.prompt_ids)
      if (id < 0 || id >= limits.vocab_size) msa::fuzz::invariant_failed("prompt id out of range");
    if (endpoint == Endpoint::chat) {
      try {
        chat_template().render_json(dump(chat_template_context(r, "]~!b[", "[e~[")), uint64_t{1} << 18);
      } catch (const msa::Error&) {
      }
    }
  } catch (const ApiError& e) {
    if (e.status != 400) msa::fuzz::invariant_failed("a request refusal other than 400");
  }
  if (control & 2) {
    static const OrderedJson tools = OrderedJson::parse(
        R"([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties":
            {"n": {"type": "integer"}, "s": {"type": "string"}, "l": {"type": "array", "items": {"type": "number"}},
             "o": {"type": "object", "properties": {"b": {"type": "boolean"}}}}}}}])");
    OutputParser parser({.reasoning_start = "<mm:think>", .reasoning_end = "</mm:think>",
                         .tool_namespace = "]<]minimax[>["},
                        (control & 4) != 0, tools, "call_");
    const size_t piece = static_cast<size_t>(control >> 2) + 1;
    ParsedText all;
    for (size_t at = 0; at < body.size(); at += piece) all.append(parser.feed(body.substr(at, piece)));
    all.append(parser.finish());
    if (all.content.size() + all.reasoning.size() > body.size()) msa::fuzz::invariant_failed("the parser invented text");
    for (const ToolCall& call : all.tool_calls) OrderedJson::parse(call.arguments);  // valid JSON, or abort
  }
  return 0;
}
