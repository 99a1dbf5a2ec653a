// The batching loop of `msa serve`: one thread owns the msa::Engine and runs its steps;
// HTTP threads hand it requests through a bounded queue and read each request's text from
// its Job as it appears.
//
// Continuous batching: between two steps the loop takes new requests (the engine admits
// them when the KV cache has room for prompt + max_tokens, and up to --max-batch at once)
// and cancellations (a client that went away, a matched stop string): a request joins or
// leaves the running batch at any step, and a cancelled request's pages go back to the
// cache before the next step. The engine mixes prefill chunks and decode tokens in a step.
//
// The queue bound: requests accepted but not yet running (waiting here or in the engine)
// may not exceed --max-queue; beyond that submit() throws a 503 with a retry hint, so a
// burst is refused at once instead of waiting without bound.
//
// On CUDA the loop runs the engine's normal CUDA step: a captured CUDA graph of the decode
// part does not exist yet (it belongs to the later decode issue).
#pragma once
#include <cstdint>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "metrics.h"
#include "msa/model.h"
#include "msa/model_engine.h"
#include "text_stream.h"

namespace msa::serve {

class Scheduler;

// One request as the HTTP side sees it. wait() returns the text produced since the last
// call; finished says it ended (finish_reason: stop, length, error, cancelled).
class Job {
 public:
  struct Update {
    std::string text;
    bool finished = false;
    std::string finish_reason, error;
    int64_t prompt_tokens = 0, completion_tokens = 0, cached_tokens = 0;
  };
  Update wait(std::chrono::milliseconds timeout);
  int64_t prompt_tokens() const { return prompt_tokens_; }

 private:
  friend class Scheduler;
  Job(GenerationRequest request, TextStream stream);
  void publish(const std::string& text, const std::string& finish_reason, const std::string& error);

  GenerationRequest request_;
  TextStream stream_;              // the loop thread's
  int64_t prompt_tokens_ = 0;
  int64_t engine_id_ = -1;         // the loop thread's
  bool done_ = false;              // the loop thread's
  std::chrono::steady_clock::time_point arrived_, first_token_, last_token_;

  std::mutex mutex_;
  std::condition_variable changed_;
  std::string text_;
  bool finished_ = false;
  std::string finish_reason_, error_;
  int64_t completion_tokens_ = 0, cached_tokens_ = 0;
  std::atomic<bool> cancel_requested_{false};
};

struct SchedulerOptions {
  EngineOptions engine;
  int64_t max_queue = 256;
};

class Scheduler {
 public:
  // tokenizer may be null (no text output). kept_special: special tokens whose text the
  // output keeps (reasoning and tool-call markers).
  // `model` (a single model or a tensor-parallel group) must outlive the scheduler.
  Scheduler(EngineModel& model, const Tokenizer* tokenizer, SchedulerOptions options, Metrics& metrics,
            std::set<int32_t> kept_special);
  ~Scheduler();  // stops the loop; requests still open end with an error

  // Queues a request (prompt + max_tokens must fit the cache: capacity_tokens()).
  // Throws ApiError 503 (code queue_full) when the queue is full.
  std::shared_ptr<Job> submit(GenerationRequest request, std::vector<std::string> stop);
  // Ends the request at the next step boundary (its pages are freed there).
  void cancel(const std::shared_ptr<Job>& job);
  void shutdown();

  int64_t capacity_tokens() const { return capacity_tokens_; }
  int64_t max_queue() const { return options_.max_queue; }

 private:
  void loop();
  void finish(Job& job, const std::string& reason, const std::string& error = "");
  void on_token(Job& job, const TokenEvent& event);
  void publish_state();

  const Tokenizer* tokenizer_;
  SchedulerOptions options_;
  Metrics& metrics_;
  std::set<int32_t> kept_special_;
  Engine engine_;  // the loop thread's only
  int64_t capacity_tokens_;

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::shared_ptr<Job>> incoming_;
  std::vector<std::shared_ptr<Job>> cancels_;
  bool stopping_ = false;
  std::atomic<int64_t> engine_waiting_{0};
  std::unordered_map<int64_t, std::shared_ptr<Job>> active_;  // engine id -> job (loop thread)
  std::thread thread_;
};

}  // namespace msa::serve
