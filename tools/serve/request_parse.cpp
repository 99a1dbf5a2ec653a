// The request readers of request_parse.h: one checked reader per field type, then the two
// endpoints' field lists.
#include "request_parse.h"

#include <cstdint>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <set>

#include "api_error.h"
#include "core/json_parse.h"

namespace msa::serve {
namespace {

// Requests nest a few levels (messages -> tool_calls -> function -> arguments); tool schemas a
// few more. 64 leaves room and keeps every later recursion (copy, dump, render) shallow.
constexpr int kMaxRequestDepth = 64;

std::string type_name(const OrderedJson& v) {
  switch (v.type()) {
    case OrderedJson::value_t::null: return "null";
    case OrderedJson::value_t::boolean: return "boolean";
    case OrderedJson::value_t::string: return "string";
    case OrderedJson::value_t::array: return "array";
    case OrderedJson::value_t::object: return "object";
    default: return "number";
  }
}

// "string \"abc\"", "number 1e+30": what came, short, for the error message.
std::string got(const OrderedJson& v) {
  std::string text = v.dump(-1, ' ', false, OrderedJson::error_handler_t::replace);
  if (text.size() > 60) text = text.substr(0, 57) + "...";
  return "got " + type_name(v) + " " + text;
}

std::optional<int64_t> integral(const OrderedJson& v) {
  if (v.is_number_integer()) {
    if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) return std::nullopt;
    return v.get<int64_t>();
  }
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (std::isfinite(d) && d == std::floor(d) && std::abs(d) < 9.0e18) return static_cast<int64_t>(d);
  }
  return std::nullopt;
}

// One object's fields: every read marks the field as known; finish() refuses the rest.
class Fields {
 public:
  Fields(const OrderedJson& object, std::string prefix) : object_(object), prefix_(std::move(prefix)) {}

  std::string name(const std::string& key) const { return prefix_ + key; }
  // The value, or nullptr when absent or null (OpenAI clients send null for "not given").
  const OrderedJson* get(const std::string& key) {
    known_.insert(key);
    const auto it = object_.find(key);
    if (it == object_.end() || it->is_null()) return nullptr;
    return &*it;
  }
  void ignore(std::initializer_list<const char*> keys) {
    for (const char* key : keys) known_.insert(key);
  }
  bool boolean(const std::string& key, bool fallback) {
    const OrderedJson* v = get(key);
    if (!v) return fallback;
    if (!v->is_boolean()) bad_field(name(key), "expected a boolean, " + got(*v));
    return v->get<bool>();
  }
  int64_t integer(const std::string& key, int64_t fallback, int64_t min, int64_t max) {
    const OrderedJson* v = get(key);
    if (!v) return fallback;
    const std::optional<int64_t> i = v->is_boolean() ? std::nullopt : integral(*v);
    if (!i || *i < min || *i > max)
      bad_field(name(key), "expected an integer in [" + std::to_string(min) + ", " +
                               std::to_string(max) + "], " + got(*v));
    return *i;
  }
  double number(const std::string& key, double fallback, double min, double max, bool min_open = false) {
    const OrderedJson* v = get(key);
    if (!v) return fallback;
    const bool ok = v->is_number() && std::isfinite(v->get<double>()) &&
                    (min_open ? v->get<double>() > min : v->get<double>() >= min) &&
                    v->get<double>() <= max;
    if (!ok) {
      char range[96];
      std::snprintf(range, sizeof range, "%s%g, %g]", min_open ? "(" : "[", min, max);
      bad_field(name(key), std::string("expected a number in ") + range + ", " + got(*v));
    }
    return v->get<double>();
  }
  std::string string(const std::string& key, const std::string& fallback) {
    const OrderedJson* v = get(key);
    if (!v) return fallback;
    if (!v->is_string()) bad_field(name(key), "expected a string, " + got(*v));
    return v->get<std::string>();
  }
  // Refuses a value other than the ones that leave the answer as we compute it.
  void must_be_default(const std::string& key, const std::function<bool(const OrderedJson&)>& is_default,
                       const std::string& why) {
    const OrderedJson* v = get(key);
    if (v && !is_default(*v)) bad_field(name(key), why + ", " + got(*v));
  }
  void finish() const {
    for (const auto& [key, value] : object_.items())
      if (!known_.count(key))
        throw ApiError(400, name(key) + ": unknown field (msa serve refuses fields it does not know; "
                                        "see docs/serve.md)", name(key));
  }

 private:
  const OrderedJson& object_;
  std::string prefix_;
  std::set<std::string> known_;
};

std::vector<int32_t> token_ids(const OrderedJson& v, const std::string& field, int64_t vocab,
                               size_t max_count) {
  if (!v.is_array()) bad_field(field, "expected an array of token ids, " + got(v));
  if (v.size() > max_count)
    bad_field(field, "expected at most " + std::to_string(max_count) + " token ids, got " +
                         std::to_string(v.size()));
  std::vector<int32_t> ids;
  ids.reserve(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    const std::optional<int64_t> id = v[i].is_boolean() ? std::nullopt : integral(v[i]);
    if (!id || *id < 0 || *id >= vocab)
      bad_field(field + "[" + std::to_string(i) + "]",
                "expected a token id in [0, " + std::to_string(vocab) + "), " + got(v[i]));
    ids.push_back(static_cast<int32_t>(*id));
  }
  return ids;
}

void read_sampling(Fields& f, ParsedRequest& r, const ParseLimits& limits) {
  r.model = f.string("model", "");
  // max_completion_tokens is the chat API's newer name of max_tokens.
  const int64_t max = std::max<int64_t>(limits.max_tokens_limit, 1);
  const bool has_new = f.get("max_completion_tokens") != nullptr;
  const bool has_old = f.get("max_tokens") != nullptr;
  if (has_new && has_old) bad_field(f.name("max_completion_tokens"), "give max_tokens or max_completion_tokens, not both");
  r.max_tokens_given = has_new || has_old;
  r.max_tokens = f.integer(has_new ? "max_completion_tokens" : "max_tokens", limits.default_max_tokens, 1, max);
  r.sampling.temperature = f.number("temperature", 1.0, 0, 2);
  r.sampling.top_p = f.number("top_p", 1.0, 0, 1, /*min_open=*/true);
  const int64_t top_k = f.integer("top_k", 0, -1, INT32_MAX);  // -1 and 0: no top-k (vLLM: -1)
  r.sampling.top_k = static_cast<int>(std::max<int64_t>(top_k, 0));
  if (const OrderedJson* seed = f.get("seed")) {
    if (seed->is_number_unsigned()) r.sampling.seed = seed->get<uint64_t>();
    else if (seed->is_number_integer()) r.sampling.seed = static_cast<uint64_t>(seed->get<int64_t>());
    else bad_field(f.name("seed"), "expected an integer in [-2^63, 2^64), " + got(*seed));
  }
  if (const OrderedJson* stop = f.get("stop")) {
    const auto add = [&](const OrderedJson& s, const std::string& field) {
      if (!s.is_string()) bad_field(field, "expected a string, " + got(s));
      const std::string text = s.get<std::string>();
      if (text.empty()) bad_field(field, "expected a non-empty string");
      if (text.size() > limits.max_stop_bytes)
        bad_field(field, "expected at most " + std::to_string(limits.max_stop_bytes) + " bytes, got " +
                             std::to_string(text.size()));
      r.stop.push_back(text);
    };
    if (stop->is_string()) {
      add(*stop, f.name("stop"));
    } else if (stop->is_array()) {
      if (stop->size() > limits.max_stop)
        bad_field(f.name("stop"), "expected at most " + std::to_string(limits.max_stop) + " strings, got " +
                                      std::to_string(stop->size()));
      for (size_t i = 0; i < stop->size(); ++i) add((*stop)[i], f.name("stop") + "[" + std::to_string(i) + "]");
    } else {
      bad_field(f.name("stop"), "expected a string or an array of strings, " + got(*stop));
    }
  }
  if (const OrderedJson* ids = f.get("stop_token_ids"))
    r.stop_token_ids = token_ids(*ids, f.name("stop_token_ids"), limits.vocab_size, limits.max_stop);
  r.ignore_eos = f.boolean("ignore_eos", false);
  r.stream = f.boolean("stream", false);
  if (const OrderedJson* options = f.get("stream_options")) {
    if (!options->is_object()) bad_field(f.name("stream_options"), "expected an object, " + got(*options));
    if (!r.stream) bad_field(f.name("stream_options"), "only allowed with stream: true");
    Fields o(*options, f.name("stream_options."));
    r.include_usage = o.boolean("include_usage", false);
    o.ignore({"continuous_usage_stats"});
    o.finish();
  }
  f.integer("n", 1, 1, 1);  // "expected an integer in [1, 1]": one choice per request
  const auto zero = [](const OrderedJson& v) { return v.is_number() && v.get<double>() == 0; };
  f.must_be_default("presence_penalty", zero, "only 0 is supported");
  f.must_be_default("frequency_penalty", zero, "only 0 is supported");
  f.must_be_default("repetition_penalty", [](const OrderedJson& v) { return v.is_number() && v.get<double>() == 1; },
                    "only 1 is supported");
  f.must_be_default("min_p", zero, "only 0 is supported");
  f.must_be_default("min_tokens", zero, "only 0 is supported");
  f.must_be_default("logit_bias", [](const OrderedJson& v) { return v.is_object() && v.empty(); },
                    "logit biases are not supported");
  f.must_be_default("top_logprobs", zero, "log probabilities are not supported");
  f.must_be_default("response_format",
                    [](const OrderedJson& v) { return v.is_object() && v.value("type", "") == "text" && v.size() == 1; },
                    "only {\"type\": \"text\"} is supported");
  f.must_be_default("prediction", [](const OrderedJson&) { return false; }, "predicted outputs are not supported");
  // Fields that do not change the tokens: accepted and ignored.
  f.ignore({"user", "metadata", "store", "service_tier", "skip_special_tokens", "prompt_cache_key",
            "safety_identifier", "request_id", "priority"});
}

std::string text_content(const OrderedJson& content, const std::string& field) {
  if (content.is_string()) return content.get<std::string>();
  if (!content.is_array()) bad_field(field, "expected a string, null or an array of text parts, " + got(content));
  std::string text;
  for (size_t i = 0; i < content.size(); ++i) {
    const std::string part_field = field + "[" + std::to_string(i) + "]";
    const OrderedJson& part = content[i];
    if (!part.is_object()) bad_field(part_field, "expected an object, " + got(part));
    Fields p(part, part_field + ".");
    const std::string type = p.string("type", "");
    if (type != "text") bad_field(part_field + ".type", "only text parts are supported, got \"" + type + "\"");
    const OrderedJson* t = p.get("text");
    if (!t || !t->is_string()) bad_field(part_field + ".text", "expected a string");
    p.ignore({"cache_control"});
    p.finish();
    if (i) text += "\n";
    text += t->get<std::string>();
  }
  return text;
}

OrderedJson read_tool_calls(const OrderedJson& calls, const std::string& field) {
  if (!calls.is_array()) bad_field(field, "expected an array, " + got(calls));
  OrderedJson out = OrderedJson::array();
  for (size_t i = 0; i < calls.size(); ++i) {
    const std::string call_field = field + "[" + std::to_string(i) + "]";
    if (!calls[i].is_object()) bad_field(call_field, "expected an object, " + got(calls[i]));
    Fields c(calls[i], call_field + ".");
    OrderedJson call = OrderedJson::object();
    call["id"] = c.string("id", "");
    const std::string type = c.string("type", "function");
    if (type != "function") bad_field(call_field + ".type", "expected \"function\", got \"" + type + "\"");
    call["type"] = type;
    const OrderedJson* function = c.get("function");
    if (!function || !function->is_object()) bad_field(call_field + ".function", "expected an object");
    Fields fn(*function, call_field + ".function.");
    const std::string name = fn.string("name", "");
    if (name.empty()) bad_field(call_field + ".function.name", "expected a non-empty string");
    OrderedJson arguments = fn.string("arguments", "{}");
    // Templates (transformers' convention) read arguments as a mapping; a JSON object string
    // is given to them as that object.
    try {
      OrderedJson parsed = parse_ordered_json_limited(arguments.get<std::string>(), kMaxRequestDepth);
      if (parsed.is_object()) arguments = std::move(parsed);
    } catch (const Error&) {
    }
    fn.finish();
    c.finish();
    call["function"] = {{"name", name}, {"arguments", arguments}};
    out.push_back(std::move(call));
  }
  return out;
}

void read_messages(Fields& f, ParsedRequest& r, const ParseLimits& limits) {
  const OrderedJson* messages = f.get("messages");
  if (!messages) bad_field("messages", "required");
  if (!messages->is_array() || messages->empty())
    bad_field("messages", "expected a non-empty array of messages, " + got(*messages));
  if (messages->size() > limits.max_messages)
    bad_field("messages", "expected at most " + std::to_string(limits.max_messages) + " messages");
  static const std::set<std::string> roles = {"system", "developer", "user", "assistant", "tool"};
  for (size_t i = 0; i < messages->size(); ++i) {
    const std::string field = "messages[" + std::to_string(i) + "]";
    const OrderedJson& m = (*messages)[i];
    if (!m.is_object()) bad_field(field, "expected an object, " + got(m));
    Fields mf(m, field + ".");
    const std::string role = mf.string("role", "");
    if (!roles.count(role))
      bad_field(field + ".role", "expected system, developer, user, assistant or tool, got \"" + role + "\"");
    OrderedJson message = OrderedJson::object();
    message["role"] = role;
    const OrderedJson* content = mf.get("content");
    message["content"] = content ? text_content(*content, field + ".content") : std::string();
    if (const OrderedJson* name = mf.get("name")) {
      if (!name->is_string()) bad_field(field + ".name", "expected a string, " + got(*name));
      message["name"] = *name;
    }
    if (const OrderedJson* calls = mf.get("tool_calls")) {
      if (role != "assistant") bad_field(field + ".tool_calls", "only assistant messages have tool calls");
      message["tool_calls"] = read_tool_calls(*calls, field + ".tool_calls");
    }
    if (const OrderedJson* id = mf.get("tool_call_id")) {
      if (!id->is_string()) bad_field(field + ".tool_call_id", "expected a string, " + got(*id));
      message["tool_call_id"] = *id;
    }
    for (const char* key : {"reasoning_content", "reasoning"})
      if (const OrderedJson* reasoning = mf.get(key)) {
        if (!reasoning->is_string()) bad_field(field + "." + key, "expected a string, " + got(*reasoning));
        message["reasoning_content"] = *reasoning;
      }
    mf.ignore({"refusal", "annotations", "audio", "function_call"});
    mf.finish();
    r.messages.push_back(std::move(message));
  }
}

void read_tools(Fields& f, ParsedRequest& r, const ParseLimits& limits) {
  const OrderedJson* tools = f.get("tools");
  const std::string choice = [&]() -> std::string {
    const OrderedJson* c = f.get("tool_choice");
    if (!c) return "auto";
    if (c->is_string()) return c->get<std::string>();
    return "named";
  }();
  if (choice != "auto" && choice != "none")
    bad_field("tool_choice", "only \"auto\" and \"none\" are supported (the model decides), got " +
                                 (choice == "named" ? std::string("a named function") : "\"" + choice + "\""));
  f.must_be_default("functions", [](const OrderedJson&) { return false; }, "the deprecated functions field is not supported; use tools");
  f.must_be_default("function_call", [](const OrderedJson&) { return false; }, "the deprecated function_call field is not supported; use tool_choice");
  if (!tools) return;
  if (!tools->is_array()) bad_field("tools", "expected an array, " + got(*tools));
  if (tools->empty() || choice == "none") return;
  if (!limits.tools_supported)
    bad_field("tools", "this model's tokenizer has no tool-call format that msa serve parses "
                       "(MiniMax-M3's ]<]minimax[>[ tool calls); send the request without tools");
  for (size_t i = 0; i < tools->size(); ++i) {
    const std::string field = "tools[" + std::to_string(i) + "]";
    const OrderedJson& t = (*tools)[i];
    if (!t.is_object() || t.value("type", "") != "function" || !t.contains("function") ||
        !t["function"].is_object() || !t["function"].contains("name") || !t["function"]["name"].is_string())
      bad_field(field, "expected {\"type\": \"function\", \"function\": {\"name\": ..., \"parameters\": ...}}");
  }
  r.tools = *tools;
}

}  // namespace

ParsedRequest parse_request(Endpoint endpoint, std::string_view body, const ParseLimits& limits) {
  OrderedJson json;
  try {
    json = parse_ordered_json_limited(body, kMaxRequestDepth);
  } catch (const Error& e) {
    throw ApiError(400, std::string("the body is not valid JSON: ") + e.what());
  }
  if (!json.is_object()) throw ApiError(400, "the body must be a JSON object, " + got(json));
  ParsedRequest r;
  r.endpoint = endpoint;
  Fields f(json, "");
  read_sampling(f, r, limits);
  if (endpoint == Endpoint::chat) {
    read_messages(f, r, limits);
    read_tools(f, r, limits);
    f.must_be_default("logprobs", [](const OrderedJson& v) { return v.is_boolean() && !v.get<bool>(); },
                      "log probabilities are not supported");
    r.add_generation_prompt = f.boolean("add_generation_prompt", true);
    if (const OrderedJson* kwargs = f.get("chat_template_kwargs")) {
      if (!kwargs->is_object()) bad_field("chat_template_kwargs", "expected an object, " + got(*kwargs));
      for (const auto& [key, value] : kwargs->items())
        if (key == "messages" || key == "tools" || key == "add_generation_prompt" || key == "bos_token" ||
            key == "eos_token")
          bad_field("chat_template_kwargs." + key, "set by the request itself");
      r.template_kwargs = *kwargs;
    }
    f.ignore({"parallel_tool_calls", "reasoning_effort", "modalities", "verbosity", "web_search_options"});
  } else {
    const OrderedJson* prompt = f.get("prompt");
    if (!prompt) bad_field("prompt", "required");
    const OrderedJson* p = prompt;
    // One prompt per request: a string, token ids, or a list holding one of these.
    if (p->is_array() && p->size() == 1 && ((*p)[0].is_string() || (*p)[0].is_array())) p = &(*p)[0];
    if (p->is_string()) {
      if (p->get<std::string>().empty()) bad_field("prompt", "expected a non-empty string");
      r.prompt_text = p->get<std::string>();
    } else if (p->is_array() && !p->empty() && !(*p)[0].is_string() && !(*p)[0].is_array()) {
      r.prompt_ids = token_ids(*p, "prompt", limits.vocab_size, static_cast<size_t>(limits.max_tokens_limit));
    } else {
      bad_field("prompt", "expected one prompt: a non-empty string or array of token ids (n = 1), " + got(*prompt));
    }
    f.must_be_default("logprobs", [](const OrderedJson& v) { return v.is_number() && v.get<double>() == 0; },
                      "log probabilities are not supported");
    f.must_be_default("echo", [](const OrderedJson& v) { return v.is_boolean() && !v.get<bool>(); },
                      "echo is not supported");
    f.must_be_default("best_of", [](const OrderedJson& v) { return v.is_number() && v.get<double>() == 1; },
                      "only 1 is supported");
    f.must_be_default("suffix", [](const OrderedJson& v) { return v.is_string() && v.get<std::string>().empty(); },
                      "suffixes are not supported");
    r.add_special_tokens = f.boolean("add_special_tokens", true);
  }
  f.finish();
  return r;
}

OrderedJson chat_template_context(const ParsedRequest& request, const std::string& bos_token,
                                  const std::string& eos_token) {
  OrderedJson context = OrderedJson::object();
  context["messages"] = request.messages;
  if (!request.tools.is_null()) context["tools"] = request.tools;
  context["add_generation_prompt"] = request.add_generation_prompt;
  context["bos_token"] = bos_token;
  context["eos_token"] = eos_token;
  for (const auto& [key, value] : request.template_kwargs.items()) context[key] = value;
  return context;
}

}  // namespace msa::serve
