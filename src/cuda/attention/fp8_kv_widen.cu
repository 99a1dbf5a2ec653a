// The bf16 copy of an fp8 K/V cache for prefill (fp8_kv_widen.h).
#include "cuda/attention/fp8_kv_widen.h"

#include <cuda_fp16.h>

#include "cuda/common/common.cuh"
#include "cuda/common/cuda_check.h"
#include "cuda/common/workspace_layout.h"
#include "cuda/decode/decode_launch.h"
#include "cuda/decode/key_dequant.cuh"
#include "msa/error.h"

namespace msa::cuda {

namespace {

constexpr int kWidenThreads = 128;

struct WidenOperand {
  const uint8_t* codes;  // at the cache layout (strides in bytes)
  KvScales scales;
  int64_t token_stride, head_stride, page_stride;
  const int32_t* page_table;
  int64_t page_table_stride;
  uint16_t* out;  // [batch x max_blocks x B, kv_heads, D]
};

struct WidenArgs {
  WidenOperand k, v;
  const int64_t* k_len;  // [batch]
  int64_t* seq_start;    // [batch]: b x max_blocks x B
  int64_t max_blocks, kv_heads;
  int block_size, head_dim;
};

// Sixteen codes times the scale, rounded to bf16, as two 16-byte words.
__device__ __forceinline__ void widen16(const uint4& codes, float scale, uint4& lo, uint4& hi) {
  const uint32_t words[4] = {codes.x, codes.y, codes.z, codes.w};
  uint32_t packed[8];
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    uint32_t a, b;
    e4m3x4_to_f16x2(words[w], a, b);  // exact
    const float2 fa = __half22float2(*reinterpret_cast<const __half2*>(&a));
    const float2 fb = __half22float2(*reinterpret_cast<const __half2*>(&b));
    packed[2 * w] = pack_bf16(fa.x * scale, fa.y * scale);
    packed[2 * w + 1] = pack_bf16(fb.x * scale, fb.y * scale);
  }
  lo = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  hi = make_uint4(packed[4], packed[5], packed[6], packed[7]);
}

// Grid (max_blocks, kv_heads, batch): block j of head h of sequence b, both operands; blocks
// at or past k_len are left alone (no kernel reads them), tokens past it in the last block are
// written as zeros. 16 codes (one 16-byte load) per thread and step.
__global__ void __launch_bounds__(kWidenThreads) widen_fp8_kv_kernel(const __grid_constant__ WidenArgs a) {
  const int64_t j = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int64_t B = a.block_size;
  const int64_t tokens_per_seq = a.max_blocks * B;
  if (j == 0 && h == 0 && threadIdx.x == 0) a.seq_start[b] = b * tokens_per_seq;
  const int64_t k_len = a.k_len[b];
  if (j * B >= k_len) return;
  const int pieces = a.head_dim / 16;
  for (int i = threadIdx.x; i < B * pieces; i += kWidenThreads) {
    const int t = i / pieces, piece = i % pieces;
    const bool visible = j * B + t < k_len;
    const int64_t out = ((b * tokens_per_seq + j * B + t) * a.kv_heads + h) * a.head_dim + piece * 16;
#pragma unroll
    for (int operand = 0; operand < 2; ++operand) {
      const WidenOperand& o = operand == 0 ? a.k : a.v;
      uint4 lo = make_uint4(0u, 0u, 0u, 0u), hi = lo;
      if (visible) {
        const int64_t page = o.page_table[b * o.page_table_stride + j];
        const uint4 codes = *reinterpret_cast<const uint4*>(o.codes + page * o.page_stride + h * o.head_stride +
                                                            t * o.token_stride + piece * 16);
        const float scale = o.scales.data[page * o.scales.page_stride + h * o.scales.head_stride +
                                          t * o.scales.token_stride];
        widen16(codes, scale, lo, hi);
      }
      uint4* dst = reinterpret_cast<uint4*>(o.out + out);
      dst[0] = lo;
      dst[1] = hi;
    }
  }
}

int64_t max_blocks(const AttentionLaunch& p) { return ceil_div(std::max<int64_t>(1, p.batch.max_k_len), p.k.block_size); }

// Elements of one operand's copy.
size_t copy_elements(const AttentionLaunch& p) {
  return static_cast<size_t>(p.batch.batch * max_blocks(p) * p.k.block_size * p.kv_heads * p.head_dim);
}

struct WidenRegions {
  size_t k = 0, v = 0, seq_start = 0, total = 0;
};

WidenRegions widen_regions(const AttentionLaunch& p) {
  WidenRegions r;
  WorkspaceCursor ws;
  r.k = ws.take(copy_elements(p) * sizeof(uint16_t));
  r.v = ws.take(copy_elements(p) * sizeof(uint16_t));
  r.seq_start = ws.take(static_cast<size_t>(p.batch.batch) * sizeof(int64_t));
  r.total = ws.at;
  return r;
}

}  // namespace

bool attention_widens_fp8(const AttentionLaunch& params) {
  return params.kv_format == KvFormat::fp8 && params.batch.total_q > 0 && !attention_decode_applies(params);
}

size_t fp8_widen_workspace_bytes(const AttentionLaunch& params) { return widen_regions(params).total; }

AttentionLaunch fp8_widened_launch(const AttentionLaunch& params, void* workspace) {
  const WidenRegions r = widen_regions(params);
  char* ws = static_cast<char*>(workspace);
  AttentionLaunch l = params;
  l.kv_format = KvFormat::bf16;
  l.k_fp8 = l.v_fp8 = Fp8Kv{};
  const int64_t B = params.k.block_size, row = params.kv_heads * params.head_dim;
  const auto* seq_start = ws ? reinterpret_cast<const int64_t*>(ws + r.seq_start) : nullptr;
  for (auto [layout, offset] : {std::pair<KeyLayout*, size_t>{&l.k, r.k}, {&l.v, r.v}})
    *layout = KeyLayout{ws ? reinterpret_cast<const uint16_t*>(ws + offset) : nullptr,
                        B, row, params.head_dim, B * row, seq_start, nullptr, 0};
  return l;
}

void widen_fp8_kv(const AttentionLaunch& p, void* workspace, void* stream) {
  const WidenRegions r = widen_regions(p);
  char* ws = static_cast<char*>(workspace);
  MSA_CHECK_ARG(p.head_dim % 16 == 0, "head_dim", "a multiple of 16 for fp8 K/V", p.head_dim);
  const auto operand = [&](const KeyLayout& layout, const Fp8Kv& kv, size_t offset) {
    return WidenOperand{kv.codes,           kv.scales,         layout.token_stride,
                        layout.head_stride, layout.block_stride, layout.page_table,
                        layout.page_table_stride, reinterpret_cast<uint16_t*>(ws + offset)};
  };
  WidenArgs a{operand(p.k, p.k_fp8, r.k), operand(p.v, p.v_fp8, r.v), p.batch.k_len,
              reinterpret_cast<int64_t*>(ws + r.seq_start), max_blocks(p), p.kv_heads,
              static_cast<int>(p.k.block_size), static_cast<int>(p.head_dim)};
  const int64_t blocks = max_blocks(p);
  if (blocks >= (int64_t{1} << 31) || p.kv_heads > 65535 || p.batch.batch > 65535)
    throw_arg_error("batch", "fewer fp8 widening blocks", blocks);
  widen_fp8_kv_kernel<<<dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(p.kv_heads),
                            static_cast<unsigned>(p.batch.batch)),
                       kWidenThreads, 0, static_cast<cudaStream_t>(stream)>>>(a);
  MSA_CUDA_CHECK_LAUNCH();
}

}  // namespace msa::cuda
