// OpenAI's response objects: completions and chat completions, whole and as server-sent
// event chunks (the stream ends with `data: [DONE]`), usage, models and errors. The field
// names and order follow OpenAI's API reference; reasoning goes to `reasoning_content` and
// tool calls to `tool_calls`, the fields vLLM uses.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "api_error.h"
#include "output_parser.h"

namespace msa::serve {

using OrderedJson = nlohmann::ordered_json;

struct ResponseHead {
  std::string id;     // cmpl-... / chatcmpl-...
  int64_t created = 0;  // Unix seconds
  std::string model;
};

struct Usage {
  int64_t prompt_tokens = 0, completion_tokens = 0, cached_tokens = 0;
};

OrderedJson usage_json(const Usage& usage);
OrderedJson error_json(const ApiError& error);

OrderedJson completion_response(const ResponseHead& head, const std::string& text,
                                const std::string& finish_reason, const Usage& usage);
OrderedJson completion_chunk(const ResponseHead& head, const std::string& text,
                             const std::string& finish_reason);  // "" -> null

OrderedJson chat_response(const ResponseHead& head, const ParsedText& message,
                          const std::string& finish_reason, const Usage& usage);
// delta: the fields of this piece (role on the first, content / reasoning_content / tool_calls).
OrderedJson chat_chunk(const ResponseHead& head, const OrderedJson& delta, const std::string& finish_reason);
OrderedJson chat_delta(const ParsedText& piece, int first_tool_index);
// The last chunk of a stream with stream_options.include_usage: no choices, the usage.
OrderedJson usage_chunk(const ResponseHead& head, const char* object, const Usage& usage);

OrderedJson models_json(const std::string& model, int64_t created, int64_t max_model_len);

// "data: {...}\n\n"
std::string sse_event(const OrderedJson& json);
// JSON text; invalid UTF-8 (never produced, but never a throw either) becomes U+FFFD.
std::string dump(const OrderedJson& json);

}  // namespace msa::serve
