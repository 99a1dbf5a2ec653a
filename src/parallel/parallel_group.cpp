// The engine's view of N in-process tensor-parallel ranks (msa/parallel_group.h): the engine's
// thread posts one command at a time (make the caches, run a step) and waits until every rank
// thread has carried it out or the group has failed.
#include "msa/parallel_group.h"

#include <algorithm>
#include <condition_variable>
#include <filesystem>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>

#include "msa/communicator.h"
#include "msa/parallel_model.h"
#include "parallel/rendezvous_communicator.h"

namespace msa {
namespace {

std::string request_text(int64_t id) { return "request " + std::to_string(id); }

// FNV-1a over the page ids: every rank checks its copy of a page table against rank 0's.
uint64_t page_table_hash(std::span<const int32_t> pages) {
  uint64_t hash = 1469598103934665603ull;
  for (int32_t page : pages) {
    hash ^= static_cast<uint32_t>(page);
    hash *= 1099511628211ull;
  }
  return hash;
}

// One request of a step as the other ranks see it.
struct StepSlot {
  int64_t id = 0;
  std::span<const int32_t> tokens = {};  // the engine's: unchanged until the step has finished
  bool all_logits = false;
  int64_t length = 0;              // tokens of the request in the cache before the step
  int64_t pages = 0;               // its page-table size on rank 0
  uint64_t pages_hash = 0;         // page_table_hash of rank 0's table
  std::vector<int32_t> new_pages = {};  // pages rank 0 gave it since its previous step, in order
  bool first = false;              // its first step: the ranks start their copy here
};

struct Command {
  enum class Kind { make_cache, step } kind = Kind::step;
  int64_t num_pages = 0;  // make_cache
  DType dtype = DType::f32;
  int64_t step = 0;
  std::vector<int64_t> released = {};  // requests that left since the previous step, in order
  std::vector<StepSlot> slots = {};
  std::span<const ForwardRequest> rank0_requests = {};  // rank 0 runs the engine's own
  KvCache* rank0_cache = nullptr;
};

}  // namespace

namespace parallel {

// What the engine's thread and the rank threads share.
struct GroupState {
  std::string dir;
  int world = 0;
  LocalParallelGroupOptions options;
  ModelConfig config;
  std::vector<ModelConfig> rank_configs;
  std::vector<std::unique_ptr<Communicator>> comms;

  std::mutex mutex;
  std::condition_variable changed;
  uint64_t posted = 0;     // commands posted so far
  int done = 0;            // ranks that carried out the latest one
  int loaded = 0;          // ranks that have loaded their part
  bool failed = false;     // a rank threw: the others stop waiting for commands
  bool stopping = false;   // the destructor
  bool finished = false;   // run_on_ranks has returned (every rank thread ended)
  std::string error;       // why, when it ended by a failure
  Command command;         // written by the engine's thread while no rank reads it
  Tensor logits;           // rank 0's, of the latest step
  std::vector<int64_t> mirrored;  // requests each rank holds a page table for

  // The engine's thread only.
  std::unordered_map<int64_t, std::vector<int32_t>> sent;  // pages described so far, per request
  std::vector<int64_t> released;
  int64_t steps = 0;
  std::thread thread;

  void mark_failed() {
    {
      std::lock_guard lock(mutex);
      failed = true;
    }
    changed.notify_all();
  }
};

namespace {

// The other ranks' forward requests for a step: their copies of the page tables brought up to
// date and checked against rank 0's sizes.
std::vector<ForwardRequest> mirror_requests(const Command& c, std::unordered_map<int64_t, SequenceCache>& sequences) {
  std::vector<ForwardRequest> requests;
  requests.reserve(c.slots.size());
  for (const StepSlot& slot : c.slots) {
    SequenceCache& seq = sequences[slot.id];
    if (slot.first) {
      seq = SequenceCache{.pages = {}, .length = slot.length};
    } else if (seq.length != slot.length) {
      throw Error(request_text(slot.id) + " holds " + std::to_string(seq.length) +
                  " tokens in this rank's cache, " + std::to_string(slot.length) + " on rank 0");
    }
    seq.pages.insert(seq.pages.end(), slot.new_pages.begin(), slot.new_pages.end());
    if (static_cast<int64_t>(seq.pages.size()) != slot.pages || page_table_hash(seq.pages) != slot.pages_hash)
      throw Error(request_text(slot.id) + ": its page table on this rank (" + std::to_string(seq.pages.size()) +
                  " pages) differs from rank 0's (" + std::to_string(slot.pages) + " pages)");
    requests.push_back({.sequence = &seq, .tokens = slot.tokens, .all_logits = slot.all_logits});
  }
  return requests;
}

// After the forward: every copy advanced by its tokens, and no page allocated here.
void check_advanced(const Command& c, const std::unordered_map<int64_t, SequenceCache>& sequences) {
  for (const StepSlot& slot : c.slots) {
    const SequenceCache& seq = sequences.at(slot.id);
    const int64_t want = slot.length + static_cast<int64_t>(slot.tokens.size());
    if (seq.length != want || static_cast<int64_t>(seq.pages.size()) != slot.pages)
      throw Error(request_text(slot.id) + " after the step: " + std::to_string(seq.length) + " tokens in " +
                  std::to_string(seq.pages.size()) + " pages on this rank, expected " + std::to_string(want) +
                  " in " + std::to_string(slot.pages));
  }
}

// One rank thread: load its part, then carry out commands until the group stops or fails.
void rank_main(GroupState& s, Communicator& comm) {
  const int rank = comm.rank();
  const ParallelModel model = ParallelModel::load(s.dir, comm);
  std::optional<KvCache> cache;  // ranks 1..N-1 (rank 0's is the engine's)
  std::unordered_map<int64_t, SequenceCache> sequences;
  uint64_t seen = 0;
  {
    std::lock_guard lock(s.mutex);
    ++s.loaded;
  }
  s.changed.notify_all();
  for (;;) {
    {
      std::unique_lock lock(s.mutex);
      s.changed.wait(lock, [&] { return s.posted != seen || s.failed || s.stopping; });
      if (s.failed || s.stopping) return;
      seen = s.posted;
    }
    const Command& c = s.command;
    Tensor logits;
    if (c.kind == Command::Kind::make_cache) {
      sequences.clear();
      if (rank > 0) cache.emplace(model.rank_config(), c.num_pages, c.dtype);
    } else {
      for (int64_t id : c.released) sequences.erase(id);
      if (rank == 0) {
        if (s.options.before_rank_forward) s.options.before_rank_forward(rank, c.step);
        logits = model.forward(c.rank0_requests, *c.rank0_cache);
      } else {
        if (!cache) throw Error("a step before make_cache: this rank has no KV cache");
        const std::vector<ForwardRequest> requests = mirror_requests(c, sequences);
        if (s.options.before_rank_forward) s.options.before_rank_forward(rank, c.step);
        model.forward(requests, *cache);
        check_advanced(c, sequences);
      }
    }
    {
      std::lock_guard lock(s.mutex);
      if (rank == 0 && c.kind == Command::Kind::step) s.logits = std::move(logits);
      s.mirrored[rank] = static_cast<int64_t>(sequences.size());
      if (++s.done < s.world) continue;
    }
    s.changed.notify_all();
  }
}

}  // namespace
}  // namespace parallel

using parallel::GroupState;

LocalParallelGroup::LocalParallelGroup(const std::string& dir, int world_size, LocalParallelGroupOptions options)
    : shared_(std::make_unique<parallel::GroupState>()) {
  GroupState& s = *shared_;
  s.dir = dir;
  s.world = world_size;
  s.options = std::move(options);
  MSA_CHECK_ARG(s.options.threads_per_rank >= 0, "threads_per_rank", "a non-negative count",
                s.options.threads_per_rank);
  s.comms = make_local_communicators(world_size);  // checks world_size
  if (std::error_code error; !std::filesystem::is_directory(dir, error))
    throw_arg_error("model", "a model directory (config.json + safetensors)", dir);
  // A world size the model cannot take is named here, before any thread starts.
  s.config = load_model_config(dir);
  for (int r = 0; r < world_size; ++r)
    s.rank_configs.push_back(msa::rank_config(s.config, make_shard_plan(s.config, r, world_size)));
  s.mirrored.assign(world_size, 0);
  s.thread = std::thread([&s] {
    std::string error;
    try {
      run_on_ranks(
          s.comms,
          [&s](Communicator& comm) {
            try {
              parallel::rank_main(s, comm);
            } catch (const parallel::RendezvousAborted&) {
              s.mark_failed();
              throw;
            } catch (const std::exception& e) {
              s.mark_failed();
              throw Error("rank " + std::to_string(comm.rank()) + ": " + e.what());
            }
          },
          s.options.threads_per_rank);
    } catch (const std::exception& e) {
      error = e.what();
    } catch (...) {
      error = "a rank failed";
    }
    {
      std::lock_guard lock(s.mutex);
      s.finished = true;
      s.error = error.empty() ? "the ranks have stopped" : error;
    }
    s.changed.notify_all();
  });
  std::unique_lock lock(s.mutex);
  s.changed.wait(lock, [&] { return s.loaded == s.world || s.finished; });
  if (s.loaded == s.world && !s.finished) return;
  lock.unlock();
  s.thread.join();
  throw Error("loading " + std::to_string(world_size) + " tensor-parallel ranks of " + dir + ": " + s.error);
}

LocalParallelGroup::~LocalParallelGroup() {
  GroupState& s = *shared_;
  {
    std::lock_guard lock(s.mutex);
    s.stopping = true;
  }
  s.changed.notify_all();
  if (s.thread.joinable()) s.thread.join();
}

int LocalParallelGroup::world_size() const { return shared_->world; }
const ModelConfig& LocalParallelGroup::config() const { return shared_->config; }

const ModelConfig& LocalParallelGroup::rank_config(int rank) const {
  MSA_CHECK_ARG(rank >= 0 && rank < shared_->world, "rank", "a rank in [0, " + std::to_string(shared_->world) + ")",
                rank);
  return shared_->rank_configs[rank];
}

void LocalParallelGroup::run_command(const char* what) {
  GroupState& s = *shared_;
  {
    std::lock_guard lock(s.mutex);
    if (s.finished) throw Error("the tensor-parallel group stopped after an error: " + s.error);
    s.done = 0;
    ++s.posted;
  }
  s.changed.notify_all();
  std::unique_lock lock(s.mutex);
  // Not only until a rank fails: until every rank thread has ended, so that the error is the
  // failing rank's own (run_on_ranks), not another's "rank R failed".
  s.changed.wait(lock, [&] { return s.done == s.world || s.finished; });
  if (s.done != s.world) throw Error(std::string("tensor-parallel ") + what + " failed: " + s.error);
}

KvCache LocalParallelGroup::make_cache(int64_t num_pages, DType dtype) {
  GroupState& s = *shared_;
  s.command = Command{.kind = Command::Kind::make_cache, .num_pages = num_pages, .dtype = dtype};
  s.sent.clear();
  s.released.clear();
  run_command("KV cache allocation");
  return KvCache(s.rank_configs[0], num_pages, dtype);
}

Tensor LocalParallelGroup::forward(std::span<const ForwardRequest> requests, std::span<const int64_t> ids,
                                   KvCache& cache) {
  GroupState& s = *shared_;
  MSA_CHECK_ARG(ids.size() == requests.size(), "ids", std::to_string(requests.size()) + " ids (one per request)",
                ids.size());
  Command c{.kind = Command::Kind::step, .step = s.steps, .released = std::move(s.released)};
  s.released.clear();
  for (size_t i = 0; i < requests.size(); ++i) {
    const ForwardRequest& request = requests[i];
    const SequenceCache& seq = *request.sequence;
    const std::string name = request_text(ids[i]);
    MSA_CHECK_ARG(request.visual.empty(), name + " visual",
                  "no images or videos (a tensor-parallel model runs text only)", request.visual.size());
    const int64_t needed = cache.pages_for(seq.length + static_cast<int64_t>(request.tokens.size()));
    if (needed > static_cast<int64_t>(seq.pages.size()))
      throw Error(name + ": its " + std::to_string(seq.pages.size()) + " pages do not hold the step's tokens (" +
                  std::to_string(needed) + " pages needed): reserve them before the step, or the ranks would "
                  "each allocate pages of their own");
    auto [it, first] = s.sent.try_emplace(ids[i]);
    std::vector<int32_t>& sent = it->second;
    if (sent.size() > seq.pages.size() || !std::equal(sent.begin(), sent.end(), seq.pages.begin()))
      throw Error(name + ": its page table changed other than by new pages at the end since its previous step");
    c.slots.push_back({.id = ids[i],
                       .tokens = request.tokens,
                       .all_logits = request.all_logits,
                       .length = seq.length,
                       .pages = static_cast<int64_t>(seq.pages.size()),
                       .pages_hash = page_table_hash(seq.pages),
                       .new_pages = std::vector<int32_t>(seq.pages.begin() + static_cast<int64_t>(sent.size()),
                                                         seq.pages.end()),
                       .first = first});
    sent = seq.pages;
  }
  c.rank0_requests = requests;
  c.rank0_cache = &cache;
  s.command = std::move(c);
  ++s.steps;
  run_command("step");
  return std::move(s.logits);
}

void LocalParallelGroup::release(int64_t id) noexcept {
  shared_->sent.erase(id);
  shared_->released.push_back(id);
}

std::vector<int64_t> LocalParallelGroup::mirrored_requests() const {
  std::lock_guard lock(shared_->mutex);
  return {shared_->mirrored.begin() + 1, shared_->mirrored.end()};
}

}  // namespace msa
