// The serving engine over a tensor- / expert-parallel model: N in-process ranks (threads, one
// msa::ParallelModel and one KV cache each) that msa::Engine steps as one model
// (docs/parallel.md "Serving").
//
//   msa::LocalParallelGroup group(dir, 4);          // loads 4 ranks' parts, on 4 threads
//   msa::Engine engine(group, {.cache_tokens = 8192});
//   engine.submit({.prompt = {1, 2, 3}, .max_tokens = 32});
//   while (!engine.idle()) engine.step();          // every step runs on all 4 ranks
//
// Rank 0 is the engine's side: its cache is the one the engine allocates from. Each step the
// engine's thread writes the step's description (request ids, their new tokens, which want
// every row's logits, each request's length and the pages it gained since its last step, the
// requests that left since the last step, in order) and wakes every rank; each rank brings
// its copies of the requests' page tables up to date (so every rank holds the same page ids
// for the same request, prefix-cache sharing included), checks them against the description
// and calls ParallelModel::forward; the collectives run between the ranks; rank 0's logits go
// back to the engine once every rank has finished the step.
//
// A rank that throws (or fails a check) fails the step: the others' collectives throw
// (run_on_ranks), every rank thread ends, and forward() throws msa::Error naming the rank.
// The group then stays failed: every later forward() throws that error again (the ranks'
// caches are gone; load a new group).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "msa/model_engine.h"

namespace msa {
namespace parallel {
struct GroupState;  // src/parallel/parallel_group.cpp
}

struct LocalParallelGroupOptions {
  int threads_per_rank = 0;  // each rank's OpenMP team (0: the process default)
  // For tests: runs on every rank's thread before its forward of each step (`step` counts
  // from 0); an exception from it fails the step as a failing rank would.
  std::function<void(int rank, int64_t step)> before_rank_forward = nullptr;
};

class LocalParallelGroup final : public EngineModel {
 public:
  // Loads `dir` (config.json + safetensors) on `world_size` rank threads, each its part. A
  // world size the model cannot be split over is an msa::Error naming the config field,
  // thrown before any thread starts; a rank that fails to load is one naming the rank.
  LocalParallelGroup(const std::string& dir, int world_size, LocalParallelGroupOptions options = {});
  ~LocalParallelGroup() override;  // stops the rank threads
  LocalParallelGroup(const LocalParallelGroup&) = delete;
  LocalParallelGroup& operator=(const LocalParallelGroup&) = delete;

  int world_size() const;
  const ModelConfig& config() const override;
  const ModelConfig& rank_config(int rank) const;  // the heads and columns rank `rank` computes

  // Rank 0's cache (returned) and every other rank's (kept on its thread), `num_pages` each.
  // One engine at a time: a new cache replaces the other ranks' caches and request copies.
  KvCache make_cache(int64_t num_pages, DType dtype) override;
  bool accepts_visual() const override { return false; }  // ParallelModel runs text only
  // One step on every rank. Every request's pages must already hold its new tokens (the
  // engine reserves a request's whole generation at admission): a rank that allocated
  // pages of its own would hold other page ids than rank 0.
  Tensor forward(std::span<const ForwardRequest> requests, std::span<const int64_t> ids,
                 KvCache& cache) override;
  void release(int64_t id) noexcept override;

  // How many requests each rank other than 0 holds a page table for (tests: requests that
  // left are forgotten after the next step).
  std::vector<int64_t> mirrored_requests() const;

 private:
  // Posts shared_->command to every rank and waits for all; `what` names it in the error.
  void run_command(const char* what);
  std::unique_ptr<parallel::GroupState> shared_;
};

}  // namespace msa
