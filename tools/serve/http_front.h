// The HTTP side of `msa serve` (cpp-httplib: Debian's libcpp-httplib-dev, or its
// header-only form carried in .deps/prefix by scripts/pack_deps.sh): routes, the API key,
// the body limit, request checks against the model (prompt length vs the cache), and the
// responses, whole or streamed as server-sent events.
//
//   POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health, GET /metrics
//
// Every refusal is OpenAI's error object with a 4xx (5xx for a full queue: 503 with
// Retry-After); a handler never lets an exception reach the connection. Client disconnects:
// a streamed response notices the failed write at once; a waiting one writes a heartbeat
// (an SSE comment, or a space before the JSON of a whole response) every second, so a
// closed connection is noticed within about two seconds and the request is cancelled,
// freeing its pages.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "metrics.h"
#include "msa/model_config.h"
#include "output_parser.h"
#include "scheduler.h"

namespace msa::serve {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;                 // 0: any free port (bind() returns it)
  std::string api_key;             // "" : no authentication
  size_t max_body_bytes = 32u << 20;
  int64_t default_max_tokens = 512;  // chat requests without max_tokens (completions: 16)
  std::string model_name = "msa";
  int threads = 0;                 // HTTP worker threads (0: max batch + queue + 8)
};

class HttpFront {
 public:
  HttpFront(Scheduler& scheduler, const Tokenizer* tokenizer, const ModelConfig& config, Metrics& metrics,
            ServerOptions options);
  ~HttpFront();
  // Binds the listening socket; returns the port. Throws msa::Error when it cannot.
  int bind();
  // Serves until stop() (from another thread or a signal handler's thread).
  void run();
  void stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace msa::serve
