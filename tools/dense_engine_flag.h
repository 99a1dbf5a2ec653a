// --dense-engine auto|msa|cudnn|cudnn-gathered (msa run, msa logits, msa serve, msa bench-model):
// which kernel runs the CUDA text model's dense attention (msa::DenseAttentionEngine, msa/model.h).
#pragma once
#include <string>

#include "cli_args.h"
#include "msa/error.h"
#include "msa/model.h"

namespace msa::cli {

// Reads the flag (default auto). `cuda`: the command runs the model on the GPU; on the CPU
// only auto is accepted (there is no engine to choose). cudnn and cudnn-gathered in a build
// without cuDNN are refused here, before any weights are read.
inline DenseAttentionEngine read_dense_engine_flag(Args& args, bool cuda) {
  const std::string text = args.get_string("dense-engine", "auto");
  DenseAttentionEngine engine = DenseAttentionEngine::automatic;
  try {
    engine = parse_dense_attention_engine(text, "--dense-engine");
  } catch (const Error&) {
    throw UsageError("--dense-engine: expected auto, msa, cudnn or cudnn-gathered, got \"" + text + "\"");
  }
  if (!cuda && engine != DenseAttentionEngine::automatic)
    throw UsageError("--dense-engine " + text + ": only with --device cuda (it picks the CUDA text model's "
                     "dense attention kernel)");
  if (dense_attention_engine_needs_cudnn(engine) && !dense_attention_cudnn_built())
    throw UsageError("--dense-engine " + text + ": this build of msa has no cuDNN (configure with -DMSA_CUDA=ON, "
                     "the cuDNN frontend in .deps/cudnn_frontend, libcudnn and cudnn.h)");
  return engine;
}

}  // namespace msa::cli
