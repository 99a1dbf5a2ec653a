// Prometheus text rendering of the server's counters, gauges and histograms (metrics.h).
#include "metrics.h"

#include <cstdint>
#include <algorithm>
#include <cstdio>

namespace msa::serve {
namespace {

std::string number(double value) {
  char text[48];
  std::snprintf(text, sizeof text, "%.9g", value);
  return text;
}

void header(std::string& out, const std::string& name, const char* type, const char* help) {
  out += "# HELP " + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
}

// Buckets from 1 ms to 100 s: CPU steps of a small model take ms, a 32K prefill seconds.
std::vector<double> time_buckets() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100};
}

}  // namespace

Histogram::Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::observe(double value) {
  const size_t bucket = std::lower_bound(bounds_.begin(), bounds_.end(), value) - bounds_.begin();
  ++counts_[bucket];
  sum_ += value;
  ++count_;
}

void Histogram::render(std::string& out, const std::string& name, const std::string& labels) const {
  const std::string sep = labels.empty() ? "" : ",";
  uint64_t cumulative = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cumulative += counts_[i];
    out += name + "_bucket{" + labels + sep + "le=\"" + number(bounds_[i]) + "\"} " + std::to_string(cumulative) + "\n";
  }
  out += name + "_bucket{" + labels + sep + "le=\"+Inf\"} " + std::to_string(count_) + "\n";
  const std::string braces = labels.empty() ? "" : "{" + labels + "}";
  out += name + "_sum" + braces + " " + number(sum_) + "\n";
  out += name + "_count" + braces + " " + std::to_string(count_) + "\n";
}

Metrics::Metrics()
    : ttft_(time_buckets()), tpot_(time_buckets()), latency_(time_buckets()), decode_step_(time_buckets()),
      mixed_step_(time_buckets()) {}

void Metrics::request_received() {
  std::lock_guard lock(mutex_);
  ++received_;
}

void Metrics::request_rejected(const std::string& reason) {
  std::lock_guard lock(mutex_);
  ++rejected_[reason];
}

void Metrics::request_finished(const RequestOutcome& o) {
  std::lock_guard lock(mutex_);
  ++finished_[o.reason];
  prompt_tokens_ += static_cast<uint64_t>(o.prompt_tokens);
  completion_tokens_ += static_cast<uint64_t>(o.completion_tokens);
  cached_tokens_ += static_cast<uint64_t>(o.cached_tokens);
  if (o.ttft >= 0) ttft_.observe(o.ttft);
  if (o.tpot >= 0) tpot_.observe(o.tpot);
  if (o.latency >= 0) latency_.observe(o.latency);
}

void Metrics::engine_step(double seconds, bool decode_only) {
  std::lock_guard lock(mutex_);
  (decode_only ? decode_step_ : mixed_step_).observe(seconds);
}

void Metrics::set_state(int64_t queued, int64_t running, const CachePages& pages) {
  std::lock_guard lock(mutex_);
  queued_ = queued;
  running_ = running;
  pages_ = pages;
}

Metrics::StepTimes Metrics::step_times() const {
  std::lock_guard lock(mutex_);
  return {decode_step_.sum(), decode_step_.count()};
}

std::string Metrics::render() const {
  std::lock_guard lock(mutex_);
  std::string out;
  header(out, "msa_requests_received_total", "counter", "Generation requests that reached the server.");
  out += "msa_requests_received_total " + std::to_string(received_) + "\n";
  header(out, "msa_requests_rejected_total", "counter", "Requests refused before they ran, by reason.");
  for (const char* reason : {"invalid", "queue_full", "unauthorized", "too_large"})
    out += std::string("msa_requests_rejected_total{reason=\"") + reason + "\"} " +
           std::to_string(rejected_.count(reason) ? rejected_.at(reason) : 0) + "\n";
  header(out, "msa_requests_finished_total", "counter", "Requests that ran, by how they ended.");
  for (const char* reason : {"stop", "length", "tool_calls", "cancelled", "error"})
    out += std::string("msa_requests_finished_total{reason=\"") + reason + "\"} " +
           std::to_string(finished_.count(reason) ? finished_.at(reason) : 0) + "\n";
  header(out, "msa_prompt_tokens_total", "counter", "Prompt tokens of finished requests.");
  out += "msa_prompt_tokens_total " + std::to_string(prompt_tokens_) + "\n";
  header(out, "msa_prompt_tokens_cached_total", "counter", "Prompt tokens taken from the prefix cache.");
  out += "msa_prompt_tokens_cached_total " + std::to_string(cached_tokens_) + "\n";
  header(out, "msa_generation_tokens_total", "counter", "Generated tokens of finished requests.");
  out += "msa_generation_tokens_total " + std::to_string(completion_tokens_) + "\n";
  header(out, "msa_queue_depth", "gauge", "Requests accepted and waiting to run (for cache room or a batch slot).");
  out += "msa_queue_depth " + std::to_string(queued_) + "\n";
  header(out, "msa_running_requests", "gauge", "Requests in the running batch.");
  out += "msa_running_requests " + std::to_string(running_) + "\n";
  header(out, "msa_kv_cache_pages", "gauge",
         "KV-cache pages: used (held by requests), cached (prefix cache, held by none), free.");
  out += "msa_kv_cache_pages{state=\"used\"} " + std::to_string(pages_.used) + "\n";
  out += "msa_kv_cache_pages{state=\"cached\"} " + std::to_string(pages_.cached) + "\n";
  out += "msa_kv_cache_pages{state=\"free\"} " + std::to_string(pages_.free) + "\n";
  header(out, "msa_kv_cache_pages_total", "gauge", "KV-cache pages in all.");
  out += "msa_kv_cache_pages_total " + std::to_string(pages_.total) + "\n";
  header(out, "msa_kv_cache_usage_ratio", "gauge", "Fraction of the KV-cache pages held by requests.");
  out += "msa_kv_cache_usage_ratio " +
         number(pages_.total ? static_cast<double>(pages_.used) / static_cast<double>(pages_.total) : 0) + "\n";
  header(out, "msa_time_to_first_token_seconds", "histogram", "From arrival at the scheduler to the first token.");
  ttft_.render(out, "msa_time_to_first_token_seconds");
  header(out, "msa_time_per_output_token_seconds", "histogram",
         "Per request: (last token - first token) / (tokens - 1).");
  tpot_.render(out, "msa_time_per_output_token_seconds");
  header(out, "msa_request_latency_seconds", "histogram", "From arrival at the scheduler to the last token.");
  latency_.render(out, "msa_request_latency_seconds");
  header(out, "msa_engine_step_seconds", "histogram",
         "One engine step (forward and sampling): decode-only steps, and steps with prompt tokens.");
  decode_step_.render(out, "msa_engine_step_seconds", "kind=\"decode\"");
  mixed_step_.render(out, "msa_engine_step_seconds", "kind=\"prefill\"");
  return out;
}

}  // namespace msa::serve
