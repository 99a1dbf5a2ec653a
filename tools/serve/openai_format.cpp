// OpenAI response objects (openai_format.h).
#include "openai_format.h"
#include <cstdint>

namespace msa::serve {

std::string dump(const OrderedJson& json) {
  return json.dump(-1, ' ', false, OrderedJson::error_handler_t::replace);
}

std::string sse_event(const OrderedJson& json) { return "data: " + dump(json) + "\n\n"; }

OrderedJson usage_json(const Usage& u) {
  return {{"prompt_tokens", u.prompt_tokens},
          {"completion_tokens", u.completion_tokens},
          {"total_tokens", u.prompt_tokens + u.completion_tokens},
          {"prompt_tokens_details", {{"cached_tokens", u.cached_tokens}}}};
}

OrderedJson error_json(const ApiError& e) {
  OrderedJson error = {{"message", e.what()},
                       {"type", e.type},
                       {"param", e.param.empty() ? OrderedJson() : OrderedJson(e.param)},
                       {"code", e.code.empty() ? OrderedJson() : OrderedJson(e.code)}};
  return {{"error", error}};
}

namespace {
OrderedJson finish_value(const std::string& reason) { return reason.empty() ? OrderedJson() : OrderedJson(reason); }

OrderedJson head_json(const ResponseHead& head, const char* object) {
  return {{"id", head.id}, {"object", object}, {"created", head.created}, {"model", head.model}};
}

OrderedJson tool_calls_json(const std::vector<ToolCall>& calls, int first_index, bool with_index) {
  OrderedJson out = OrderedJson::array();
  for (size_t i = 0; i < calls.size(); ++i) {
    OrderedJson call = OrderedJson::object();
    if (with_index) call["index"] = first_index + static_cast<int>(i);
    call["id"] = calls[i].id;
    call["type"] = "function";
    call["function"] = {{"name", calls[i].name}, {"arguments", calls[i].arguments}};
    out.push_back(std::move(call));
  }
  return out;
}
}  // namespace

OrderedJson completion_response(const ResponseHead& head, const std::string& text,
                                const std::string& finish_reason, const Usage& usage) {
  OrderedJson r = head_json(head, "text_completion");
  r["choices"] = OrderedJson::array({{{"index", 0}, {"text", text}, {"logprobs", nullptr},
                                      {"finish_reason", finish_value(finish_reason)}}});
  r["usage"] = usage_json(usage);
  return r;
}

OrderedJson completion_chunk(const ResponseHead& head, const std::string& text, const std::string& finish_reason) {
  OrderedJson r = head_json(head, "text_completion");
  r["choices"] = OrderedJson::array({{{"index", 0}, {"text", text}, {"logprobs", nullptr},
                                      {"finish_reason", finish_value(finish_reason)}}});
  return r;
}

OrderedJson chat_response(const ResponseHead& head, const ParsedText& m, const std::string& finish_reason,
                          const Usage& usage) {
  OrderedJson message = {{"role", "assistant"},
                         {"content", m.content.empty() && !m.tool_calls.empty() ? OrderedJson() : OrderedJson(m.content)}};
  if (!m.reasoning.empty()) message["reasoning_content"] = m.reasoning;
  if (!m.tool_calls.empty()) message["tool_calls"] = tool_calls_json(m.tool_calls, 0, false);
  OrderedJson r = head_json(head, "chat.completion");
  r["choices"] = OrderedJson::array({{{"index", 0}, {"message", message}, {"logprobs", nullptr},
                                      {"finish_reason", finish_value(finish_reason)}}});
  r["usage"] = usage_json(usage);
  return r;
}

OrderedJson chat_delta(const ParsedText& piece, int first_tool_index) {
  OrderedJson delta = OrderedJson::object();
  if (!piece.reasoning.empty()) delta["reasoning_content"] = piece.reasoning;
  if (!piece.content.empty()) delta["content"] = piece.content;
  if (!piece.tool_calls.empty()) delta["tool_calls"] = tool_calls_json(piece.tool_calls, first_tool_index, true);
  return delta;
}

OrderedJson chat_chunk(const ResponseHead& head, const OrderedJson& delta, const std::string& finish_reason) {
  OrderedJson r = head_json(head, "chat.completion.chunk");
  r["choices"] = OrderedJson::array({{{"index", 0}, {"delta", delta}, {"logprobs", nullptr},
                                      {"finish_reason", finish_value(finish_reason)}}});
  return r;
}

OrderedJson usage_chunk(const ResponseHead& head, const char* object, const Usage& usage) {
  OrderedJson r = head_json(head, object);
  r["choices"] = OrderedJson::array();
  r["usage"] = usage_json(usage);
  return r;
}

OrderedJson models_json(const std::string& model, int64_t created, int64_t max_model_len) {
  return {{"object", "list"},
          {"data", OrderedJson::array({{{"id", model},
                                        {"object", "model"},
                                        {"created", created},
                                        {"owned_by", "msa"},
                                        {"max_model_len", max_model_len}}})}};
}

}  // namespace msa::serve
