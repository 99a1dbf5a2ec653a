// `msa bench-serve`: the server under load, measured from its clients. It starts `msa serve`
// in this process on a free loopback port (or talks to --url), and for every prompt length
// and concurrency c runs c client threads that each send streaming /v1/completions requests
// (token-id prompts of exactly that length, distinct per request so the prefix cache does
// not help, greedy, ignore_eos: every request makes --output-tokens tokens) until the cell's
// requests are done. Per cell: output tokens/s over the cell's wall time, decode tokens/s
// (c / mean TPOT), TTFT and TPOT p50 / p99, the engine's own mean decode-step time (from
// /metrics: msa_engine_step_seconds{kind="decode"}), the server overhead (TPOT at c = 1 over
// the step time, the target <= 5%), and the bandwidth floor of a decode step: the
// bytes it must read (weights, with the experts that c tokens touch, and every request's KV
// reads) over the machine's read bandwidth, as tokens/s (target: decode tokens/s at c = 32
// >= 0.7x that).
#include <cstdint>
#include <signal.h>

#include <httplib.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>

#include "cli_args.h"
#include "commands.h"
#include "http_front.h"
#include "machine_peak.h"
#include "msa/model_kv_cache.h"
#include "openai_format.h"
#include "serve_setup.h"

namespace msa::serve {
namespace {

constexpr const char* kUsage =
    "usage: msa bench-serve (--model DIR [serve flags: --device, --tp, --cache-tokens, --max-batch, ...] |\n"
    "                        --url http://HOST:PORT [--api-key KEY])\n"
    "                       [--concurrency 1,8,32] [--prompt-tokens 1024,32768] [--output-tokens 256]\n"
    "                       [--requests N] [--cell-seconds S] [--bandwidth-gbs B] [--json FILE]\n"
    "                       [--label TEXT]\n"
    "  per (prompt length, concurrency c): c clients send streaming greedy /v1/completions\n"
    "  requests (--requests per cell, default 2c, at least 4; no new request after\n"
    "  --cell-seconds, default 300); prints tokens/s, TTFT and TPOT p50/p99, the server\n"
    "  overhead over the engine's decode step and the decode step's bandwidth floor\n"
    "  (--bandwidth-gbs: default this CPU's measured read bandwidth, or 4534 GB/s on cuda,\n"
    "  the H200's streaming read of bench/results/h200.md)\n";

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

struct Sample {
  double ttft = -1, tpot = -1, e2e = 0;
  int64_t tokens = 0;
  bool ok = false;
  std::string error;
};

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  const double rank = p * static_cast<double>(v.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(rank)), hi = static_cast<size_t>(std::ceil(rank));
  return v[lo] + (v[hi] - v[lo]) * (rank - static_cast<double>(lo));
}

struct Target {
  std::string host;
  int port = 0;
  std::string api_key;
};

// One streaming request; the first SSE chunk with text (or any chunk) starts the token clock.
Sample run_request(const Target& target, const std::vector<int32_t>& prompt, int64_t output_tokens) {
  Sample s;
  httplib::Client client(target.host, target.port);
  client.set_read_timeout(600, 0);
  client.set_write_timeout(60, 0);
  client.set_connection_timeout(10, 0);
  OrderedJson body = {{"prompt", prompt},      {"max_tokens", output_tokens}, {"temperature", 0},
                      {"ignore_eos", true},    {"stream", true},
                      {"stream_options", {{"include_usage", true}}}};
  httplib::Headers headers;
  if (!target.api_key.empty()) headers.emplace("Authorization", "Bearer " + target.api_key);
  const Clock::time_point start = Clock::now();
  Clock::time_point first{}, last{};
  bool seen_first = false;
  std::string buffer;
  int64_t usage_tokens = -1;
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.headers = headers;
  req.body = dump(body);
  req.set_header("Content-Type", "application/json");
  req.content_receiver = [&](const char* data, size_t size, uint64_t, uint64_t) {
    buffer.append(data, size);
    size_t end;
    while ((end = buffer.find("\n\n")) != std::string::npos) {
      const std::string event = buffer.substr(0, end);
      buffer.erase(0, end + 2);
      if (event.rfind("data: ", 0) != 0 || event == "data: [DONE]") continue;
      try {
        const OrderedJson chunk = OrderedJson::parse(event.substr(6));
        if (chunk.contains("usage") && chunk["usage"].is_object()) usage_tokens = chunk["usage"].value("completion_tokens", -1);
        if (chunk.contains("choices") && chunk["choices"].is_array() && !chunk["choices"].empty()) {
          const Clock::time_point now = Clock::now();
          if (!seen_first) first = now, seen_first = true;
          last = now;
        }
        if (chunk.contains("error")) s.error = chunk["error"].value("message", "error");
      } catch (const std::exception& e) {
        s.error = std::string("bad chunk: ") + e.what();
      }
    }
    return true;
  };
  httplib::Response res;
  httplib::Error error = httplib::Error::Success;
  const bool sent = client.send(req, res, error);
  s.e2e = seconds_since(start);
  if (!sent) {
    s.error = "connection failed: " + httplib::to_string(error);
    return s;
  }
  if (res.status != 200) {
    s.error = "HTTP " + std::to_string(res.status) + " " + res.body;
    return s;
  }
  s.tokens = usage_tokens;
  s.ok = s.error.empty() && seen_first && usage_tokens > 0;
  if (s.ok) {
    s.ttft = std::chrono::duration<double>(first - start).count();
    if (usage_tokens > 1) s.tpot = std::chrono::duration<double>(last - first).count() / static_cast<double>(usage_tokens - 1);
  }
  return s;
}

// (sum, count) of the engine's decode steps, read from /metrics.
std::pair<double, double> decode_steps(const Target& target) {
  httplib::Client client(target.host, target.port);
  httplib::Headers headers;
  if (!target.api_key.empty()) headers.emplace("Authorization", "Bearer " + target.api_key);
  const auto res = client.Get("/metrics", headers);
  if (!res || res->status != 200) return {NAN, NAN};
  double sum = NAN, count = NAN;
  std::istringstream lines(res->body);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.rfind("msa_engine_step_seconds_sum{kind=\"decode\"} ", 0) == 0) sum = std::stod(line.substr(line.find("} ") + 2));
    if (line.rfind("msa_engine_step_seconds_count{kind=\"decode\"} ", 0) == 0) count = std::stod(line.substr(line.find("} ") + 2));
  }
  return {sum, count};
}

// Bytes one decode step must read at concurrency c and context L: every weight it multiplies
// (routed experts: the expected number of distinct experts c tokens pick, E (1 - (1 - k/E)^c))
// and each request's K/V (dense layers: all L keys; MSA layers: the index keys of all L and
// K/V of the k*B selected keys).
// Cache bytes per token as the KvCache of `cache` stores them.
double decode_step_bytes(const ModelConfig& c, int64_t batch, double context, double weight_bytes, DType cache) {
  const double H = static_cast<double>(c.hidden_size), D = static_cast<double>(c.head_dim);
  double weights = 2.0 * static_cast<double>(c.vocab_size) * H * 0;  // embedding rows: negligible
  weights += static_cast<double>(c.vocab_size) * H;                  // lm head
  const double kv_row = static_cast<double>(KvCache::kv_bytes_per_token(c, cache));
  const double index_row = static_cast<double>(KvCache::index_key_bytes_per_token(c, cache));
  double kv = 0;
  const double E = static_cast<double>(c.num_experts), k = static_cast<double>(c.experts_per_token);
  const double touched = E > 0 ? E * (1 - std::pow(1 - k / E, static_cast<double>(batch))) : 0;
  for (int64_t l = 0; l < c.num_layers; ++l) {
    weights += H * static_cast<double>(c.num_heads + 2 * c.num_kv_heads) * D + static_cast<double>(c.num_heads) * D * H;
    if (c.sparse_layers[l]) {
      weights += H * static_cast<double>(c.index_heads + 1) * static_cast<double>(c.index_head_dim);
      kv += context * index_row +
            std::min(context, static_cast<double>(c.topk_blocks) * c.block_size) * kv_row;
    } else {
      kv += context * kv_row;
    }
    if (c.moe_layers[l]) {
      weights += touched * 3 * H * static_cast<double>(c.moe_intermediate_size) +
                 3 * H * static_cast<double>(c.shared_intermediate_size) + E * H * 2;  // router in f32
    } else {
      weights += 3 * H * static_cast<double>(c.dense_intermediate_size);
    }
  }
  return weights * weight_bytes + static_cast<double>(batch) * kv;
}

std::string fmt(double v, const char* format = "%.1f") {
  if (!std::isfinite(v)) return "-";
  char text[64];
  std::snprintf(text, sizeof text, format, v);
  return text;
}

std::string git_commit() {
  std::string out;
  if (FILE* pipe = popen("git rev-parse --short HEAD 2>/dev/null", "r")) {
    char line[64];
    if (std::fgets(line, sizeof line, pipe)) out = line;
    pclose(pipe);
  }
  while (!out.empty() && (out.back() == '\n' || out.back() == '\r')) out.pop_back();
  return out.empty() ? "unknown" : out;
}

int bench(int argc, char** argv) {
  cli::Args args(argc, argv, {"help", "no-prefix-cache"});
  if (args.has("help")) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  signal(SIGPIPE, SIG_IGN);
  const std::vector<int64_t> concurrency = args.get_positive_list("concurrency", "1,8,32", 4096);
  const std::vector<int64_t> prompt_lengths = args.get_positive_list("prompt-tokens", "1024,32768", int64_t{1} << 24);
  const int64_t output_tokens = args.get_int64("output-tokens", 256, 2, int64_t{1} << 20);
  const int64_t requests_flag = args.get_int64("requests", 0, 0, 1 << 20);
  const double cell_seconds = args.get_double("cell-seconds", 300, 0, 1e6, true);
  const std::string json_path = args.get_string("json", "");
  const std::string label = args.get_string("label", "");
  const std::string url = args.get_string("url", "");

  Target target;
  std::unique_ptr<ServeSetup> setup;
  LoadedModel loaded;
  std::unique_ptr<Metrics> metrics;
  std::unique_ptr<Scheduler> scheduler;
  std::unique_ptr<HttpFront> front;
  std::thread server_thread;
  int64_t vocab = 0;
  double bandwidth = NAN;
  if (!url.empty()) {
    const std::string prefix = "http://";
    if (url.rfind(prefix, 0) != 0) throw cli::UsageError("--url: expected http://HOST:PORT, got \"" + url + "\"");
    const std::string rest = url.substr(prefix.size());
    const size_t colon = rest.rfind(':');
    if (colon == std::string::npos) throw cli::UsageError("--url: expected http://HOST:PORT, got \"" + url + "\"");
    target.host = rest.substr(0, colon);
    target.port = std::atoi(rest.substr(colon + 1).c_str());
    target.api_key = args.get_string("api-key", "");
    vocab = args.get_int64("vocab-size", 256, 2, int64_t{1} << 31);
    bandwidth = args.get_double("bandwidth-gbs", NAN, 0, 1e9, true);
    args.finish();
  } else {
    setup = std::make_unique<ServeSetup>(read_serve_flags(args));
    const double default_bandwidth = setup->device == Device::cuda ? 4534.0 : -1;
    bandwidth = args.get_double("bandwidth-gbs", default_bandwidth, -1, 1e9);
    args.finish();
    if (bandwidth < 0) bandwidth = cli::measure_machine_peak().read_gb_per_s;
    loaded = load_for_serving(*setup);
    vocab = loaded.model->config().vocab_size;
    metrics = std::make_unique<Metrics>();
    scheduler = std::make_unique<Scheduler>(*loaded.model, loaded.tokenizer_ptr(), setup->scheduler, *metrics,
                                            loaded.kept_special);
    ServerOptions options;
    options.host = "127.0.0.1";
    options.port = 0;
    options.model_name = setup->default_model_name();
    options.threads = static_cast<int>(setup->scheduler.max_queue + setup->max_batch() + 32);
    front = std::make_unique<HttpFront>(*scheduler, loaded.tokenizer_ptr(), loaded.model->config(), *metrics, options);
    target.host = "127.0.0.1";
    target.port = front->bind();
    server_thread = std::thread([&] { front->run(); });
  }

  struct Row {
    int64_t prompt = 0, concurrency = 0, requests = 0, failed = 0;
    double wall = 0, tokens_per_s = NAN, decode_tokens_per_s = NAN, ttft50 = NAN, ttft99 = NAN, tpot50 = NAN,
           tpot99 = NAN, step_ms = NAN, floor_tokens_per_s = NAN;
    std::string error;
  };
  std::vector<Row> rows;
  std::mt19937_64 rng(12345);
  int64_t prompt_serial = 0;
  for (int64_t length : prompt_lengths) {
    for (int64_t c : concurrency) {
      Row row;
      row.prompt = length;
      row.concurrency = c;
      const int64_t total = requests_flag > 0 ? requests_flag : std::max<int64_t>(2 * c, 4);
      // Distinct prompts (a serial number in the first tokens): no prefix-cache hits.
      std::vector<std::vector<int32_t>> prompts(static_cast<size_t>(total));
      for (auto& p : prompts) {
        p.resize(static_cast<size_t>(length));
        const int64_t serial = prompt_serial++;
        for (int64_t i = 0; i < length; ++i)
          p[static_cast<size_t>(i)] = static_cast<int32_t>(3 + (i < 4 ? (serial >> (8 * i)) & 255 : rng() % static_cast<uint64_t>(vocab - 3)));
      }
      const auto [sum0, count0] = decode_steps(target);
      std::vector<Sample> samples;
      std::mutex lock;
      int64_t next = 0;
      const Clock::time_point start = Clock::now();
      std::vector<std::thread> clients;
      for (int64_t t = 0; t < c; ++t)
        clients.emplace_back([&] {
          for (;;) {
            int64_t i;
            {
              std::lock_guard guard(lock);
              if (next >= total || seconds_since(start) > cell_seconds) return;
              i = next++;
            }
            Sample s = run_request(target, prompts[static_cast<size_t>(i)], output_tokens);
            std::lock_guard guard(lock);
            samples.push_back(std::move(s));
          }
        });
      for (std::thread& t : clients) t.join();
      row.wall = seconds_since(start);
      const auto [sum1, count1] = decode_steps(target);
      std::vector<double> ttft, tpot;
      int64_t tokens = 0;
      for (const Sample& s : samples) {
        if (!s.ok) {
          ++row.failed;
          if (row.error.empty()) row.error = s.error;
          continue;
        }
        tokens += s.tokens;
        ttft.push_back(s.ttft);
        if (s.tpot >= 0) tpot.push_back(s.tpot);
      }
      row.requests = static_cast<int64_t>(samples.size());
      row.tokens_per_s = static_cast<double>(tokens) / row.wall;
      double mean_tpot = 0;
      for (double v : tpot) mean_tpot += v / static_cast<double>(tpot.size());
      row.decode_tokens_per_s = tpot.empty() ? NAN : static_cast<double>(std::min<int64_t>(c, row.requests)) / mean_tpot;
      row.ttft50 = percentile(ttft, 0.5);
      row.ttft99 = percentile(ttft, 0.99);
      row.tpot50 = percentile(tpot, 0.5);
      row.tpot99 = percentile(tpot, 0.99);
      if (count1 > count0) row.step_ms = 1e3 * (sum1 - sum0) / (count1 - count0);
      if (loaded.model && std::isfinite(bandwidth)) {
        const ModelConfig& config = loaded.model->config();
        const double weight_bytes = setup->device == Device::cuda ? 2.0 : (config.dtype == "float32" ? 4.0 : 2.0);
        const double bytes = decode_step_bytes(config, c, static_cast<double>(length) + static_cast<double>(output_tokens) / 2,
                                               weight_bytes, setup->scheduler.engine.cache_dtype);
        row.floor_tokens_per_s = static_cast<double>(c) / (bytes / (bandwidth * 1e9));
      }
      std::fprintf(stderr, "bench-serve: prompt %lld, concurrency %lld: %lld requests (%lld failed) in %.1f s\n",
                   static_cast<long long>(length), static_cast<long long>(c), static_cast<long long>(row.requests),
                   static_cast<long long>(row.failed), row.wall);
      if (!row.error.empty()) std::fprintf(stderr, "bench-serve: first error: %s\n", row.error.c_str());
      rows.push_back(row);
    }
  }

  // The table (markdown) on stdout.
  double tpot_c1_ms = NAN, step_c1_ms = NAN;
  std::printf("| prompt | concurrency | requests | output tok/s | decode tok/s | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) "
              "| engine decode step (ms) | overhead | floor tok/s | vs floor |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const Row& r : rows) {
    const double overhead = r.tpot50 * 1e3 / r.step_ms - 1;
    if (r.concurrency == 1) tpot_c1_ms = r.tpot50 * 1e3, step_c1_ms = r.step_ms;
    std::printf("| %lld | %lld | %lld%s | %s | %s | %s / %s | %s / %s | %s | %s | %s | %s |\n",
                static_cast<long long>(r.prompt), static_cast<long long>(r.concurrency),
                static_cast<long long>(r.requests), r.failed ? (" (" + std::to_string(r.failed) + " failed)").c_str() : "",
                fmt(r.tokens_per_s).c_str(), fmt(r.decode_tokens_per_s).c_str(), fmt(r.ttft50 * 1e3).c_str(),
                fmt(r.ttft99 * 1e3).c_str(), fmt(r.tpot50 * 1e3, "%.2f").c_str(), fmt(r.tpot99 * 1e3, "%.2f").c_str(),
                fmt(r.step_ms, "%.2f").c_str(),
                r.concurrency == 1 ? (fmt(overhead * 100, "%+.1f") + "%").c_str() : "",
                fmt(r.floor_tokens_per_s).c_str(), fmt(r.decode_tokens_per_s / r.floor_tokens_per_s, "%.2fx").c_str());
  }
  (void)tpot_c1_ms;
  (void)step_c1_ms;
  std::printf("\nbandwidth %s GB/s (%s); %s\n", fmt(bandwidth).c_str(),
              setup && setup->device == Device::cuda ? "H200 streaming read, bench/results/h200.md" : "measured read",
              label.c_str());

  if (!json_path.empty()) {
    std::ofstream out(json_path, std::ios::app);
    char date[16];
    const std::time_t now = std::time(nullptr);
    std::strftime(date, sizeof date, "%Y-%m-%d", std::gmtime(&now));
    const std::string commit = git_commit();
    for (const Row& r : rows) {
      OrderedJson j = {{"device", setup ? setup->device_name() : "remote"},
                       {"phase", "serve"},
                       {"model", setup ? setup->default_model_name() : url},
                       {"threads", num_threads()},
                       {"prompt_tokens", r.prompt},
                       {"output_tokens", output_tokens},
                       {"concurrency", r.concurrency},
                       {"requests", r.requests},
                       {"failed", r.failed},
                       {"wall_s", r.wall},
                       {"output_tokens_per_s", r.tokens_per_s},
                       {"decode_tokens_per_s", r.decode_tokens_per_s},
                       {"ttft_p50_ms", r.ttft50 * 1e3},
                       {"ttft_p99_ms", r.ttft99 * 1e3},
                       {"tpot_p50_ms", r.tpot50 * 1e3},
                       {"tpot_p99_ms", r.tpot99 * 1e3},
                       {"engine_decode_step_ms", r.step_ms},
                       {"floor_tokens_per_s", r.floor_tokens_per_s},
                       {"read_gb_per_s", bandwidth},
                       {"label", label},
                       {"date", date},
                       {"commit", commit}};
      for (auto& [key, value] : j.items())
        if (value.is_number_float() && !std::isfinite(value.get<double>())) value = nullptr;
      out << dump(j) << "\n";
    }
  }

  if (front) {
    front->stop();
    server_thread.join();
    scheduler->shutdown();
  }
  int failed = 0;
  for (const Row& r : rows) failed += r.failed > 0;
  return failed ? 1 : 0;
}

}  // namespace
}  // namespace msa::serve

int run_bench_serve_command(int argc, char** argv) {
  return msa::cli::run_reporting_errors("bench-serve", msa::serve::kUsage,
                                        [&] { return msa::serve::bench(argc, argv); });
}
