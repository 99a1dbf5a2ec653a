// Randomly initialised M3-shaped checkpoints (what `msa make-model` writes): a Hugging Face
// model directory with config.json and the released checkpoint's tensor names, loadable by
// msa and by transformers' MiniMaxM3SparseForConditionalGeneration.
#pragma once
#include <cstdint>
#include <string>

#include "msa/dtype.h"
#include "msa/model_config.h"

namespace msa {

struct RandomCheckpointOptions {
  uint64_t seed = 0;
  DType dtype = DType::bf16;     // matrices and norms; the router stays f32 as in the release
  int64_t shard_bytes = 0;       // > 0: shards of at most this size plus model.safetensors.index.json
};

// Writes `dir`/config.json and the weights; returns the number of parameters written.
int64_t write_random_checkpoint(const ModelConfig& config, const std::string& dir,
                                const RandomCheckpointOptions& options);

}  // namespace msa
