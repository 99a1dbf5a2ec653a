// Host launcher of the KL backward of the indexer (kl_launch.h).
//
// Sequence on the caller's stream (no allocation, no host synchronisation):
//   fast mode: cudaMemsetAsync(dki, 0);
//   per chunk of queries (bounded workspace, like the sparse forward):
//     build_selection_keys -> cub radix sort -> make_work_items (selection_inversion.h,
//     items of kl::kItemEntries entries) -> kl_student_lse_kernel ->
//     kl_student_lse_reduce_kernel (the chunk's student LSE, logit_scale = index_scale / T,
//     on the tensor cores: indexer_kl_student_lse.cuh; into student_lse_out when given) ->
//     kl_entries_kernel (or, with the teacher given, kl_given_teacher_kernel) ->
//     kl_row_reduce_kernel -> (deterministic) kl_dki_reduce_kernel;
//   kl_loss_reduce_kernel.
//
// Workspace, each region 256-byte aligned:
//   whole call: student LSE Hi x total_q x 4, row losses total_q x Hi x 8;
//   per chunk of C queries, E = Hi x C x slots entries, I = ceil(E / 64) + min(E, Hi x batch
//   x nblk) items: sorted keys 2 x E x 8, cub temp, item counter, items I x 8, student LSE
//   partials E x 16, loss partials E x 4, dqi partials E x Di x 4, and in deterministic
//   mode item slots E x 4 and dki partials I x B x Di x 4. M3 (Hi = 4, k = 16, Di = B = 128): ~100 KB per query
//   (deterministic), so chunks of ~40K queries under the 4 GiB budget.
#include <algorithm>
#include <string>

#include "cuda/common/kernel_attributes.h"
#include "cuda/training/kl_launch.h"
#include "cuda/attention/selection_inversion.h"
#include "cuda/common/sm_count.h"
#include "cuda/common/workspace_layout.h"
#include "cuda/training/indexer_kl_entries.cuh"
#include "cuda/training/indexer_kl_reduce.cuh"
#include "cuda/training/indexer_kl_student_lse.cuh"
#include "msa/error.h"

namespace msa::cuda {

namespace {

constexpr size_t kWorkspaceBudget = size_t{4} << 30;

void check_params(const IndexerKlLaunch& p) {
  const bool recompute = p.teacher == nullptr;  // else q, k and main_lse are not read
  MSA_CHECK_ARG(!recompute || p.head_dim == 64 || p.head_dim == 128, "q", "head dim 64 or 128 (CUDA KL)",
                p.head_dim);
  MSA_CHECK_ARG(p.index_dim == 64 || p.index_dim == 128, "qi", "index dim 64 or 128 (CUDA KL)",
                p.index_dim);
  MSA_CHECK_ARG(p.block_size == 64 || p.block_size == 128, "block_size", "64 or 128 (CUDA KL)",
                p.block_size);
  MSA_CHECK_ARG(p.kv_heads >= 1 && p.kv_heads <= kl::kMaxIndexHeads, "kv_heads",
                "1..16 KV groups = index heads (CUDA KL)", p.kv_heads);
  MSA_CHECK_ARG(p.q_heads % p.kv_heads == 0 && p.q_heads / p.kv_heads >= 1 &&
                    p.q_heads / p.kv_heads <= 16,
                "q_heads / kv_heads", "a group size in 1..16 (CUDA KL)",
                std::to_string(p.q_heads) + " / " + std::to_string(p.kv_heads));
  MSA_CHECK_ARG(p.slots >= 1 && p.slots <= 32, "topk", "1..32 slots per row (CUDA KL)", p.slots);
  MSA_CHECK_ARG(p.ki.page_table == nullptr && (!recompute || p.k.page_table == nullptr), "k, ki",
                "varlen layouts (CUDA KL)", "a paged layout");
  MSA_CHECK_ARG(p.ki.block_size == p.block_size && (!recompute || p.k.block_size == p.block_size), "k, ki",
                "layouts with block size " + std::to_string(p.block_size),
                std::to_string(p.k.block_size) + ", " + std::to_string(p.ki.block_size));
  MSA_CHECK_ARG(p.ki.token_stride % 8 == 0 && p.ki.block_stride % 8 == 0 &&
                    (!recompute || (p.k.token_stride % 8 == 0 && p.k.head_stride % 8 == 0 &&
                                    p.k.block_stride % 8 == 0)),
                "k, ki", "strides that are multiples of 8 elements", "other strides");
  MSA_CHECK_ARG(is_aligned(p.qi, 16) && is_aligned(p.ki.data, 16) &&
                    (!recompute || (is_aligned(p.q, 16) && is_aligned(p.k.data, 16))),
                "q, k, qi, ki", "16-byte aligned data", "a misaligned pointer");
  MSA_CHECK_ARG(is_aligned(p.teacher, 16), "teacher", "16-byte aligned data", "a misaligned pointer");
  MSA_CHECK_ARG(is_aligned(p.dki, 16), "dki", "16-byte aligned data (the deterministic reduction stores float4)",
                "a misaligned pointer");
  MSA_CHECK_ARG(!(p.student_lse && p.student_lse_out), "student_lse_out",
                "null when student_lse is given (the LSE is then not computed)", "a device pointer");
  MSA_CHECK_ARG(p.loss && p.dqi && (p.dki || p.total_k == 0) && (p.main_lse || !recompute) && p.topk,
                "outputs", "device pointers for loss, dqi, dki, main_lse (without a teacher) and topk", "null");
}

// Regions of one chunk's workspace, after the whole-call regions (student LSE, row losses).
struct KlPlan {
  SelectionInversion selection;  // keys, cub temp, item counter, items
  size_t student_lse = 0, row_loss = 0, student_partial = 0, item_slot = 0, loss_partial = 0, dqi_partial = 0,
         dki_partial = 0, total = 0;
};

KlPlan plan_chunk(const IndexerKlLaunch& p, int64_t chunk_q) {
  KlPlan plan;
  const int64_t B = p.block_size;
  const int64_t nblk = selection_key_blocks(p.kv_heads, p.batch.max_k_len, B);
  plan.selection = size_selection_inversion(p.kv_heads, p.slots, nblk, chunk_q);
  WorkspaceCursor ws;
  const size_t entries = static_cast<size_t>(plan.selection.entries);
  plan.student_lse = ws.take(size_t(p.kv_heads) * p.batch.total_q * sizeof(float));
  plan.row_loss = ws.take(size_t(p.kv_heads) * p.batch.total_q * sizeof(double));
  take_selection_regions(plan.selection,
                         packed_item_bound(plan.selection, plan.selection.entries, kl::kItemEntries, p.batch.batch),
                         ws);
  plan.student_partial = ws.take(entries * 2 * sizeof(float2));
  plan.loss_partial = ws.take(entries * sizeof(float));
  plan.dqi_partial = ws.take(entries * p.index_dim * sizeof(float));
  if (p.deterministic) {
    plan.item_slot = ws.take(entries * sizeof(int32_t));
    plan.dki_partial = ws.take(size_t(plan.selection.item_bound) * B * p.index_dim * sizeof(float));
  }
  plan.total = ws.at;
  return plan;
}

// Largest chunk (<= total_q) whose workspace fits the budget, within the inversion's limits
// (max_selection_chunk); then equal chunks.
KlPlan make_plan(const IndexerKlLaunch& p) {
  const int64_t total_q = p.batch.total_q;
  const int64_t chunk = max_selection_chunk(total_q, p.kv_heads, p.slots, 0);
  return fit_query_chunk(total_q, chunk, kWorkspaceBudget, [&p](int64_t chunk_q) { return plan_chunk(p, chunk_q); });
}

int next_power_of_two(int64_t value) {
  int out = 1;
  while (out < value) out *= 2;
  return out;
}

template <int D, int Di>
void run(const IndexerKlLaunch& p, const KlPlan& plan, char* ws, cudaStream_t stream) {
  const int64_t total_q = p.batch.total_q;
  const float grad_scale = static_cast<float>(p.logit_scale * p.loss_scale);
  const bool given_lse = p.student_lse != nullptr;
  float* student_lse = given_lse           ? const_cast<float*>(p.student_lse)
                       : p.student_lse_out ? p.student_lse_out
                                           : reinterpret_cast<float*>(ws + plan.student_lse);
  double* row_loss = reinterpret_cast<double*>(ws + plan.row_loss);

  if (!p.deterministic)
    MSA_CUDA_CHECK(cudaMemsetAsync(p.dki, 0, size_t(p.total_k) * p.index_dim * sizeof(float), stream));

  const bool given = p.teacher != nullptr;
  const size_t smem = given ? kl::KlGivenSmem<Di>::bytes(p.block_size) : kl::KlSmem<D, Di>::bytes(p.block_size);
  auto kernel = given ? kl::kl_given_teacher_kernel<Di> : kl::kl_entries_kernel<D, Di>;
  const int64_t resident = int64_t{resident_ctas_per_sm(kernel, kl::kKlThreads, smem)} * sm_count();
  const size_t lse_smem = kl::StudentLseSmem<Di>::bytes(p.block_size);
  auto lse_kernel = kl::kl_student_lse_kernel<Di>;
  const int64_t lse_resident = int64_t{resident_ctas_per_sm(lse_kernel, kl::kKlThreads, lse_smem)} * sm_count();

  for (int64_t q_begin = 0; q_begin < total_q; q_begin += plan.selection.chunk_q) {
    const int64_t chunk_q = std::min(plan.selection.chunk_q, total_q - q_begin);
    const SelectionChunk selection =
        invert_selection(plan.selection, p.topk, p.batch, q_begin, chunk_q, kl::kItemEntries, ws, stream);
    const int64_t entries = selection.entries, rows = p.kv_heads * chunk_q;

    kl::EntryArgs args{};
    args.q = p.q;
    args.k = p.k;
    args.main_lse = p.main_lse;
    args.qi = p.qi;
    args.ki = p.ki;
    args.q_heads = p.q_heads;
    args.kv_heads = p.kv_heads;
    args.group = p.q_heads / p.kv_heads;
    args.group_pad = next_power_of_two(args.group);
    args.block_size = p.block_size;
    args.q_start = p.batch.q_start;
    args.k_len = p.batch.k_len;
    args.seq_of_query = p.batch.seq_of_query;
    args.total_q = total_q;
    set_selection_chunk(args, selection);
    args.student_lse = student_lse;
    args.student_partial = reinterpret_cast<float2*>(ws + plan.student_partial);
    args.scale_log2 = p.scale * attn::kLog2e;
    args.logit_scale = p.logit_scale;
    args.dqi_partial = reinterpret_cast<float*>(ws + plan.dqi_partial);
    args.loss_partial = reinterpret_cast<float*>(ws + plan.loss_partial);
    args.dki_partial = p.deterministic ? reinterpret_cast<float*>(ws + plan.dki_partial) : nullptr;
    args.item_slot = p.deterministic ? reinterpret_cast<int32_t*>(ws + plan.item_slot) : nullptr;
    args.dki = p.dki;
    args.grad_scale = grad_scale;
    args.teacher = p.teacher;
    const int64_t chunk_items = packed_item_bound(plan.selection, entries, kl::kItemEntries, p.batch.batch);
    // The chunk's student LSE first (unless given): kl_entries_kernel reads it per entry.
    if (!given_lse) {
      lse_kernel<<<static_cast<unsigned>(std::max<int64_t>(1, std::min(chunk_items, lse_resident))), kl::kKlThreads,
                   lse_smem, stream>>>(args);
      MSA_CUDA_CHECK_LAUNCH();
      const kl::StudentLseReduceArgs lse_args{p.topk,   total_q, p.kv_heads, p.slots,
                                              q_begin,  chunk_q, p.block_size / attn::kKeyTile,
                                              args.student_partial, student_lse};
      kl::kl_student_lse_reduce_kernel<<<static_cast<unsigned>(ceil_div(rows, kl::kReduceThreads)),
                                         kl::kReduceThreads, 0, stream>>>(lse_args);
      MSA_CUDA_CHECK_LAUNCH();
    }

    const int64_t grid = std::max<int64_t>(1, std::min(chunk_items, resident));
    kernel<<<static_cast<unsigned>(grid), kl::kKlThreads, smem, stream>>>(args);
    MSA_CUDA_CHECK_LAUNCH();

    const kl::RowReduceArgs row_args{p.topk,
                                     total_q,
                                     p.kv_heads,
                                     p.slots,
                                     q_begin,
                                     chunk_q,
                                     p.index_dim,
                                     args.dqi_partial,
                                     args.loss_partial,
                                     grad_scale,
                                     p.dqi,
                                     row_loss};
    kl::kl_row_reduce_kernel<<<static_cast<unsigned>(ceil_div(rows, kl::kRowWarps)),
                               kl::kRowThreads, 0, stream>>>(row_args);
    MSA_CUDA_CHECK_LAUNCH();

    if (p.deterministic) {
      kl::DkiReduceArgs dki_args{};
      dki_args.keys = selection.keys;
      dki_args.entries = entries;
      dki_args.item_slot = args.item_slot;
      dki_args.dki_partial = args.dki_partial;
      dki_args.heads = p.kv_heads;
      dki_args.nblk = plan.selection.nblk;
      dki_args.slots = p.slots;
      dki_args.q_begin = q_begin;
      dki_args.chunk_q = chunk_q;
      dki_args.index_dim = p.index_dim;
      dki_args.batch = p.batch.batch;
      dki_args.qbits = plan.selection.qbits;
      dki_args.block_size = p.block_size;
      dki_args.q_start = p.batch.q_start;
      dki_args.k_len = p.batch.k_len;
      dki_args.k_start = p.ki.seq_token_start;
      dki_args.grad_scale = grad_scale;
      dki_args.accumulate = q_begin > 0;
      dki_args.dki = p.dki;
      const int64_t ctas = p.batch.batch * plan.selection.nblk;
      MSA_CHECK_ARG(ctas < (int64_t{1} << 31), "batch", "fewer (sequence, block) pairs", ctas);
      if (ctas > 0)
        kl::kl_dki_reduce_kernel<<<static_cast<unsigned>(ctas), kl::kReduceThreads, 0, stream>>>(
            dki_args);
      MSA_CUDA_CHECK_LAUNCH();
    }
  }
  kl::kl_loss_reduce_kernel<<<1, kl::kReduceThreads, 0, stream>>>(row_loss, total_q * p.kv_heads,
                                                                   p.loss_scale, p.loss);
  MSA_CUDA_CHECK_LAUNCH();
}

}  // namespace

size_t indexer_kl_workspace_bytes(const IndexerKlLaunch& params) {
  check_params(params);
  if (params.batch.total_q == 0) return 0;
  return make_plan(params).total;
}

void indexer_kl(const IndexerKlLaunch& params, void* workspace, void* stream) {
  check_params(params);
  const auto cuda_stream = static_cast<cudaStream_t>(stream);
  if (params.batch.total_q == 0) {  // no query: zero loss, zero dki
    MSA_CUDA_CHECK(cudaMemsetAsync(params.loss, 0, sizeof(float), cuda_stream));
    if (params.total_k > 0)
      MSA_CUDA_CHECK(cudaMemsetAsync(params.dki, 0,
                                     size_t(params.total_k) * params.index_dim * sizeof(float),
                                     cuda_stream));
    return;
  }
  const KlPlan plan = make_plan(params);
  MSA_CHECK_ARG(workspace != nullptr, "workspace",
                std::to_string(plan.total) + " bytes (indexer_kl_workspace_bytes)", "null");
  char* bytes = static_cast<char*>(workspace);
  // With a teacher given the head dim is not read (kl_given_teacher_kernel<Di> runs).
  const bool wide_q = params.head_dim == 128, wide_index = params.index_dim == 128;
  if (wide_q && wide_index)
    run<128, 128>(params, plan, bytes, cuda_stream);
  else if (wide_q)
    run<128, 64>(params, plan, bytes, cuda_stream);
  else if (wide_index)
    run<64, 128>(params, plan, bytes, cuda_stream);
  else
    run<64, 64>(params, plan, bytes, cuda_stream);
}

}  // namespace msa::cuda
