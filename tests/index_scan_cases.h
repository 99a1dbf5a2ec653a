// Cases of the prefill index-scan tests (test_cuda_indexer_wgmma.cpp, test_cuda_indexer_fp8.cpp,
// test_ops_index_compute.cpp): M3-shaped index heads, many chunked prefills, and the fp8
// index-compute helpers (MsaParams::index_compute, msa/ops.h).
#pragma once
#include <algorithm>
#include <vector>

#include "msa/quantized_index_keys.h"
#include "op_cases.h"

namespace msa::testing {

// Index heads Hi (the shape's KV heads) with Di = B = 128: the head dim and group of the main
// branch do not matter to the indexer (kept small).
inline CaseShape index_shape(int64_t index_heads, int local, int init, int topk = 16) {
  return make_shape(index_heads, 1, 64, 128, 128, topk, local, init);
}

// The edge-length sequences of `params` plus `count` chunked prefills (1..64 new queries over
// 1..24 blocks of keys, so rankings decide), shuffled: >= 2 tiles per SM, the fused scan mode.
inline std::vector<Seq> edge_and_many_prefills(const MsaParams& params, int count = 320) {
  std::vector<Seq> seqs = mixed_sequences(edge_lengths(params.block_size, params.topk));
  for (int i = 0; i < count; ++i) {
    const int64_t k_len = uniform_int(1, 24 * params.block_size + 3);
    seqs.push_back({.q_len = uniform_int(1, std::min<int64_t>(64, k_len)), .k_len = k_len});
  }
  std::shuffle(seqs.begin(), seqs.end(), rng());
  return seqs;
}

inline MsaParams with_compute(MsaParams params, IndexCompute compute) {
  params.index_compute = compute;
  return params;
}

// x ([..., Di]) through the fp8 recipe of msa/quantized_index_keys.h and back, in `dtype`
// (f64: exact; f32: each value rounded once).
inline Tensor fp8_round_trip(const Tensor& x, DType dtype = DType::f64) {
  const QuantizedIndexKeys q = quantize_index_keys_fp8(x);
  return dequantize_index_keys(q.codes, q.scale, dtype);
}

}  // namespace msa::testing
