// The batching loop (scheduler.h): takes new requests and cancellations between steps, runs
// one engine step, turns its tokens into text per request.
#include "scheduler.h"

#include <cstdint>
#include <cstdio>

#include "api_error.h"

namespace msa::serve {

using Clock = std::chrono::steady_clock;

Job::Job(GenerationRequest request, TextStream stream)
    : request_(std::move(request)), stream_(std::move(stream)),
      prompt_tokens_(static_cast<int64_t>(request_.prompt.size())), arrived_(Clock::now()) {}

Job::Update Job::wait(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mutex_);
  changed_.wait_for(lock, timeout, [&] { return finished_ || !text_.empty(); });
  Update update;
  update.text.swap(text_);
  update.finished = finished_;
  update.finish_reason = finish_reason_;
  update.error = error_;
  update.prompt_tokens = prompt_tokens_;
  update.completion_tokens = completion_tokens_;
  update.cached_tokens = cached_tokens_;
  return update;
}

void Job::publish(const std::string& text, const std::string& finish_reason, const std::string& error) {
  {
    std::lock_guard lock(mutex_);
    text_ += text;
    if (!finish_reason.empty()) {
      finished_ = true;
      finish_reason_ = finish_reason;
      error_ = error;
    }
  }
  changed_.notify_all();
}

Scheduler::Scheduler(EngineModel& model, const Tokenizer* tokenizer, SchedulerOptions options,
                     Metrics& metrics, std::set<int32_t> kept_special)
    : tokenizer_(tokenizer), options_(options), metrics_(metrics),
      kept_special_(std::move(kept_special)), engine_(model, options.engine),
      capacity_tokens_(engine_.capacity_tokens()) {
  publish_state();
  thread_ = std::thread([this] { loop(); });
}

Scheduler::~Scheduler() { shutdown(); }

void Scheduler::shutdown() {
  {
    std::lock_guard lock(mutex_);
    if (stopping_ && !thread_.joinable()) return;
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

std::shared_ptr<Job> Scheduler::submit(GenerationRequest request, std::vector<std::string> stop) {
  std::shared_ptr<Job> job(new Job(std::move(request), TextStream(tokenizer_, std::move(stop), kept_special_)));
  {
    std::lock_guard lock(mutex_);
    if (stopping_) throw ApiError(503, "the server is shutting down", "", "server_error", "shutting_down");
    const int64_t queued = static_cast<int64_t>(incoming_.size()) + engine_waiting_.load();
    if (queued >= options_.max_queue) {
      metrics_.request_rejected("queue_full");
      throw ApiError(503,
                     "the request queue is full (" + std::to_string(queued) + " requests wait, --max-queue " +
                         std::to_string(options_.max_queue) + "); retry after a second",
                     "", "server_error", "queue_full");
    }
    incoming_.push_back(job);
  }
  metrics_.request_received();
  wake_.notify_all();
  return job;
}

void Scheduler::cancel(const std::shared_ptr<Job>& job) {
  if (job->cancel_requested_.exchange(true)) return;
  {
    std::lock_guard lock(mutex_);
    cancels_.push_back(job);
  }
  wake_.notify_all();
}

void Scheduler::finish(Job& job, const std::string& reason, const std::string& error) {
  if (job.done_) return;
  job.done_ = true;
  if (job.engine_id_ >= 0) active_.erase(job.engine_id_);
  RequestOutcome outcome;
  outcome.reason = reason;
  outcome.prompt_tokens = job.prompt_tokens_;
  int64_t tokens = 0;
  {
    std::lock_guard lock(job.mutex_);
    tokens = job.completion_tokens_;
    outcome.cached_tokens = job.cached_tokens_;
  }
  outcome.completion_tokens = tokens;
  const auto seconds = [](Clock::duration d) { return std::chrono::duration<double>(d).count(); };
  if (tokens > 0) {
    outcome.ttft = seconds(job.first_token_ - job.arrived_);
    outcome.latency = seconds(job.last_token_ - job.arrived_);
    if (tokens > 1) outcome.tpot = seconds(job.last_token_ - job.first_token_) / static_cast<double>(tokens - 1);
  }
  metrics_.request_finished(outcome);
  job.publish("", reason, error);
}

void Scheduler::on_token(Job& job, const TokenEvent& event) {
  const Clock::time_point now = Clock::now();
  {
    std::lock_guard lock(job.mutex_);
    if (job.completion_tokens_++ == 0) job.first_token_ = now;
    job.cached_tokens_ = event.cached_tokens;
  }
  job.last_token_ = now;
  // A stop token ends the output without its text (the eos token is special anyway).
  TextStream::Piece piece;
  if (event.finish != FinishReason::stop_token) piece = job.stream_.push(event.token);
  if (piece.stopped) {
    engine_.cancel(event.request);  // a stop string: the engine would go on
    job.publish(piece.text, "", "");
    finish(job, "stop");
    return;
  }
  if (event.finish == FinishReason::none) {
    if (!piece.text.empty()) job.publish(piece.text, "", "");
    return;
  }
  TextStream::Piece rest = job.stream_.finish();
  job.publish(piece.text + rest.text, "", "");
  finish(job, event.finish == FinishReason::stop_token ? "stop" : "length");
}

void Scheduler::publish_state() {
  int64_t incoming = 0;
  {
    std::lock_guard lock(mutex_);
    incoming = static_cast<int64_t>(incoming_.size());
  }
  engine_waiting_ = engine_.waiting();
  metrics_.set_state(incoming + engine_.waiting(), engine_.running(), engine_.pages());
}

void Scheduler::loop() {
  for (;;) {
    std::deque<std::shared_ptr<Job>> incoming;
    std::vector<std::shared_ptr<Job>> cancels;
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] { return stopping_ || !incoming_.empty() || !cancels_.empty() || !engine_.idle(); });
      if (stopping_) break;
      incoming.swap(incoming_);
      cancels.swap(cancels_);
    }
    for (const std::shared_ptr<Job>& job : cancels) {
      if (job->engine_id_ >= 0) engine_.cancel(job->engine_id_);
      finish(*job, "cancelled");
    }
    for (std::shared_ptr<Job>& job : incoming) {
      if (job->cancel_requested_) {
        finish(*job, "cancelled");
        continue;
      }
      try {
        job->engine_id_ = engine_.submit(job->request_);
        active_[job->engine_id_] = job;
      } catch (const std::exception& e) {  // the HTTP side checked the sizes; this is a backstop
        finish(*job, "error", e.what());
      }
    }
    publish_state();
    if (engine_.idle()) continue;

    std::vector<TokenEvent> events;
    try {
      events = engine_.step();
    } catch (const std::exception& e) {
      // A step that fails (non-finite logits, a device error) fails every running request
      // rather than the server; their pages go back.
      std::fprintf(stderr, "msa serve: error: an engine step failed: %s\n", e.what());
      std::vector<std::shared_ptr<Job>> failed;
      for (auto& [id, job] : active_) failed.push_back(job);
      for (const std::shared_ptr<Job>& job : failed) {
        engine_.cancel(job->engine_id_);
        finish(*job, "error", std::string("the engine step failed: ") + e.what());
      }
      publish_state();
      continue;
    }
    const EngineStats& stats = engine_.stats();
    metrics_.engine_step(stats.last_step_seconds, stats.last_step_decode_only);
    for (const TokenEvent& event : events) {
      const auto it = active_.find(event.request);
      if (it == active_.end()) continue;
      std::shared_ptr<Job> job = it->second;  // finish() erases the map entry
      on_token(*job, event);
    }
    publish_state();
  }
  // Shutting down: every open request ends with an error its client sees.
  std::vector<std::shared_ptr<Job>> open;
  for (auto& [id, job] : active_) open.push_back(job);
  {
    std::lock_guard lock(mutex_);
    for (auto& job : incoming_) open.push_back(job);
    for (auto& job : cancels_) open.push_back(job);
    incoming_.clear();
    cancels_.clear();
  }
  for (const std::shared_ptr<Job>& job : open) finish(*job, "error", "the server is shutting down");
}

}  // namespace msa::serve
