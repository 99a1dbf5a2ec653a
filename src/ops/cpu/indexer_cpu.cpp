// STUB: being written.
#include "cpu.h"
#include "msa/error.h"
namespace msa::detail::cpu {
void indexer(const float*, int64_t, int64_t, const KeyBlocks<float>&, const Batch&,
             const MsaParams&, float, int32_t*, float*) {
  throw Error("cpu indexer: not implemented yet");
}
}
