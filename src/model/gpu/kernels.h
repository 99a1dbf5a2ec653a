// The small CUDA kernels of the text model's forward (everything except the GEMMs, which
// go through cuBLASLt, and the attention ops of src/cuda/launch.h). Host-only header: plain
// device pointers, bf16 as uint16_t bit patterns, `stream` a cudaStream_t. Each launcher
// checks its launch and throws msa::Error on failure; none synchronises with the host.
#pragma once
#include <cstddef>
#include <cstdint>

namespace msa::model::gpu {

// x[t, :] = f32(table[tokens[t], :]); table bf16 [vocab, hidden]. Ids are checked on the host.
void embed_rows(const uint16_t* table, int64_t hidden, const int32_t* tokens, int64_t count,
                float* x, void* stream);

// Gemma RMSNorm of `rows` f32 rows of `dim`: y = x * rsqrt(mean(x^2) + eps) * (1 + w).
// Input row r is x[source_rows ? source_rows[r] : r]; outputs (either may be null) are
// bf16 and/or f32 [rows, dim].
void rms_norm_rows(const float* x, const int64_t* source_rows, int64_t rows, int64_t dim,
                   const float* weight, float eps, uint16_t* out_bf16, float* out_f32,
                   void* stream);

// Per-head (bias +) Gemma RMSNorm + partial NeoX RoPE + bf16 store, one warp per (token,
// head): the text model's q/k/index-q/index-k path, (norm_weight null, rotary_dim 0) the V
// cache append, and the ViT's q/k/v (bias, no norm, RoPE from a per-token angle table, heads
// zero-padded to the attention kernel's head dim).
struct HeadTransform {
  const float* src = nullptr;  // head h of token t at src + t * src_stride + h * dim (f32)
  int64_t src_stride = 0;
  int64_t tokens = 0, heads = 0, dim = 0;
  const float* bias = nullptr;         // [heads * dim] added to src first, or null
  const float* norm_weight = nullptr;  // [dim] Gemma weight, or null: no norm
  float eps = 1e-6f;
  int64_t rotary_dim = 0;              // RoPE on channels [0, rotary_dim); 0: none
  // Channel i < rotary_dim / 2 turns by angles[t * rotary_dim / 2 + i] when angles is set
  // (f32 [tokens, rotary_dim / 2]), else by f32(positions[t]) * inv_freq[i].
  const float* angles = nullptr;
  const float* inv_freq = nullptr;     // [rotary_dim / 2]
  const int64_t* positions = nullptr;  // [tokens]
  uint16_t* dst = nullptr;             // bf16: [tokens, heads, dst_dim], or a paged cache
  int64_t dst_dim = 0;                 // dense dst only: >= dim, channels [dim, dst_dim) = 0;
                                       //   0 means dim
  const int64_t* slots = nullptr;      // null: dense dst; else dst is [pages, heads, B, dim]
  int64_t block_size = 0;              //   and token t goes to page slots[t] / B, row % B;
                                       //   a negative slot writes nothing (a graph's padding row)
};
void head_norm_rope(const HeadTransform& job, void* stream);
// Up to kMaxHeadTransforms transforms in one launch (a layer's q, k, v, index q, index k).
constexpr int kMaxHeadTransforms = 5;
void head_norm_rope(const HeadTransform* jobs, int count, void* stream);

// act[r, i] = (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit),
// gate = gate_up[r, i], up = gate_up[r, inter + i] (f32 [rows, 2 * inter]); act bf16.
void swiglu_oai(const float* gate_up, int64_t rows, int64_t inter, float alpha, float limit,
                uint16_t* act, void* stream);

void f32_to_bf16(const float* in, int64_t count, uint16_t* out, void* stream);
void add_in_place(float* x, const float* y, int64_t count, void* stream);  // x += y

// ---- the vision tower (cuda_vision.cpp) ----
// LayerNorm of `rows` f32 rows of `dim` (layer_norm.cu): y = (x - mean) / sqrt(var + eps) * w
// + b with the biased variance, f32 math (as model::layer_norm); outputs (either may be
// null) bf16 and/or f32 [rows, dim]; out_f32 may be x itself (in place).
void layer_norm_rows(const float* x, int64_t rows, int64_t dim, const float* weight,
                     const float* bias, float eps, uint16_t* out_bf16, float* out_f32, void* stream);

// y[r, c] + bias[c], then (gelu) the exact erf GELU 0.5 v (1 + erf(v / sqrt 2)) as
// model::gelu_erf (bias_gelu.cu): stored to out_bf16 [rows, cols] when given, and back into
// y (f32) when store_f32.
void bias_gelu(float* y, int64_t rows, int64_t cols, const float* bias, bool gelu,
               uint16_t* out_bf16, bool store_f32, void* stream);

// ---- MoE dispatch (moe_dispatch.cu) and combine (moe_combine.cu) ----
// Routing exactly as src/model/mlp.cpp: per token the top-k experts by sigmoid(logit) +
// correction bias (ties to the lower id), weighted by the sigmoid alone, renormalised to 1
// and times the routed scaling factor. Entries e = t * k + j (j-th choice of token t) are
// then sorted by expert (stable: entry order within an expert), so expert x's rows are
// [offsets[x], offsets[x + 1]) of the permuted buffers.
constexpr int kMaxExpertsPerToken = 16;
constexpr int kMaxRoutedExperts = 512;  // routing keeps a lane's experts in registers
struct MoeDispatch {
  const float* router_logits = nullptr;  // [tokens, experts]
  const float* bias = nullptr;           // [experts]
  const uint16_t* x = nullptr;           // bf16 [tokens, hidden] (the FFN input)
  int64_t tokens = 0, experts = 0, top_k = 0, hidden = 0;
  float routed_scaling = 1;
  // outputs
  float* entry_weight = nullptr;   // [tokens * top_k]
  int32_t* entry_row = nullptr;    // [tokens * top_k]: the entry's row in the permuted buffers
  int32_t* offsets = nullptr;      // [experts + 1]
  uint16_t* x_sorted = nullptr;    // bf16 [tokens * top_k, hidden]: x of each entry's token
};
size_t moe_dispatch_workspace_bytes(int64_t tokens, int64_t top_k, int64_t experts);
void moe_dispatch(const MoeDispatch& job, void* workspace, size_t workspace_bytes, void* stream);

// out[t, :] += sum_j entry_weight[t * k + j] * y_sorted[entry_row[t * k + j], :]
// (f32; j in choice order).
void moe_combine(const float* y_sorted, const float* entry_weight, const int32_t* entry_row,
                 int64_t tokens, int64_t top_k, int64_t hidden, float* out, void* stream);

// The routed experts' weights [experts, out, in] as the expert kernels read them. bf16 is the
// loader's expanded copy; MXFP8 and NVFP4 stay in their release's layout (src/model/mxfp8.h,
// src/model/nvfp4.h) and the kernels widen them to bf16 in registers, exactly (the values of
// model::dequantize_mxfp8, and of dequantize_nvfp4 before its global scale, which the kernels
// apply to the f32 accumulator).
//
// Bytes read per expert at M3's dims (gate_up 2 x 3072 x 6144, down 6144 x 3072: 56.6 M
// weights): bf16 113.2 MB; MXFP8 56.6 MB codes + 1.8 MB UE8M0 scales = 58.4 MB (0.52x); NVFP4
// 28.3 MB codes + 3.5 MB e4m3 scales + 49 KB global scales = 31.9 MB (0.28x). A decode token
// reads 5 routed experts per MoE layer: 566 / 292 / 159 MB, i.e. 162-183 / 83-94 / 46-51 us at
// the bf16 small kernel's measured 3.1-3.5 TB/s (bench/results/h200.md, "The runtime's decode
// step"), if the widening keeps the kernel bound by its reads (to be measured on the H200).
enum class ExpertWeights : uint8_t { bf16, mxfp8, nvfp4 };
struct QuantizedExpertWeights {
  ExpertWeights format = ExpertWeights::bf16;  // bf16: the weights are the job's `w`, these null
  // mxfp8: e4m3 codes [experts, out, in], 16-byte aligned;
  // nvfp4: packed e2m1 [experts, out, in / 2] (channel 2j in the low nibble), 8-byte aligned.
  const uint8_t* codes = nullptr;
  // mxfp8: UE8M0 exponents [experts, out, in / 32] (0..254; 255, E8M0's NaN, is the loader's
  // to refuse); nvfp4: e4m3 scales [experts, out, in / 16].
  const uint8_t* scales = nullptr;
  // nvfp4: f32 [experts, out], the global scale (`_scale_2`) of each output row (a fused
  // gate_up holds gate's and up's in its two halves); mxfp8: null.
  const float* global_scale = nullptr;
};
// Channels per scale block of each format, the multiple `in` must be: 8 for bf16 (the
// kernels' 16-byte chunks), 32 for MXFP8, 16 for NVFP4.
int64_t expert_weights_in_multiple(ExpertWeights format);

// The routed experts' GEMMs of a decode-sized step in one launch, without the row counts on
// the host (moe_experts_small.cu): y[n, :] = w[e(n)] x[n, :] for every sorted row n, e(n) the
// expert whose range [offsets[e], offsets[e + 1]) holds n. For steps of at most
// kMaxSmallMoeEntries token x choice entries; larger steps run moe_experts_grouped or one
// cuBLASLt GEMM per expert (CudaModel::moe_kernel_for).
constexpr int64_t kMaxSmallMoeEntries = 64;
struct MoeSmallGemm {
  const uint16_t* x = nullptr;        // bf16 [entries, in] (rows sorted by expert)
  const uint16_t* w = nullptr;        // bf16 [experts, out, in], or null for quantized weights
  const int32_t* offsets = nullptr;   // [experts + 1], device (from moe_dispatch)
  int64_t entries = 0, experts = 0, in = 0, out = 0;
  float* y = nullptr;                 // f32 [entries, out]
  QuantizedExpertWeights quantized = {};  // format mxfp8 / nvfp4: the weights instead of `w`
};
// Whether moe_experts_small takes this shape (1..kMaxSmallMoeEntries entries, in a positive
// multiple of expert_weights_in_multiple(format), out positive).
bool moe_experts_small_fits(int64_t entries, int64_t in, int64_t out, ExpertWeights format = ExpertWeights::bf16);
// Throws msa::Error naming the argument for shapes it does not take, missing or misaligned
// pointers.
void moe_experts_small(const MoeSmallGemm& job, void* stream);

// The routed experts' GEMMs of any step size in one launch per projection, on tensor cores,
// without the row counts on the host (moe_experts_grouped.cu): the same product as
// moe_experts_small, y[n, :] = w[e(n)] x[n, :] for every sorted row n. Rows outside every
// expert's range (offsets[0] > 0 or offsets[experts] < entries) are not written.
struct MoeGroupedGemm {
  const uint16_t* x = nullptr;        // bf16 [entries, in] (rows sorted by expert), 16-byte aligned
  const uint16_t* w = nullptr;        // bf16 [experts, out, in], 16-byte aligned, or null for quantized weights
  const int32_t* offsets = nullptr;   // [experts + 1], device, non-decreasing (from moe_dispatch)
  int64_t entries = 0, experts = 0;
  int64_t in = 0;                     // a positive multiple of expert_weights_in_multiple(format)
  int64_t out = 0;                    // positive
  float* y = nullptr;                 // f32 [entries, out]
  QuantizedExpertWeights quantized = {};  // format mxfp8 / nvfp4: the weights instead of `w`
};
// Whether moe_experts_grouped takes these dims (in a positive multiple of
// expert_weights_in_multiple(format), out positive and at most 65535 output tiles).
bool moe_experts_grouped_fits(int64_t in, int64_t out, ExpertWeights format = ExpertWeights::bf16);
// The launch's (expert, row tile) capacity: ceil(entries / tile rows) + min(experts, entries),
// an upper bound on the work items of any routing of `entries` rows.
int64_t moe_grouped_work_items(int64_t entries, int64_t experts);
// Throws msa::Error naming the argument for dims it does not take, missing or misaligned
// pointers.
void moe_experts_grouped(const MoeGroupedGemm& job, void* stream);

}  // namespace msa::model::gpu
