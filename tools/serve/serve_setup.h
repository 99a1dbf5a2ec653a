// What `msa serve` and `msa bench-serve` share: the model flags (--model, --device, the
// cache and batch sizes) and loading the model, its tokenizer and the output markers.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <string>

#include "cli_args.h"
#include "msa/model.h"
#include "msa/model_engine.h"
#include "scheduler.h"
#ifdef MSA_WITH_TOKENIZER
#include "msa/tokenizer.h"
#endif

namespace msa::serve {

struct ServeSetup {
  std::string model_dir;
  Device device = Device::cpu;
  DenseAttentionEngine dense_engine = DenseAttentionEngine::automatic;  // --dense-engine
  std::optional<bool> decode_graphs;  // --decode-graphs on|off (absent: the model's default)
  int tp = 1;                         // --tp: in-process tensor-parallel ranks (device cpu)
  SchedulerOptions scheduler;
  std::string default_model_name() const;
  std::string device_name() const;  // "cpu", "cuda", or "cpu, N ranks x T threads"
  int threads_per_rank() const;     // --tp: each rank's OpenMP team (the threads shared out)
  int64_t max_batch() const { return scheduler.engine.max_running; }
};

// Reads --model, --device, --tp, --dense-engine, --decode-graphs, --cache-tokens, --cache-dtype,
// --max-batch, --max-queue, --chunk, --max-step-tokens, --no-prefix-cache, --threads
// (applied at once). --tp with --device cuda is refused (multi-process CUDA serving is not
// built).
ServeSetup read_serve_flags(cli::Args& args);

struct LoadedModel {
  std::unique_ptr<Model> single;       // without --tp
  std::unique_ptr<EngineModel> model;  // what the engine steps: the single model or the ranks
#ifdef MSA_WITH_TOKENIZER
  std::optional<Tokenizer> tokenizer;
#endif
  std::set<int32_t> kept_special;  // the output markers' ids (output_parser.h)
  double load_seconds = 0;
  const Tokenizer* tokenizer_ptr() const;
};

// Loads the model, or with --tp N its N ranks' parts on N threads (and, when the directory has
// tokenizer.json, the tokenizer).
LoadedModel load_for_serving(const ServeSetup& setup);

}  // namespace msa::serve
