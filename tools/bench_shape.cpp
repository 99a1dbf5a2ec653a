#include "bench_shape.h"

namespace msa::cli {

BenchShape read_bench_shape(Args& args) {
  BenchShape shape;
  shape.heads = args.get_int("heads", 64);
  shape.kv_heads = args.get_int("kv-heads", 4);
  shape.head_dim = args.get_int("head-dim", 128);
  shape.index_dim = args.get_int("index-dim", 128);
  shape.params.block_size = args.get_int("block-size", 128);
  shape.params.topk = args.get_int("topk", 16);
  shape.params.local_blocks = args.get_int("local-blocks", 1);
  shape.params.init_blocks = args.get_int("init-blocks", 0);
  return shape;
}

}  // namespace msa::cli
