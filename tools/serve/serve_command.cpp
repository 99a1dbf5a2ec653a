// `msa serve`: loads the model and its tokenizer, starts the batching loop and the HTTP
// front, serves until SIGINT or SIGTERM (docs/serve.md).
#include <cstdint>
#include <pthread.h>
#include <signal.h>

#include <cstdio>
#include <filesystem>
#include <iostream>
#include <thread>

#include "cli_args.h"
#include "commands.h"
#include "http_front.h"
#include "msa/model.h"
#include "scheduler.h"
#include "serve_setup.h"
#ifdef MSA_WITH_TOKENIZER
#include "msa/tokenizer.h"
#endif

namespace msa::serve {
namespace {

constexpr const char* kUsage =
    "usage: msa serve --model DIR [--device cpu|cuda] [--tp N] [--host 127.0.0.1] [--port 8000]\n"
    "                 [--max-batch 32] [--cache-tokens 65536] [--api-key KEY] [--max-queue 256]\n"
    "                 [--served-model-name NAME] [--default-max-tokens 512] [--max-body-bytes N]\n"
    "                 [--chunk 512] [--max-step-tokens 2048] [--cache-dtype f32|bf16|fp8]\n"
    "                 [--no-prefix-cache] [--threads N] [--http-threads N] [--decode-graphs on|off]\n"
    "                 [--dense-engine auto|msa|cudnn|cudnn-gathered]\n"
    "  an OpenAI-compatible server: POST /v1/chat/completions, POST /v1/completions,\n"
    "  GET /v1/models, GET /health, GET /metrics (docs/serve.md)\n"
    "  --cache-tokens: KV-cache capacity (prompt + max_tokens of every running request)\n"
    "  --max-batch: requests running at once; --max-queue: requests waiting beyond that\n"
    "  (more get 503 with Retry-After); --api-key: require 'Authorization: Bearer KEY'\n"
    "  (also read from the environment variable MSA_API_KEY)\n"
    "  --tp N: tensor / expert parallel over N in-process ranks on the CPU (threads, each\n"
    "  with its share of --threads and its part of the weights and KV cache; the same API;\n"
    "  docs/parallel.md \"Serving\"); not with --device cuda yet\n"
    "  --decode-graphs on: with --device cuda, decode-only steps replay per-bucket CUDA graphs\n"
    "  (default on)\n"
    "  --dense-engine (--device cuda): the dense attention on ours or cuDNN's SDPA (paged, or\n"
    "  over K/V gathered out of the pages); auto = gathered cuDNN for prefill steps, ours for\n"
    "  decode\n";

int serve(int argc, char** argv) {
  cli::Args args(argc, argv, {"help", "no-prefix-cache"});
  if (args.has("help")) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  ServeSetup setup = read_serve_flags(args);
  ServerOptions server;
  server.host = args.get_string("host", "127.0.0.1");
  server.port = args.get_int("port", 8000, 0, 65535);
  const char* env_key = std::getenv("MSA_API_KEY");
  server.api_key = args.get_string("api-key", env_key ? env_key : "");
  server.max_body_bytes = static_cast<size_t>(args.get_int64("max-body-bytes", int64_t{32} << 20, 1024, int64_t{1} << 32));
  server.default_max_tokens = args.get_int64("default-max-tokens", 512, 1, int64_t{1} << 30);
  server.model_name = args.get_string("served-model-name", setup.default_model_name());
  server.threads = args.get_int("http-threads", 0, 0, 4096);
  args.finish();
  if (server.threads == 0)
    server.threads = static_cast<int>(std::min<int64_t>(4096, setup.scheduler.max_queue + setup.max_batch() + 32));

  // SIGINT / SIGTERM end the server through sigwait in one thread; every other thread
  // (httplib's pool, the scheduler, OpenMP's) inherits the blocked mask. A write to a closed
  // connection must be an error, not SIGPIPE's exit.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  LoadedModel loaded = load_for_serving(setup);
  Metrics metrics;
  Scheduler scheduler(*loaded.model, loaded.tokenizer_ptr(), setup.scheduler, metrics, loaded.kept_special);
  HttpFront front(scheduler, loaded.tokenizer_ptr(), loaded.model->config(), metrics, server);
  const int port = front.bind();
  if (server.host != "127.0.0.1" && server.host != "localhost" && server.host != "::1" && server.api_key.empty())
    std::fprintf(stderr, "msa serve: warning: listening on %s without --api-key: anyone who reaches it can use it\n",
                 server.host.c_str());
  std::thread stopper([&] {
    int signal_number = 0;
    sigwait(&stop_signals, &signal_number);
    std::fprintf(stderr, "msa serve: signal %d, stopping\n", signal_number);
    front.stop();
    // Open requests end now (with an error) rather than when their generation would: the
    // listener's shutdown waits for every connection's handler.
    scheduler.shutdown();
  });
  std::fprintf(stderr,
               "msa serve: listening on http://%s:%d (model %s, %s, KV cache %lld tokens, max batch %lld, "
               "max queue %lld, prefix cache %s, load %.2f s)\n",
               server.host.c_str(), port, server.model_name.c_str(), setup.device_name().c_str(),
               static_cast<long long>(scheduler.capacity_tokens()), static_cast<long long>(setup.max_batch()),
               static_cast<long long>(setup.scheduler.max_queue),
               setup.scheduler.engine.prefix_caching ? "on" : "off", loaded.load_seconds);
  std::fflush(stderr);
  front.run();
  // Stopped by the signal thread, or the listener failed: wake the signal thread either way.
  pthread_kill(stopper.native_handle(), SIGTERM);
  stopper.join();
  scheduler.shutdown();
  return 0;
}

}  // namespace
}  // namespace msa::serve

int run_serve_command(int argc, char** argv) {
  return msa::cli::run_reporting_errors("serve", msa::serve::kUsage,
                                        [&] { return msa::serve::serve(argc, argv); });
}
