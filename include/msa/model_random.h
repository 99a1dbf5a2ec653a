// Randomly initialised M3-shaped checkpoints (what `msa make-model` writes): a Hugging Face
// model directory with config.json and the released checkpoint's tensor names, loadable by
// msa and by transformers' MiniMaxM3SparseForConditionalGeneration.
#pragma once
#include <cstdint>
#include <string>

#include "msa/dtype.h"
#include "msa/model_config.h"

namespace msa {

// How the matrices are stored (docs/model.md "Checkpoint formats").
enum class CheckpointFormat {
  floats,  // every tensor in RandomCheckpointOptions::dtype (the router f32)
  // The MiniMax-M3-MXFP8 release: every Linear of the decoder layers (attention, indexer,
  // dense MLP, experts, shared expert) as float8_e4m3fn + `<name>_scale_inv` (UE8M0 per 32
  // input channels); embeddings, lm_head, norms, vision tower and projectors bf16, router f32.
  mxfp8,
  // ModelOpt's NVFP4, experts only: each routed expert's w1 / w3 / w2 as packed e2m1 uint8
  // + `_scale` (e4m3 per 16) + `_scale_2` (f32) + `input_scale` (f32); the rest as for
  // floats in bf16. config.json gets the quantization_config, plus hf_quant_config.json.
  nvfp4,
};

struct RandomCheckpointOptions {
  uint64_t seed = 0;
  DType dtype = DType::bf16;     // float tensors (f32, bf16, f16; bf16 for mxfp8 / nvfp4); the router stays f32
  int64_t shard_bytes = 0;       // > 0: shards of at most this size plus model.safetensors.index.json
  CheckpointFormat format = CheckpointFormat::floats;
};

// Writes `dir`/config.json and the weights; returns the number of parameters written (a
// quantized matrix counts its out * in values). The weights are streamed (one chunk of
// memory whatever their size), each tensor from a generator seeded by `seed` and its name;
// the quantized formats draw random valid codes and scales (no NaN code) whose values have
// about the float weights' spread. An msa::Error when the directory's file system has too
// little room for the whole checkpoint (checked before anything is written).
int64_t write_random_checkpoint(const ModelConfig& config, const std::string& dir,
                                const RandomCheckpointOptions& options);

// The bytes of tensor data write_random_checkpoint would write (without the headers).
int64_t random_checkpoint_bytes(const ModelConfig& config, const RandomCheckpointOptions& options);

// Writes `dir`/tokenizer.json and tokenizer_config.json (what `msa make-model` adds): a
// byte-level BPE tokenizer (GPT-2 ByteLevel pre-tokenizer and decoder) whose vocabulary
// fills ids [0, vocab_size): M3's special tokens (bos `]~!b[` and eos `[e~[` at the config's
// bos/eos ids when those are inside the vocabulary, pad `]!p~[`, role `]~b]`), the 256 byte
// symbols, then generated merges of lowercase letters. Encoding adds bos (when the config
// has one in the vocabulary); tokenizer_config.json carries bos/eos/pad and a small
// M3-style chat template. Throws msa::Error naming vocab_size when it is too small.
void write_random_tokenizer(const ModelConfig& config, const std::string& dir);

}  // namespace msa
