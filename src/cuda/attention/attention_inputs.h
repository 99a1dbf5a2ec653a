// The inputs that the attention kernels' argument structs all repeat (attn::SparseArgs,
// DenseArgs, DecodeArgs, BackwardArgs, DenseDqArgs), filled from AttentionLaunch or
// AttentionBackwardLaunch: q, k, v, head counts and the batch's query starts and key lengths.
#pragma once
#include <cstdint>

#include "msa/cuda/types.h"
#include "msa/error.h"

namespace msa::cuda {

template <class Args, class Params>
void set_attention_inputs(Args& args, const Params& p) {
  args.q = p.q;
  args.k = p.k;
  args.v = p.v;
  args.q_heads = p.q_heads;
  args.kv_heads = p.kv_heads;
  args.group = static_cast<decltype(args.group)>(p.q_heads / p.kv_heads);  // <= 16; int in DecodeArgs
  args.q_start = p.batch.q_start;
  args.k_len = p.batch.k_len;
}

// attn::DenseArgs of either dense prefill kernel (mma.sync or wgmma): the inputs, the tile
// plan's starts, the softmax scale in log2 units (`log2e`: attn::kLog2e), the outputs.
template <class Args, class Params>
void set_dense_args(Args& args, const Params& p, int64_t* tile_start, float log2e) {
  set_attention_inputs(args, p);
  args.batch = p.batch.batch;
  args.tile_start = tile_start;
  args.scale_log2 = p.scale * log2e;
  args.causal = p.causal;
  args.o = p.o;
  args.o_bf16 = p.o_type == OutputType::bf16;
  args.lse = p.lse;
}

// Grid x of a dense prefill kernel with `rows` (query, head) rows per CTA: an upper bound of
// sum_b ceil(q_len_b * G / rows) (extra CTAs exit at once); grid y is the KV heads.
template <class Params>
int64_t dense_grid_tiles(const Params& p, int64_t rows) {
  const int64_t group = p.q_heads / p.kv_heads;
  const int64_t tiles = (p.batch.total_q * group + rows - 1) / rows + p.batch.batch;
  if (tiles >= (int64_t{1} << 31)) throw_arg_error("total_q", "fewer than 2^31 dense tiles", tiles);
  if (p.kv_heads > 65535) throw_arg_error("kv_heads", "at most 65535 (grid y)", p.kv_heads);
  return tiles;
}

}  // namespace msa::cuda
