// The attention shape flags both benchmarks (`msa bench`, CPU and CUDA) take, with
// MiniMax-M3's values as defaults: Hq 64, Hkv 4, D 128, Di 128, block 128, top-16, one local
// block, no init blocks.
#pragma once
#include <cstdint>

#include "cli_args.h"
#include "msa/ops.h"

namespace msa::cli {

// Both benchmarks' Config derive from it (the fields keep their names there).
struct BenchShape {
  int64_t heads = 0, kv_heads = 0, head_dim = 0, index_dim = 0;
  MsaParams params;
};

// Reads --heads --kv-heads --head-dim --index-dim --block-size --topk --local-blocks
// --init-blocks.
BenchShape read_bench_shape(Args& args);

}  // namespace msa::cli
