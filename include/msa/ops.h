// The MSA operators on host tensors (the math: docs/msa.md; a table: README.md). The device
// API for CUDA callers with their own device buffers and streams is msa/cuda/*.h.
//
// Layouts (all contiguous; "total_q"/"total_k" are packed varlen token counts):
//   q  [total_q, Hq, D]    k, v [total_k, Hkv, D]     qi [total_q, Hi, Di]   ki [total_k, Di]
//   cu_seqlens_q / cu_seqlens_k: int32 [batch + 1], non-decreasing, starting at 0.
//   Queries of sequence b are the suffix of its keys: pos(b, i) = k_len_b - q_len_b + i.
//   topk (selection rows): int32 [Hkv, total_q, k], logical block ids, -1 suffix,
//   the query's own (local) block in the last valid slot.
//   lse: attention [total_q, Hq]; indexer [Hi, total_q]; natural log; -inf for empty sets.
// Float inputs may be f32, bf16, f16 or f64. Outputs are new tensors (inputs are never
// written): f32, or f64 when Impl::reference is given f64 queries (for gradient checks).
// Every op validates its arguments first and throws msa::Error naming the bad one.
// Non-finite inputs (NaN, +-inf in float tensors): the results are unspecified (they may be
// NaN, -inf or finite-looking, and differ between Impls), but an op never crashes, never
// reads or writes out of bounds, and every selection id it returns is -1 or a block of the
// query's causal range. The kernels do not scan for them; `msa op` does (it refuses a
// non-finite input naming the tensor and index), and `msa logits|run --check-weights` scans
// a checkpoint.
#pragma once
#include <cstdint>

#include "msa/cuda/types.h"
#include "msa/tensor.h"

namespace msa {

// Which implementation runs an op. `reference` is the spec as plain loops in f64;
// `cpu` the optimised, multi-threaded one; `cuda` the GPU kernels (when built with CUDA).
enum class Impl : uint8_t { reference, cpu, cuda };
std::string_view impl_name(Impl impl);
Impl impl_from_name(std::string_view name);  // "reference" | "cpu" | "cuda"
bool impl_available(Impl impl);

// How the index scan computes the token scores it ranks blocks by (docs/msa.md §3).
//   exact: s(t) = qi . ki(t) on the inputs (f64 reference, f32 cpu, bf16 products with f32
//          accumulation on CUDA).
//   fp8:   both sides quantized to e4m3 with one f32 scale each, by the fp8 recipe of
//          msa/quantized_index_keys.h (scale = amax / 448, code = e4m3_rne_saturating(x /
//          scale)): qi per (query, index head) row of Di values, ki per token (an fp8 paged
//          cache is used as stored; float keys are quantized first), and
//          s(t) = q_scale * k_scale(t) * sum_d qcode[d] * kcode(t)[d]. Only the SELECTION
//          uses these scores; the selected LSE (training) stays the exact one of the inputs
//          over the selected blocks (the indexer KL's student scores are exact too).
//          Impl::reference computes it in f64 on the dequantized values, Impl::cpu in f32 on
//          them (its indexer kernels ranking by the dequantized copies); Impl::cuda runs the
//          fp8 warpgroup-MMA scan (Di = B = 128; other shapes raise msa::Error; decode-sized
//          batches take the same tile scan, correct but not tuned for them).
//          CUDA reads float inputs as bf16 (as everywhere), so it quantizes bf16(qi), bf16(ki).
//          fp4 index-key caches are rejected (quantize to fp8 keys or use exact).
enum class IndexCompute : uint8_t { exact, fp8 };
std::string_view index_compute_name(IndexCompute compute);      // "exact" | "fp8"
IndexCompute index_compute_from_name(std::string_view name);   // throws msa::Error

// The CUDA kernels' engine choices (msa::cuda::IndexerParams / AttentionParams /
// AttentionBackwardParams fields of the same names).
struct CudaEngines {
  cuda::Engine index_scan = cuda::Engine::automatic;  // prefill index scan
  cuda::IndexRanking index_ranking = cuda::IndexRanking::automatic;  // prefill: in the scan or separate
  cuda::Engine sparse = cuda::Engine::automatic;      // sparse prefill attention
  cuda::TileLoad sparse_q_load = cuda::TileLoad::automatic;
  cuda::SparseOrder sparse_order = cuda::SparseOrder::automatic;  // sparse prefill's work order
  cuda::Engine dense = cuda::Engine::automatic;       // dense prefill attention
  cuda::Engine backward = cuda::Engine::automatic;    // attention backward's dK / dV kernel
  // > 0 caps the query chunks of the sparse forward and backward and the index branch's
  // separate-ranking passes (bounded workspaces; tests force several chunks with it).
  int64_t max_chunk_queries = 0;
};

struct MsaParams {
  int block_size = 128;    // B: tokens per block (= KV page)
  int topk = 16;           // k: selected blocks per (query, KV group)
  int local_blocks = 1;    // blocks ending at the query's own block, always selected
  int init_blocks = 0;     // blocks at the sequence start, always selected
  double scale = 0;        // main softmax scale; 0 means 1/sqrt(D)
  double index_scale = 0;  // index-score scale for the selected LSE and KL; 0 means 1/sqrt(Di)
  double temperature = 1;  // index softmax temperature T (selected LSE and KL student)
  double kl_coefficient = 1;  // c in the KL loss
  // Backward ops on CUDA (gradients with many writers: dq of sparse/dense_attention_backward,
  // dki of indexer_kl): true sums in a fixed order, so repeated runs are bitwise identical;
  // false uses atomicAdd (faster, the float summation order then varies run to run). The
  // attention backward's dk / dv are summed in a fixed order, hence deterministic, in both modes. The
  // CPU and reference are always deterministic.
  bool deterministic = true;
  // Index-score precision of the selection (see IndexCompute): exact by default; fp8 is an
  // explicit opt-in (faster on Hopper, may select different near-tie blocks).
  IndexCompute index_compute = IndexCompute::exact;
  // Causal masking of the dense attention ops (dense_attention, dense_attention_backward,
  // paged_dense_attention): true, a query at position p sees keys 0 .. p; false
  // (bidirectional), every query sees every key of its sequence, as a vision tower attends
  // within one image (cu_seqlens delimit the images). The MSA ops (indexer, the sparse ops,
  // indexer_kl, paged_msa_attention) are causal by definition and reject false with
  // msa::Error, as does Impl::cuda for now (its dense kernels are causal only).
  bool causal = true;
  // Kernel choices of Impl::cuda (msa/cuda/types.h): the measured defaults unless a test or
  // benchmark pins one. Impl::cpu and Impl::reference ignore them.
  CudaEngines cuda;
};

// Throws msa::Error if a field is out of its documented range.
void validate_params(const MsaParams& params);

struct IndexerOutput {
  Tensor topk;  // int32 [Hi, total_q, k]
  Tensor lse;   // [Hi, total_q] selected LSE of iscale * s / T (undefined when not requested)
};
struct AttentionOutput {
  Tensor o;    // [total_q, Hq, D]
  Tensor lse;  // [total_q, Hq]
};
struct AttentionGrads {
  Tensor dq;  // [total_q, Hq, D]
  Tensor dk;  // [total_k, Hkv, D]  (summed over the group's query heads)
  Tensor dv;  // [total_k, Hkv, D]
};
struct IndexerKlOutput {
  Tensor loss;  // scalar (shape [])
  Tensor dqi;   // [total_q, Hi, Di]
  Tensor dki;   // [total_k, Di]
};

// ---- varlen (training / packed prefill) forms ----
IndexerOutput indexer(const Tensor& qi, const Tensor& ki, const Tensor& cu_seqlens_q,
                      const Tensor& cu_seqlens_k, const MsaParams& params, Impl impl);

AttentionOutput sparse_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                 const Tensor& topk, const Tensor& cu_seqlens_q,
                                 const Tensor& cu_seqlens_k, const MsaParams& params, Impl impl);

AttentionGrads sparse_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                         const Tensor& topk, const Tensor& o, const Tensor& lse,
                                         const Tensor& grad_o, const Tensor& cu_seqlens_q,
                                         const Tensor& cu_seqlens_k, const MsaParams& params,
                                         Impl impl);

// `lse` is the main branch's [total_q, Hq] from sparse_attention.
IndexerKlOutput indexer_kl(const Tensor& q, const Tensor& k, const Tensor& lse, const Tensor& qi,
                           const Tensor& ki, const Tensor& topk, const Tensor& cu_seqlens_q,
                           const Tensor& cu_seqlens_k, const MsaParams& params, Impl impl);

AttentionOutput dense_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k,
                                const MsaParams& params, Impl impl);

AttentionGrads dense_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                        const Tensor& o, const Tensor& lse, const Tensor& grad_o,
                                        const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k,
                                        const MsaParams& params, Impl impl);

// ---- paged (inference) forms: chunked prefill over a cached prefix, and decode ----
// The new tokens' K/V/index keys are already in the cache. For request b the cache holds
// seq_lens[b] tokens (prefix + new); its q_len_b = cu_seqlens_q[b+1] - cu_seqlens_q[b] new
// queries sit at positions seq_lens[b] - q_len_b + i. Decode is q_len 1..16.
struct PagedKvCache {
  Tensor k_cache;          // [pages, Hkv, B, D] float, or e4m3 codes (fp8, see k_scale)
  Tensor v_cache;          // [pages, Hkv, B, D] float, or e4m3 codes (fp8, see v_scale)
  Tensor index_key_cache;  // [pages, B, Di]   (one shared index-key head)
  Tensor page_table;       // int32 [batch, max_pages]: logical block -> physical page
  Tensor seq_lens;         // int32 [batch]
  // Quantized index keys (msa/quantized_index_keys.h): undefined for float index keys; with
  // e4m3 index_key_cache [pages, B, Di] an f32 [pages, B] (fp8, one scale per token); with
  // u8 index_key_cache [pages, B, Di/2] an e4m3 [pages, B, Di/16] (fp4, NVFP4-style).
  // paged_indexer scores against the dequantized keys; Impl::cuda reads the codes directly
  // on its decode path (every q_len <= 16) and raises msa::Error elsewhere.
  Tensor index_key_scale = {};  // initialised: aggregate initialisers may omit it
  // fp8 K/V (msa/quantized_kv_cache.h, docs/msa.md §6.6): undefined for float k_cache /
  // v_cache; with e4m3 caches the f32 scales, each in one of two layouts (vLLM's):
  //   per token and head  [pages, Hkv, B]:  k = e4m3(k_cache[p][h][t][d]) * k_scale[p][h][t]
  //   per tensor          [1]:              k = e4m3(k_cache[p][h][t][d]) * k_scale[0]
  // (v likewise). K and V are both fp8 or both float. The attention ops read the dequantized
  // values: Impl::reference dequantizes to f64, Impl::cpu reads the codes block by block,
  // Impl::cuda reads the codes on its decode path (every q_len <= 16) and widens them into a
  // bf16 copy for longer queries (prefill; e4m3 x scale rounded to bf16).
  Tensor k_scale = {};
  Tensor v_scale = {};
};

// Writes T new tokens' keys and values into a paged cache, before the attention call that
// reads them (docs/msa.md §6.2): token t goes to page slot_mapping[t] / B, row
// slot_mapping[t] % B, every KV head (vLLM's slot mapping; B = k_cache.size(2)); a negative
// slot skips the token (padding). k, v: float [T, Hkv, D]; slot_mapping: int64 or int32 [T].
// A float cache stores the values rounded to its dtype. An fp8 cache quantizes them by the
// rule of msa/quantized_kv_cache.h: per token and head, each (token, head) row gets its own
// scale amax / 448, stored in k_scale / v_scale [page, head, row]; per tensor, the cache's own
// k_scale[0] / v_scale[0] (positive and finite) divide the values. The cache tensors are
// written in place (they are views: every copy of the PagedKvCache sees the new tokens); no
// other element changes. Checks: shapes and dtypes against the cache, slots in
// [0, pages * B) and distinct, fp8 values finite; nothing is written when a check fails.
// Impl::reference and Impl::cpu write the same bytes; Impl::cuda runs the device kernel
// (msa::cuda::append_kv_fp8, msa/cuda/quantize.h; fp8 caches only) on a device copy of the
// cache and copies it back (for tests; a serving engine calls the device API on its cache).
void append_kv_cache(PagedKvCache& cache, const Tensor& k, const Tensor& v,
                     const Tensor& slot_mapping, Impl impl);

IndexerOutput paged_indexer(const Tensor& qi, const PagedKvCache& cache,
                            const Tensor& cu_seqlens_q, const MsaParams& params, Impl impl,
                            bool want_lse = false);

AttentionOutput paged_sparse_attention(const Tensor& q, const PagedKvCache& cache,
                                       const Tensor& topk, const Tensor& cu_seqlens_q,
                                       const MsaParams& params, Impl impl);

AttentionOutput paged_dense_attention(const Tensor& q, const PagedKvCache& cache,
                                      const Tensor& cu_seqlens_q, const MsaParams& params,
                                      Impl impl);

// MSA in one call over a paged cache: the indexer, then sparse attention over its rows. Where
// every request's context is <= topk * block_size, every visible block would be selected and
// MSA is dense causal attention exactly (docs/msa.md §4): then the indexer is skipped and the dense
// path runs, so MSA is never slower than dense; `topk` is then left undefined.
struct MsaOutput {
  Tensor topk;  // int32 [Hkv, total_q, k], or undefined when the dense path ran
  AttentionOutput attention;
};
// The rule itself, shared by every op that dispatches on it (paged_msa_attention, the CUDA
// msa_forward and DecodePlan, the Python ops): every context of at most topk * block_size keys.
constexpr bool msa_equals_dense(int64_t max_context, int64_t topk, int64_t block_size) {
  return max_context <= topk * block_size;
}
bool msa_equals_dense(const PagedKvCache& cache, const MsaParams& params);
MsaOutput paged_msa_attention(const Tensor& q, const Tensor& qi, const PagedKvCache& cache,
                              const Tensor& cu_seqlens_q, const MsaParams& params, Impl impl);

// Threads used by Impl::cpu (default: all cores). 0 restores the default.
void set_num_threads(int threads);
int num_threads();

}  // namespace msa
