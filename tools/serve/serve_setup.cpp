// The shared model flags and loading of `msa serve` and `msa bench-serve` (serve_setup.h).
#include "serve_setup.h"

#include <algorithm>
#include <cstdint>
#include <chrono>
#include <filesystem>

#include "cache_dtype_flag.h"
#include "dense_engine_flag.h"
#include "msa/ops.h"
#include "msa/parallel_group.h"
#include "output_parser.h"

namespace msa::serve {

constexpr int kMaxRanks = 256;  // --tp: in-process ranks (make_local_communicators' bound)

std::string ServeSetup::default_model_name() const {
  std::filesystem::path path(model_dir);
  while (!path.empty() && path.filename().empty()) path = path.parent_path();
  const std::string name = path.filename().string();
  return name.empty() ? "msa" : name;
}

std::string ServeSetup::device_name() const {
  if (device == Device::cuda) return "cuda";
  if (tp == 1) return "cpu";
  return "cpu, " + std::to_string(tp) + " ranks x " + std::to_string(threads_per_rank()) + " threads";
}

int ServeSetup::threads_per_rank() const { return std::max(1, num_threads() / tp); }

ServeSetup read_serve_flags(cli::Args& args) {
  ServeSetup s;
  s.model_dir = args.get_string("model");
  const std::string device = args.get_string("device", "cpu");
  if (device == "cpu") s.device = Device::cpu;
  else if (device == "cuda") s.device = Device::cuda;
  else throw cli::UsageError("--device: expected cpu or cuda, got \"" + device + "\"");
  s.dense_engine = cli::read_dense_engine_flag(args, s.device == Device::cuda);
  const bool tp_given = args.has("tp");
  s.tp = args.get_int("tp", 1, 1, kMaxRanks);
  if (tp_given && s.device == Device::cuda)
    throw Error("--tp with --device cuda: multi-process CUDA serving is not built yet (docs/parallel.md "
                "\"Serving\"); serve --tp N on the CPU, or one GPU without --tp");
  EngineOptions& e = s.scheduler.engine;
  e.cache_tokens = args.get_int64("cache-tokens", 65536, 1, int64_t{1} << 30);
  e.cache_dtype = cli::read_cache_dtype_flag(args, s.device);
  e.max_running = args.get_int64("max-batch", 32, 1, 1 << 16);
  e.prefill_chunk = args.get_int64("chunk", 512, 1, 1 << 24);
  e.max_step_tokens = args.get_int64("max-step-tokens", 2048, 1, 1 << 24);
  e.prefix_caching = !args.get_switch("no-prefix-cache");
  s.scheduler.max_queue = args.get_int64("max-queue", 256, 0, 1 << 20);
  s.decode_graphs = cli::parse_on_off(args, "decode-graphs");
  set_num_threads(args.get_threads());
  return s;
}

const Tokenizer* LoadedModel::tokenizer_ptr() const {
#ifdef MSA_WITH_TOKENIZER
  return tokenizer ? &*tokenizer : nullptr;
#else
  return nullptr;
#endif
}

LoadedModel load_for_serving(const ServeSetup& setup) {
  LoadedModel loaded;
  const auto start = std::chrono::steady_clock::now();
  if (setup.tp > 1) {
    // One thread per rank, sharing the cores: each rank's OpenMP team gets its share.
    loaded.model = std::make_unique<LocalParallelGroup>(
        setup.model_dir, setup.tp, LocalParallelGroupOptions{.threads_per_rank = setup.threads_per_rank()});
  } else {
    loaded.single = std::make_unique<Model>(Model::load(setup.model_dir, setup.device));
    loaded.single->set_dense_attention_engine(setup.dense_engine);
    if (setup.decode_graphs) loaded.single->set_decode_graphs(*setup.decode_graphs);
    loaded.model = std::make_unique<SingleEngineModel>(*loaded.single);
  }
#ifdef MSA_WITH_TOKENIZER
  std::error_code ignored;
  if (std::filesystem::exists(std::filesystem::path(setup.model_dir) / "tokenizer.json", ignored)) {
    loaded.tokenizer = Tokenizer::from_model_dir(setup.model_dir);
    const OutputFormat format = OutputFormat::detect(*loaded.tokenizer);
    for (const std::string& marker : {format.reasoning_start, format.reasoning_end, format.tool_namespace})
      if (!marker.empty())
        if (const auto id = loaded.tokenizer->token_to_id(marker)) loaded.kept_special.insert(*id);
  }
#endif
  loaded.load_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return loaded;
}

}  // namespace msa::serve
