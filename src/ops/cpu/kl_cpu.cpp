// STUB: being written.
#include "cpu.h"
#include "msa/error.h"
namespace msa::detail::cpu {
double indexer_kl(const float*, const KeyBlocks<float>&, const float*, const AttentionDims&,
                  const float*, const KeyBlocks<float>&, int64_t, const Batch&, BlockSource,
                  const MsaParams&, float, float, float*, float*) {
  throw Error("cpu indexer_kl: not implemented yet");
}
}
