// The inputs that the attention kernels' argument structs all repeat (attn::SparseArgs,
// DenseArgs, DecodeArgs, BackwardArgs, DenseDqArgs), filled from AttentionParams or
// AttentionBackwardParams: q, k, v, head counts and the batch's query starts and key lengths.
#pragma once

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

}  // namespace msa::cuda
