// The server's numbers for `GET /metrics`, in Prometheus' text format (version 0.0.4):
// request counts by outcome, token counts, queue depth, running requests, KV-cache pages
// (used by requests, kept by the prefix cache, free), and histograms of the time to first
// token, the time per output token, the request latency and the engine's step time (the
// denominator of the server-overhead figure of `msa bench-serve`). Thread-safe: the HTTP
// threads and the scheduler's loop update it.
#pragma once
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "msa/model_engine.h"

namespace msa::serve {

class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void observe(double value);
  void render(std::string& out, const std::string& name, const std::string& labels = "") const;
  double sum() const { return sum_; }
  uint64_t count() const { return count_; }

 private:
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // per bucket, not cumulative
  double sum_ = 0;
  uint64_t count_ = 0;
};

struct RequestOutcome {
  std::string reason;  // stop, length, tool_calls, cancelled, error
  int64_t prompt_tokens = 0, completion_tokens = 0, cached_tokens = 0;
  double ttft = -1, tpot = -1, latency = -1;  // seconds; < 0: not measured
};

class Metrics {
 public:
  Metrics();
  void request_received();
  void request_rejected(const std::string& reason);  // queue_full, invalid, unauthorized, ...
  void request_finished(const RequestOutcome& outcome);
  void engine_step(double seconds, bool decode_only);
  void set_state(int64_t queued, int64_t running, const CachePages& pages);
  std::string render() const;

  struct StepTimes {
    double decode_seconds = 0;
    uint64_t decode_steps = 0;
  };
  StepTimes step_times() const;

 private:
  mutable std::mutex mutex_;
  uint64_t received_ = 0;
  std::map<std::string, uint64_t> rejected_, finished_;
  uint64_t prompt_tokens_ = 0, completion_tokens_ = 0, cached_tokens_ = 0;
  int64_t queued_ = 0, running_ = 0;
  CachePages pages_;
  Histogram ttft_, tpot_, latency_, decode_step_, mixed_step_;
};

}  // namespace msa::serve
