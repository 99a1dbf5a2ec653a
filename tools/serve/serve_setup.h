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
  SchedulerOptions scheduler;
  std::string default_model_name() const;
  std::string device_name() const;
  int64_t max_batch() const { return scheduler.engine.max_running; }
};

// Reads --model, --device, --dense-engine, --decode-graphs, --cache-tokens, --cache-dtype,
// --max-batch, --max-queue, --chunk, --max-step-tokens, --no-prefix-cache, --threads
// (applied at once).
ServeSetup read_serve_flags(cli::Args& args);

struct LoadedModel {
  std::unique_ptr<Model> model;
#ifdef MSA_WITH_TOKENIZER
  std::optional<Tokenizer> tokenizer;
#endif
  std::set<int32_t> kept_special;  // the output markers' ids (output_parser.h)
  double load_seconds = 0;
  const Tokenizer* tokenizer_ptr() const;
};

// Loads the model (and, when the directory has tokenizer.json, the tokenizer).
LoadedModel load_for_serving(const ServeSetup& setup);

}  // namespace msa::serve
