// STUB: being written.
#include "cpu.h"
#include "msa/error.h"
namespace msa::detail::cpu {
void attention_forward(const float*, const KeyBlocks<float>&, const KeyBlocks<float>&,
                       const AttentionDims&, const Batch&, BlockSource, float, float*, float*) {
  throw Error("cpu attention_forward: not implemented yet");
}
}
