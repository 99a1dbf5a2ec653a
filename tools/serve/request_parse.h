// Reading a request body of `POST /v1/chat/completions` or `POST /v1/completions` into what
// the scheduler runs, and refusing everything else with a 400 that names the field
// (docs/hardening.md's rules for input from people who attack it):
//   - the body is JSON nested at most 64 levels (parse_ordered_json_limited), an object;
//   - every field has a type and a range: max_tokens in [1, the cache's tokens], temperature
//     in [0, 2], top_p in (0, 1], top_k -1 or in [0, 2^31), seed any 64-bit integer, token ids
//     inside the vocabulary; strings are valid UTF-8 (the JSON parser refuses other bytes);
//   - a field this server does not know is refused (a typo must not silently change the
//     answer); known fields that do not change the answer (user, metadata, ...) are ignored;
//     supported fields with values that would change the answer in ways we do not implement
//     (n > 1, logprobs, penalties, logit_bias, tools without a tool-call format, ...) are
//     refused naming the field.
// Pure functions of the body and the limits (no model, no tokenizer): the fuzz target
// tests/fuzz/fuzz_serve_request.cpp drives them.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "msa/model_engine.h"

namespace msa::serve {

using OrderedJson = nlohmann::ordered_json;

enum class Endpoint { chat, completions };

struct ParseLimits {
  int64_t vocab_size = 1;          // token ids (prompt arrays, stop_token_ids) lie in [0, vocab)
  int64_t max_tokens_limit = 1;    // the most tokens a request may hold: the cache's capacity
  int64_t default_max_tokens = 16; // when the request gives none
  bool tools_supported = false;    // the model has a tool-call format (output_parser.h)
  size_t max_stop = 16;            // stop strings and stop ids, each
  size_t max_stop_bytes = 256;     // one stop string
  size_t max_messages = 8192;
};

struct ParsedRequest {
  Endpoint endpoint = Endpoint::completions;
  std::string model;
  // completions: the prompt as text (tokenized with the post-processor's BOS, as `msa run
  // --prompt` does) or as token ids (used as they are)
  std::optional<std::string> prompt_text;
  std::vector<int32_t> prompt_ids;
  bool add_special_tokens = true;  // text prompts: the tokenizer's BOS (vLLM's default too)
  // chat: the template's context without bos/eos (chat_template_context adds them)
  OrderedJson messages = OrderedJson::array();
  OrderedJson tools;                                  // null or the request's tools
  OrderedJson template_kwargs = OrderedJson::object();  // chat_template_kwargs
  bool add_generation_prompt = true;

  int64_t max_tokens = 16;
  bool max_tokens_given = false;
  SamplingParams sampling;
  std::vector<std::string> stop;
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
};

// Throws ApiError (400) for any body it does not accept; never anything else.
ParsedRequest parse_request(Endpoint endpoint, std::string_view body, const ParseLimits& limits);

// The chat template's context: messages, tools (when given), add_generation_prompt,
// bos_token, eos_token, then the request's chat_template_kwargs (which may not replace those).
OrderedJson chat_template_context(const ParsedRequest& request, const std::string& bos_token,
                                  const std::string& eos_token);

}  // namespace msa::serve
