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

// Writes `dir`/tokenizer.json and tokenizer_config.json (what `msa make-model` adds): a
// byte-level BPE tokenizer (GPT-2 ByteLevel pre-tokenizer and decoder) whose vocabulary
// fills ids [0, vocab_size): M3's special tokens (bos `]~!b[` and eos `[e~[` at the config's
// bos/eos ids when those are inside the vocabulary, pad `]!p~[`, role `]~b]`), the 256 byte
// symbols, then generated merges of lowercase letters. Encoding adds bos (when the config
// has one in the vocabulary); tokenizer_config.json carries bos/eos/pad and a small
// M3-style chat template. Throws msa::Error naming vocab_size when it is too small.
void write_random_tokenizer(const ModelConfig& config, const std::string& dir);

}  // namespace msa
