// STUB: being written.
#include "cpu.h"
#include "msa/error.h"
namespace msa::detail::cpu {
void attention_backward(const float*, const KeyBlocks<float>&, const KeyBlocks<float>&,
                        const AttentionDims&, const Batch&, BlockSource, float, const float*,
                        const float*, const float*, float*, float*, float*) {
  throw Error("cpu attention_backward: not implemented yet");
}
}
