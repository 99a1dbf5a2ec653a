// Paged cases with fp8 K/V caches (msa/quantized_kv_cache.h), shared by the CPU tests
// (test_fp8_kv_cache.cpp) and the GPU tests (test_cuda_fp8_kv.cpp): a float case paged as
// usual, then its whole K and V caches quantized (garbage slots too), with the float cache of
// the dequantized values beside it (what Impl::cpu must equal bit for bit).
#pragma once
#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "msa/quantized_kv_cache.h"
#include "op_cases.h"

namespace msa::testing {

inline constexpr KvScaleLayout kKvScaleLayouts[] = {KvScaleLayout::per_token_head,
                                                    KvScaleLayout::per_tensor};

inline std::string layout_name(KvScaleLayout layout) {
  return std::string(kv_scale_layout_name(layout));
}

// The per-tensor scale a calibration would give `values`: amax / 448 over every element
// (a positive value for any non-zero tensor).
inline float per_tensor_scale_of(const Tensor& values) {
  const Tensor f32 = values.to(DType::f32);
  float amax = 0;
  for (float x : f32.span<float>()) amax = std::max(amax, std::fabs(x));
  return amax > 0 ? amax / 448.0f : 1.0f;
}

inline QuantizedKv quantize_kv_as(const Tensor& values, KvScaleLayout layout) {
  return layout == KvScaleLayout::per_tensor ? quantize_kv_fp8(values, per_tensor_scale_of(values))
                                             : quantize_kv_fp8(values);
}

// `cache` with its K and V quantized whole in `layout` (every page, used or not).
inline PagedKvCache fp8_kv_cache(const PagedKvCache& cache, KvScaleLayout layout) {
  PagedKvCache out = cache;
  const QuantizedKv k = quantize_kv_as(cache.k_cache, layout), v = quantize_kv_as(cache.v_cache, layout);
  out.k_cache = k.codes;
  out.k_scale = k.scale;
  out.v_cache = v.codes;
  out.v_scale = v.scale;
  return out;
}

// The float cache of an fp8 one: the dequantized K and V in `dtype`, no scales.
inline PagedKvCache dequantized_kv_cache(const PagedKvCache& fp8, DType dtype = DType::f32) {
  PagedKvCache out = fp8;
  out.k_cache = dequantize_kv(fp8.k_cache, fp8.k_scale, dtype);
  out.v_cache = dequantize_kv(fp8.v_cache, fp8.v_scale, dtype);
  out.k_scale = Tensor();
  out.v_scale = Tensor();
  return out;
}

// The float cache of an fp8 case is dequantized_kv_cache(paged.cache) (f32: what Impl::cpu on
// the fp8 cache equals bit for bit).
struct Fp8KvCase {
  VarlenCase c;
  PagedRequests paged;       // k_cache / v_cache: e4m3 codes with k_scale / v_scale
  PagedKvCache float_cache;  // the same requests with the original float K/V (before quantization)
  KvScaleLayout layout = KvScaleLayout::per_token_head;
};

inline Fp8KvCase make_fp8_kv_case(VarlenCase c, KvScaleLayout layout) {
  Fp8KvCase out;
  out.layout = layout;
  out.paged = page_varlen_case(c);
  out.float_cache = out.paged.cache;
  out.paged.cache = fp8_kv_cache(out.float_cache, layout);
  out.c = std::move(c);
  return out;
}

// ---- caches for append_kv_cache ----

// A cache of `pages` pages [pages, H, B, D], fp8 in `layout` or float of `dtype`, filled with
// garbage: random codes (never the NaN code) and positive scales, or random values. Its page
// table and lengths are placeholders (append_kv_cache reads neither).
inline PagedKvCache garbage_cache(int64_t pages, int64_t H, int64_t B, int64_t D, bool fp8,
                                  KvScaleLayout layout, DType dtype = DType::f32) {
  PagedKvCache cache;
  cache.page_table = Tensor::zeros({1, pages}, DType::i32);
  cache.seq_lens = Tensor::zeros({1}, DType::i32);
  if (!fp8) {
    cache.k_cache = random_normal({pages, H, B, D}, 1.0, dtype);
    cache.v_cache = random_normal({pages, H, B, D}, 1.0, dtype);
    return cache;
  }
  for (Tensor* t : {&cache.k_cache, &cache.v_cache}) {
    *t = Tensor::zeros({pages, H, B, D}, DType::e4m3);
    uint8_t* bytes = static_cast<uint8_t*>(t->raw());
    for (int64_t i = 0; i < t->numel(); ++i) bytes[i] = static_cast<uint8_t>(uniform_int(0, 255) & 0xf7);
  }
  const Shape scale_shape = layout == KvScaleLayout::per_tensor ? Shape{1} : Shape{pages, H, B};
  for (Tensor* t : {&cache.k_scale, &cache.v_scale}) {
    *t = random_normal(scale_shape, 1.0);
    for (float& s : t->span<float>()) s = std::fabs(s) + 0.01f;
  }
  return cache;
}

// A copy of the cache's K/V tensors and scales (the page table and lengths shared).
inline PagedKvCache clone_cache(const PagedKvCache& cache) {
  PagedKvCache out = cache;
  for (Tensor* t : {&out.k_cache, &out.v_cache, &out.k_scale, &out.v_scale})
    if (t->defined()) *t = t->clone();
  return out;
}

// `tokens` distinct slots of a cache of `slots_total`, shuffled, every 5th token padding (-1).
inline Tensor random_slots(int64_t tokens, int64_t slots_total, DType dtype = DType::i64) {
  std::vector<int64_t> all(static_cast<size_t>(slots_total));
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng());
  Tensor slots = Tensor::zeros({tokens}, dtype);
  for (int64_t t = 0; t < tokens; ++t) slots.set(t, t % 5 == 4 ? -1.0 : static_cast<double>(all[t]));
  return slots;
}

// Sets every element of an fp8 cache that holds none of its requests' tokens (spare pages,
// the tail of a partial last page) to the e4m3 NaN code 0x7f and, per token and head, its
// scales to NaN: an op that reads one returns NaN somewhere.
inline void poison_unused_fp8_slots(PagedKvCache& cache) {
  const int64_t pages = cache.k_cache.size(0), H = cache.k_cache.size(1), B = cache.k_cache.size(2),
                D = cache.k_cache.size(3);
  const std::vector<int64_t> used_slots = used_page_prefixes(cache);
  for (const auto& [codes, scale] : {std::pair{&cache.k_cache, &cache.k_scale}, {&cache.v_cache, &cache.v_scale}}) {
    uint8_t* bytes = static_cast<uint8_t*>(codes->raw());
    const bool per_token = scale->dim() == 3;
    for (int64_t page = 0; page < pages; ++page)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t slot = used_slots[page]; slot < B; ++slot) {
          std::fill(bytes + ((page * H + h) * B + slot) * D, bytes + ((page * H + h) * B + slot + 1) * D,
                    uint8_t{0x7f});
          if (per_token) scale->data<float>()[(page * H + h) * B + slot] = std::nanf("");
        }
  }
}

// Decode requests (Q = 1..16) at lengths around B and k * B, and a few longer ones.
inline std::vector<Seq> decode_requests(const CaseShape& shape) {
  const int64_t B = shape.params.block_size, kb = B * shape.params.topk;
  std::vector<Seq> seqs = {{.q_len = 1, .k_len = kb + 3 * B + 1}, {.q_len = 16, .k_len = kb + 2 * B - 1},
                           {.q_len = 2, .k_len = 2},              {.q_len = 8, .k_len = 5 * kb + 17},
                           {.q_len = 16, .k_len = 16},            {.q_len = 3, .k_len = kb + B / 2 + 7},
                           {.q_len = 1, .k_len = B - 1},          {.q_len = 1, .k_len = B},
                           {.q_len = 1, .k_len = B + 1},          {.q_len = 4, .k_len = kb - 1},
                           {.q_len = 5, .k_len = kb},             {.q_len = 7, .k_len = kb + 1}};
  for (Seq& s : seqs) s.k_len = std::max(s.k_len, s.q_len);  // tiny B * k
  return seqs;
}

// Plants `count` keys per request that the request's LAST query attends to almost alone: key
// rows set to the direction of the sum of that query's group heads, scaled so the logits
// stand ~`margin` above the rest (a few keys aligned with the query: the structure of real
// attention, where fp8's error in the winning values matters most). Returns the planted
// (request, token) pairs.
inline std::vector<std::pair<int64_t, int64_t>> plant_aligned_keys(VarlenCase& c, int count,
                                                                   double margin = 12.0) {
  std::vector<std::pair<int64_t, int64_t>> planted;
  const int64_t H = c.shape.kv_heads, G = c.shape.group, D = c.shape.head_dim;
  Tensor k = c.k.to(DType::f32);
  const Tensor q = c.q.to(DType::f32);
  float* keys = k.data<float>();
  const float* queries = q.data<float>();
  const double scale = c.params().scale != 0 ? c.params().scale : 1.0 / std::sqrt(double(D));
  int64_t last_row = -1;
  for (size_t b = 0; b < c.seqs.size(); ++b) {
    last_row += c.seqs[b].q_len;
    if (c.seqs[b].q_len == 0) continue;
    const int64_t pos = c.row_pos[last_row];
    for (int i = 0; i < count && i <= pos; ++i) {
      const int64_t t = (pos * (i + 1)) / (count + 1);  // spread over the context
      planted.push_back({static_cast<int64_t>(b), t});
      for (int64_t g = 0; g < H; ++g) {
        std::vector<double> direction(static_cast<size_t>(D), 0.0);
        for (int64_t r = 0; r < G; ++r)
          for (int64_t d = 0; d < D; ++d)
            direction[d] += queries[(last_row * H * G + g * G + r) * D + d];
        double norm = 0;
        for (double x : direction) norm += x * x;
        norm = std::sqrt(std::max(norm, 1e-30));
        // The group's mean logit on the key is scale * |k| * |sum of q| / G: `margin`.
        const double length = margin * double(G) / (scale * norm);
        float* row = keys + ((c.k_start[b] + t) * H + g) * D;
        for (int64_t d = 0; d < D; ++d) row[d] = static_cast<float>(direction[d] / norm * length);
      }
    }
  }
  c.k = k.to(c.k.dtype());
  return planted;
}

}  // namespace msa::testing
