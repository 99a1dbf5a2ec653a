// Routes and responses of `msa serve` over cpp-httplib (http_front.h).
#include "http_front.h"

#include <cstdint>
#include <httplib.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <random>

#include "api_error.h"
#include "openai_format.h"
#include "request_parse.h"
#ifdef MSA_WITH_TOKENIZER
#include "msa/tokenizer.h"
#endif

namespace msa::serve {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kPoll = std::chrono::milliseconds(250);
// A waiting response writes a heartbeat this often, so a closed connection shows (the
// second write after the peer closed fails).
constexpr auto kHeartbeat = std::chrono::seconds(1);

void send_error(httplib::Response& res, const ApiError& e) {
  res.status = e.status;
  if (e.status == 503) res.set_header("Retry-After", "1");
  if (e.status == 401) res.set_header("WWW-Authenticate", "Bearer");
  res.set_content(dump(error_json(e)), "application/json");
}

bool equal_in_constant_time(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i % (b.size() ? b.size() : 1)]);
  return diff == 0 && !b.empty();
}

std::string rstrip(std::string text) {
  while (!text.empty() && (text.back() == ' ' || text.back() == '\n' || text.back() == '\r' || text.back() == '\t'))
    text.pop_back();
  return text;
}

}  // namespace

struct HttpFront::Impl {
  Scheduler& scheduler;
  const Tokenizer* tokenizer;
  const ModelConfig& config;
  Metrics& metrics;
  ServerOptions options;
  OutputFormat format;
  httplib::Server server;
  std::atomic<uint64_t> counter{0};
  uint64_t id_salt = std::random_device{}();
  int64_t started = static_cast<int64_t>(std::time(nullptr));

  Impl(Scheduler& s, const Tokenizer* t, const ModelConfig& c, Metrics& m, ServerOptions o)
      : scheduler(s), tokenizer(t), config(c), metrics(m), options(std::move(o)) {
#ifdef MSA_WITH_TOKENIZER
    if (tokenizer) format = OutputFormat::detect(*tokenizer);
#endif
  }

  std::string new_id(const char* prefix) {
    char text[40];
    std::snprintf(text, sizeof text, "%s%016llx", prefix,
                  static_cast<unsigned long long>((counter++ * 0x9e3779b97f4a7c15ull) ^ id_salt));
    return text;
  }

  bool authorized(const httplib::Request& req, httplib::Response& res) {
    if (options.api_key.empty()) return true;
    const std::string header = req.get_header_value("Authorization");
    const std::string prefix = "Bearer ";
    if (header.compare(0, prefix.size(), prefix) == 0 &&
        equal_in_constant_time(header.substr(prefix.size()), options.api_key))
      return true;
    metrics.request_rejected("unauthorized");
    send_error(res, ApiError(401, header.empty() ? "missing the API key: send the header 'Authorization: Bearer KEY'"
                                                 : "invalid API key",
                             "", "authentication_error", "invalid_api_key"));
    return false;
  }

  void routes();
  void generate(Endpoint endpoint, const httplib::Request& req, httplib::Response& res);
  std::vector<int32_t> prompt_tokens(Endpoint endpoint, const ParsedRequest& r, bool& start_in_reasoning);
};

std::vector<int32_t> HttpFront::Impl::prompt_tokens(Endpoint endpoint, const ParsedRequest& r,
                                                    bool& start_in_reasoning) {
  start_in_reasoning = false;
  if (endpoint == Endpoint::completions && !r.prompt_ids.empty()) return r.prompt_ids;
#ifdef MSA_WITH_TOKENIZER
  if (endpoint == Endpoint::completions) {
    if (!tokenizer)
      throw ApiError(400, "prompt: the model directory has no tokenizer.json; send the prompt as token ids", "prompt");
    return tokenizer->encode(*r.prompt_text, r.add_special_tokens);
  }
  if (!tokenizer || !tokenizer->chat_template())
    throw ApiError(400, "messages: the model directory has no chat template (tokenizer_config.json or "
                        "chat_template.jinja); use /v1/completions", "messages");
  std::string rendered;
  try {
    rendered = tokenizer->chat_template()->render_json(
        dump(chat_template_context(r, tokenizer->bos_token(), tokenizer->eos_token())));
  } catch (const Error& e) {
    throw ApiError(400, std::string("messages: the chat template refused them: ") + e.what(), "messages");
  }
  // The template opened the reasoning block itself (M3's thinking_mode): the output starts
  // inside it.
  if (format.has_reasoning()) {
    const std::string end = rstrip(rendered);
    start_in_reasoning = end.size() >= format.reasoning_start.size() &&
                         end.compare(end.size() - format.reasoning_start.size(), std::string::npos,
                                     format.reasoning_start) == 0;
  }
  // The template writes the BOS text itself: no post-processor tokens (vLLM's rule too).
  return tokenizer->encode(rendered, false);
#else
  (void)r;
  throw ApiError(400, std::string(endpoint == Endpoint::chat ? "messages" : "prompt") +
                          ": this build of msa has no tokenizer; send /v1/completions a prompt of token ids",
                 endpoint == Endpoint::chat ? "messages" : "prompt");
#endif
}

void HttpFront::Impl::generate(Endpoint endpoint, const httplib::Request& req, httplib::Response& res) {
  if (!authorized(req, res)) return;
  try {
    ParseLimits limits;
    limits.vocab_size = config.vocab_size;
    limits.max_tokens_limit = scheduler.capacity_tokens();
    limits.default_max_tokens = endpoint == Endpoint::chat ? options.default_max_tokens : 16;
    limits.tools_supported = format.has_tools();
    ParsedRequest r = parse_request(endpoint, req.body, limits);
    bool start_in_reasoning = false;
    std::vector<int32_t> prompt = prompt_tokens(endpoint, r, start_in_reasoning);
    const char* prompt_field = endpoint == Endpoint::chat ? "messages" : "prompt";
    if (prompt.empty()) throw ApiError(400, std::string(prompt_field) + ": tokenizes to no tokens", prompt_field);
    const int64_t capacity = scheduler.capacity_tokens();
    const int64_t n = static_cast<int64_t>(prompt.size());
    for (size_t i = 0; i < prompt.size(); ++i)
      if (prompt[i] < 0 || prompt[i] >= config.vocab_size)
        throw ApiError(400, std::string(prompt_field) + ": token " + std::to_string(prompt[i]) +
                                " is outside the model's vocabulary", prompt_field);
    if (n >= capacity)
      throw ApiError(400, std::string(prompt_field) + ": the prompt has " + std::to_string(n) +
                              " tokens; the KV cache holds " + std::to_string(capacity) +
                              " tokens per request (prompt + max_tokens; --cache-tokens)",
                     prompt_field, "invalid_request_error", "context_length_exceeded");
    if (!r.max_tokens_given) {
      r.max_tokens = std::min(r.max_tokens, capacity - n);
    } else if (n + r.max_tokens > capacity) {
      throw ApiError(400, "max_tokens: the prompt (" + std::to_string(n) + " tokens) + max_tokens (" +
                              std::to_string(r.max_tokens) + ") = " + std::to_string(n + r.max_tokens) +
                              " tokens, more than the KV cache holds per request (" + std::to_string(capacity) +
                              "; --cache-tokens)",
                     "max_tokens", "invalid_request_error", "context_length_exceeded");
    }
    GenerationRequest g;
    g.prompt = std::move(prompt);
    g.max_tokens = r.max_tokens;
    g.sampling = r.sampling;
    if (!r.ignore_eos) g.stop_tokens = config.eos_token_ids;
    g.stop_tokens.insert(g.stop_tokens.end(), r.stop_token_ids.begin(), r.stop_token_ids.end());
    std::shared_ptr<Job> job = scheduler.submit(std::move(g), r.stop);

    const bool chat = endpoint == Endpoint::chat;
    const ResponseHead head{new_id(chat ? "chatcmpl-" : "cmpl-"), static_cast<int64_t>(std::time(nullptr)),
                            options.model_name};
    auto parser = std::make_shared<OutputParser>(format, start_in_reasoning, chat ? r.tools : OrderedJson(),
                                                 "call_" + head.id.substr(head.id.find('-') + 1) + "_");
    Scheduler* scheduler_ptr = &scheduler;
    const auto release = [scheduler_ptr, job](bool success) {
      if (!success) scheduler_ptr->cancel(job);  // the connection broke: free the pages now
    };
    const auto usage_of = [](const Job::Update& u) {
      return Usage{u.prompt_tokens, u.completion_tokens, u.cached_tokens};
    };

    if (!r.stream) {
      auto text = std::make_shared<std::string>();
      const Clock::time_point start = Clock::now();
      res.set_chunked_content_provider(
          "application/json",
          [=](size_t, httplib::DataSink& sink) {
            Clock::time_point last_write = start;
            for (;;) {
              const Job::Update u = job->wait(kPoll);
              *text += u.text;
              if (u.finished) {
                std::string body;
                if (u.finish_reason == "error") {
                  body = dump(error_json(ApiError(500, u.error, "", "server_error")));
                } else if (chat) {
                  ParsedText message = parser->feed(*text);
                  message.append(parser->finish());
                  const std::string reason =
                      u.finish_reason == "stop" && !message.tool_calls.empty() ? "tool_calls" : u.finish_reason;
                  body = dump(chat_response(head, message, reason, usage_of(u)));
                } else {
                  body = dump(completion_response(head, *text, u.finish_reason, usage_of(u)));
                }
                body += "\n";
                if (!sink.write(body.data(), body.size())) return false;
                sink.done();
                return true;
              }
              // JSON allows whitespace before the value: the heartbeat of a whole response.
              const Clock::time_point now = Clock::now();
              if (now - last_write >= kHeartbeat) {
                if (!sink.write(" ", 1)) return false;
                last_write = now;
              }
            }
          },
          release);
      return;
    }

    auto started_stream = std::make_shared<bool>(false);
    auto tool_index = std::make_shared<int>(0);
    const bool include_usage = r.include_usage;
    res.set_header("Cache-Control", "no-cache");
    res.set_chunked_content_provider(
        "text/event-stream",
        [=](size_t, httplib::DataSink& sink) {
          const auto write = [&](const std::string& text) { return sink.write(text.data(), text.size()); };
          if (chat && !*started_stream) {
            *started_stream = true;
            if (!write(sse_event(chat_chunk(head, {{"role", "assistant"}, {"content", ""}}, "")))) return false;
          }
          Clock::time_point last_write = Clock::now();
          for (;;) {
            const Job::Update u = job->wait(kPoll);
            if (!u.text.empty()) {
              std::string event;
              if (chat) {
                const ParsedText piece = parser->feed(u.text);
                if (!piece.empty()) event = sse_event(chat_chunk(head, chat_delta(piece, *tool_index), ""));
                *tool_index += static_cast<int>(piece.tool_calls.size());
              } else {
                event = sse_event(completion_chunk(head, u.text, ""));
              }
              if (!event.empty()) {
                if (!write(event)) return false;
                last_write = Clock::now();
              }
            }
            if (u.finished) {
              std::string tail;
              if (u.finish_reason == "error") {
                tail = sse_event(error_json(ApiError(500, u.error, "", "server_error")));
              } else if (chat) {
                const ParsedText piece = parser->finish();
                if (!piece.empty()) tail += sse_event(chat_chunk(head, chat_delta(piece, *tool_index), ""));
                const std::string reason =
                    u.finish_reason == "stop" && parser->tool_calls() > 0 ? "tool_calls" : u.finish_reason;
                tail += sse_event(chat_chunk(head, OrderedJson::object(), reason));
                if (include_usage) tail += sse_event(usage_chunk(head, "chat.completion.chunk", usage_of(u)));
              } else {
                tail += sse_event(completion_chunk(head, "", u.finish_reason));
                if (include_usage) tail += sse_event(usage_chunk(head, "text_completion", usage_of(u)));
              }
              tail += "data: [DONE]\n\n";
              if (!write(tail)) return false;
              sink.done();
              return true;
            }
            const Clock::time_point now = Clock::now();
            if (now - last_write >= kHeartbeat) {  // an SSE comment; clients skip it
              if (!write(": keep-alive\n\n")) return false;
              last_write = now;
            }
          }
        },
        release);
  } catch (const ApiError& e) {
    if (e.status == 400) metrics.request_rejected(e.code == "context_length_exceeded" ? "too_large" : "invalid");
    send_error(res, e);
  } catch (const Error& e) {
    metrics.request_rejected("invalid");
    send_error(res, ApiError(400, e.what()));
  } catch (const std::exception& e) {
    send_error(res, ApiError(500, std::string("internal error: ") + e.what(), "", "server_error"));
  }
}

void HttpFront::Impl::routes() {
  server.Post("/v1/chat/completions", [this](const httplib::Request& req, httplib::Response& res) {
    generate(Endpoint::chat, req, res);
  });
  server.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
    generate(Endpoint::completions, req, res);
  });
  server.Get("/v1/models", [this](const httplib::Request& req, httplib::Response& res) {
    if (!authorized(req, res)) return;
    res.set_content(dump(models_json(options.model_name, started, scheduler.capacity_tokens())), "application/json");
  });
  server.Get("/health", [](const httplib::Request&, httplib::Response& res) {
    res.set_content("{\"status\":\"ok\"}", "application/json");
  });
  server.Get("/metrics", [this](const httplib::Request& req, httplib::Response& res) {
    if (!authorized(req, res)) return;
    res.set_content(metrics.render(), "text/plain; version=0.0.4; charset=utf-8");
  });
  // Statuses httplib sets itself (404, 405, 413, 400 for a broken request line) get
  // OpenAI's error object too.
  server.set_error_handler(httplib::Server::HandlerWithResponse([this](const httplib::Request& req,
                                                                      httplib::Response& res) {
    if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
    std::string message;
    if (res.status == 404) message = "not found: " + req.method + " " + req.path;
    else if (res.status == 413) message = "the body is larger than " + std::to_string(options.max_body_bytes) + " bytes (--max-body-bytes)";
    else if (res.status == 405) message = "method not allowed: " + req.method + " " + req.path;
    else message = std::string("bad request (HTTP ") + std::to_string(res.status) + ")";
    const int status = res.status;
    send_error(res, ApiError(status, message, "", status >= 500 ? "server_error" : "invalid_request_error"));
    return httplib::Server::HandlerResponse::Handled;
  }));
  server.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "unknown";
    try {
      if (ep) std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    send_error(res, ApiError(500, "internal error: " + what, "", "server_error"));
  });
}

HttpFront::HttpFront(Scheduler& scheduler, const Tokenizer* tokenizer, const ModelConfig& config, Metrics& metrics,
                     ServerOptions options)
    : impl_(std::make_unique<Impl>(scheduler, tokenizer, config, metrics, std::move(options))) {
  Impl& i = *impl_;
  // One thread per open connection: a streaming response holds its thread while it runs,
  // so the pool must exceed what the queue and the batch admit, or requests would wait
  // unseen in httplib's own queue instead of getting a 503.
  const int threads = i.options.threads > 0
                          ? i.options.threads
                          : static_cast<int>(std::min<int64_t>(4096, i.scheduler.max_queue() + 64));
  i.server.new_task_queue = [threads] { return new httplib::ThreadPool(static_cast<size_t>(threads)); };
  i.server.set_payload_max_length(i.options.max_body_bytes);
  i.server.set_read_timeout(30, 0);
  i.server.set_write_timeout(30, 0);
  i.server.set_keep_alive_max_count(1000);
  i.server.set_keep_alive_timeout(5);
  i.routes();
}

HttpFront::~HttpFront() = default;

int HttpFront::bind() {
  Impl& i = *impl_;
  int port = i.options.port;
  if (port == 0) {
    port = i.server.bind_to_any_port(i.options.host);
  } else if (!i.server.bind_to_port(i.options.host, port)) {
    port = -1;
  }
  if (port <= 0)
    throw Error("cannot listen on " + i.options.host + ":" + std::to_string(i.options.port) +
                " (in use, or not an address of this machine)");
  return port;
}

void HttpFront::run() { impl_->server.listen_after_bind(); }

void HttpFront::stop() { impl_->server.stop(); }

}  // namespace msa::serve
