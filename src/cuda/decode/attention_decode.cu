// The decode path of the main branch (decode_launch.h): decode_attention_kernel over
// (split, group x query chunk, request), then decode_merge_kernel when the context is split
// (attention_decode.cuh); both PDL-launched, no sort. Sparse with selection rows, or dense
// (every block up to the query's own, split-K over the context) with topk null.
#include <algorithm>
#include <string>

#include "cuda/attention/attention_inputs.h"
#include "cuda/common/kernel_attributes.h"
#include "cuda/common/pdl.cuh"
#include "cuda/common/sm_count.h"
#include "cuda/common/workspace_layout.h"
#include "cuda/decode/attention_decode.cuh"
#include "cuda/decode/decode_launch.h"
#include "msa/error.h"

namespace msa::cuda {

namespace {

// Every quantity below comes from host-known capacities (batch, heads, max_q_len,
// max_k_len, slots, the SM count): the grids and the workspace never depend on data.
struct AttentionDecodePlan {
  int queries_per_cta = 1, row_chunks = 1, rows_per_cta = 1, splits = 1, entries_pad = 32;
  int64_t pairs = 0;
  size_t partial_o = 0, partial_lse = 0, total = 0;
};

bool use_decode(const AttentionLaunch& p) {
  if (p.batch.max_q_len < 1 || p.batch.max_q_len > attn::kDecodeMaxQueries) return false;
  // Causal D = 64 / 128 only: bidirectional calls and head dim 80 (the vision tower's) run the
  // prefill kernels for any q_len.
  if (!p.causal || (p.head_dim != 64 && p.head_dim != 128)) return false;
  const int64_t queries_per_cta =
      std::min<int64_t>(p.batch.max_q_len, attn::kDecodeMaxRows / (p.q_heads / p.kv_heads));
  if (p.topk) return p.slots * queries_per_cta <= attn::kDecodeMaxEntries;
  // Dense: the flash kernel gives one CTA per (64 rows, KV head), i.e. ~4 CTAs on 132 SMs
  // for a batch-1 decode step (~2% of the read bandwidth at 128K); the decode kernel splits
  // the context over ~2 CTAs per SM instead. Its grid holds the batch in z and the KV heads
  // x query chunks in y (65535 each); beyond that (prefills of >65535 short requests) the
  // flash kernel, which has no such limit, serves.
  const int64_t row_chunks = (p.batch.max_q_len + queries_per_cta - 1) / queries_per_cta;
  return p.batch.batch <= 65535 && p.kv_heads * row_chunks <= 65535;
}

AttentionDecodePlan plan_decode(const AttentionLaunch& p) {
  AttentionDecodePlan plan;
  const int64_t group = p.q_heads / p.kv_heads, block_size = p.k.block_size;
  plan.queries_per_cta = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(p.batch.max_q_len, attn::kDecodeMaxRows / group)));
  plan.row_chunks = static_cast<int>((p.batch.max_q_len + plan.queries_per_cta - 1) / plan.queries_per_cta);
  plan.rows_per_cta = static_cast<int>(plan.queries_per_cta * group);
  // Units (64-key sub-tiles) a CTA group may see. Sparse: at most every selected entry, at
  // most every block of the longest request. Dense: every 64-key tile of the longest
  // request (no union, so no union scratch: entries_pad = 0).
  int64_t units = 0;
  if (p.topk) {
    const int64_t entries = int64_t{plan.queries_per_cta} * p.slots;
    while (plan.entries_pad < entries) plan.entries_pad *= 2;
    const int64_t max_blocks = std::max<int64_t>(1, (p.batch.max_k_len + block_size - 1) / block_size);
    units = std::min(entries, max_blocks) * (block_size / attn::kKeyTile);
  } else {
    plan.entries_pad = 0;
    units = std::max<int64_t>(1, (p.batch.max_k_len + attn::kKeyTile - 1) / attn::kKeyTile);
  }
  plan.pairs = p.batch.batch * p.kv_heads * plan.row_chunks;
  // Aim at ~2 resident CTAs per SM (one wave); give each CTA an equal unit count. Dense
  // units are not bounded by the selection (16384 at 1M tokens): the split target keeps S
  // within the merge's kDecodeMaxSplits (264 on an H200), and a CTA then loops over
  // hundreds of units.
  const int64_t target = std::min<int64_t>(2 * int64_t{sm_count()}, attn::kDecodeMaxSplits);
  const int64_t wanted = std::clamp<int64_t>(target / std::max<int64_t>(1, plan.pairs), 1, units);
  const int64_t per = (units + wanted - 1) / wanted;
  plan.splits = static_cast<int>((units + per - 1) / per);
  if (plan.splits > attn::kDecodeMaxSplits)  // sparse: units <= entries x 2 <= kDecodeMaxSplits
    throw_arg_error("slots", "at most " + std::to_string(attn::kDecodeMaxSplits) + " decode splits",
                    plan.splits);
  if (plan.pairs * plan.splits >= (int64_t{1} << 31) || p.batch.batch > 65535 ||
      p.kv_heads * plan.row_chunks > 65535)
    throw_arg_error("batch", "fewer decode CTAs", plan.pairs * plan.splits);
  WorkspaceCursor ws;
  if (plan.splits > 1) {
    const size_t partial_rows = size_t(plan.pairs) * plan.splits * plan.rows_per_cta;
    plan.partial_o = ws.take(partial_rows * p.head_dim * sizeof(float));
    plan.partial_lse = ws.take(partial_rows * sizeof(float));
  }
  plan.total = ws.at;
  return plan;
}

template <int D>
void run_decode(const AttentionLaunch& p, const AttentionDecodePlan& plan, char* ws, cudaStream_t stream) {
  attn::DecodeArgs args{};
  set_attention_inputs(args, p);
  args.block_size = static_cast<int>(p.k.block_size);
  args.batch = p.batch.batch;
  args.total_q = p.batch.total_q;
  args.topk = p.topk;  // null: dense mode
  args.slots = p.topk ? static_cast<int>(p.slots) : 0;
  args.max_q_len = static_cast<int>(p.batch.max_q_len);
  args.queries_per_cta = plan.queries_per_cta;
  args.row_chunks = plan.row_chunks;
  args.rows_per_cta = plan.rows_per_cta;
  args.splits = plan.splits;
  args.entries_pad = plan.entries_pad;
  args.scale_log2 = p.scale * attn::kLog2e;
  args.partial_o = plan.splits > 1 ? reinterpret_cast<float*>(ws + plan.partial_o) : nullptr;
  args.partial_lse = plan.splits > 1 ? reinterpret_cast<float*>(ws + plan.partial_lse) : nullptr;
  args.o = p.o;
  args.o_bf16 = p.o_type == OutputType::bf16;
  args.lse = p.lse;
  const bool fp8 = p.kv_format == KvFormat::fp8;  // the codes' paged layout stays in args.k / v
  if (fp8) {
    args.k_fp8 = p.k_fp8;
    args.v_fp8 = p.v_fp8;
  }

  // One 16-row warp tile per CTA (QC x G <= 16: M3 at Q = 1, G <= 4 at small Q): the 4 warps
  // split each unit's keys instead of 3 of them idling.
  const bool split_keys = plan.rows_per_cta <= attn::kWarpRows;
  const size_t smem = !fp8      ? attn::decode_smem_bytes<D>(plan.entries_pad, plan.queries_per_cta)
                      : split_keys ? attn::decode_smem_bytes<D, true, true>(plan.entries_pad, plan.queries_per_cta)
                                   : attn::decode_smem_bytes<D, true, false>(plan.entries_pad, plan.queries_per_cta);
  auto kernel = fp8 ? (split_keys ? attn::decode_attention_kernel<D, true, true>
                                  : attn::decode_attention_kernel<D, false, true>)
                    : (split_keys ? attn::decode_attention_kernel<D, true>
                                  : attn::decode_attention_kernel<D, false>);
  require_dynamic_smem(kernel, smem);
  const dim3 grid(static_cast<unsigned>(plan.splits),
                  static_cast<unsigned>(p.kv_heads * plan.row_chunks),
                  static_cast<unsigned>(p.batch.batch));
  launch_pdl(kernel, grid, dim3(attn::kDecodeThreads), smem, stream, args);
  if (plan.splits > 1 && !p.decode_skip_merge) {
    const int64_t rows = p.batch.batch * p.batch.max_q_len * p.q_heads;  // one CTA each
    if (rows >= (int64_t{1} << 31)) throw_arg_error("batch", "fewer decode merge rows", rows);
    launch_pdl(attn::decode_merge_kernel<D>, dim3(static_cast<unsigned>(rows)),
               dim3(attn::kDecodeMergeThreads), 0, stream, args);
  }
}

}  // namespace

bool attention_decode_applies(const AttentionLaunch& p) { return use_decode(p); }

size_t attention_decode_workspace_bytes(const AttentionLaunch& p) { return plan_decode(p).total; }

void launch_attention_decode(const AttentionLaunch& p, void* workspace, void* stream) {
  const AttentionDecodePlan plan = plan_decode(p);
  char* ws = static_cast<char*>(workspace);
  const auto s = static_cast<cudaStream_t>(stream);
  if (p.head_dim == 64)
    run_decode<64>(p, plan, ws, s);
  else
    run_decode<128>(p, plan, ws, s);
}

}  // namespace msa::cuda
