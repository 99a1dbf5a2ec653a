#include "bench_shape.h"

namespace msa::cli {

BenchShape read_bench_shape(Args& args) {
  BenchShape shape;
  // Ranges far above M3's shape; the benchmarks check the combinations they need.
  shape.heads = args.get_int("heads", 64, 1, 1024);
  shape.kv_heads = args.get_int("kv-heads", 4, 1, 1024);
  shape.head_dim = args.get_int("head-dim", 128, 1, 1024);
  shape.index_dim = args.get_int("index-dim", 128, 1, 1024);
  shape.params.block_size = args.get_int("block-size", 128, 1, 1 << 16);
  shape.params.topk = args.get_int("topk", 16, 1, 1 << 16);
  shape.params.local_blocks = args.get_int("local-blocks", 1, 1, 1 << 16);
  shape.params.init_blocks = args.get_int("init-blocks", 0, 0, 1 << 16);
  return shape;
}

}  // namespace msa::cli
