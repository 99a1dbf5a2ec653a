#include "checks.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

namespace msa::detail {

namespace {
std::string expected_shape_string(std::initializer_list<int64_t> expected) {
  std::string out = "shape [";
  bool first = true;
  for (int64_t extent : expected) {
    if (!first) out += ", ";
    out += extent < 0 ? std::string("*") : std::to_string(extent);
    first = false;
  }
  return out + "]";
}

const int32_t* int32_data(const Tensor& tensor) { return tensor.data<int32_t>(); }
}  // namespace

void check_shape(const Tensor& tensor, const std::string& name,
                 std::initializer_list<int64_t> expected) {
  if (!tensor.defined()) throw_arg_error(name, "a tensor", "nothing");
  if (tensor.device() != Device::cpu)
    throw_arg_error(name, "a cpu tensor", std::string(device_name(tensor.device())) + " tensor");
  bool ok = tensor.dim() == static_cast<int64_t>(expected.size());
  if (ok) {
    size_t axis = 0;
    for (int64_t extent : expected) {
      if (extent >= 0 && tensor.shape()[axis] != extent) ok = false;
      ++axis;
    }
  }
  if (!ok) throw_arg_error(name, expected_shape_string(expected), shape_string(tensor.shape()));
  if (!tensor.is_contiguous()) throw_arg_error(name, "a contiguous tensor", "a strided view");
}

void check_float(const Tensor& tensor, const std::string& name) {
  const DType dtype = tensor.dtype();
  if (dtype != DType::f32 && dtype != DType::f64 && dtype != DType::bf16 && dtype != DType::f16)
    throw_arg_error(name, "dtype f32, bf16, f16 or f64", dtype_name(dtype));
}

void check_int32(const Tensor& tensor, const std::string& name) {
  if (tensor.dtype() != DType::i32) throw_arg_error(name, "dtype i32", dtype_name(tensor.dtype()));
}

namespace {
// Validates one cu_seqlens tensor and returns its offsets.
std::vector<int64_t> offsets(const Tensor& cu_seqlens, const std::string& name, int64_t total) {
  check_shape(cu_seqlens, name, {-1});
  check_int32(cu_seqlens, name);
  const int64_t count = cu_seqlens.size(0);
  if (count < 2) throw_arg_error(name, "at least 2 entries (batch + 1)", count);
  const int32_t* values = int32_data(cu_seqlens);
  if (values[0] != 0) throw_arg_error(name + "[0]", "0", values[0]);
  std::vector<int64_t> out(count);
  for (int64_t i = 0; i < count; ++i) {
    out[i] = values[i];
    if (i > 0 && values[i] < values[i - 1])
      throw_arg_error(name, "non-decreasing offsets",
                      "[" + std::to_string(i - 1) + "]=" + std::to_string(values[i - 1]) + " > [" +
                          std::to_string(i) + "]=" + std::to_string(values[i]));
  }
  if (out.back() != total)
    throw_arg_error(name + "[" + std::to_string(count - 1) + "]",
                    "the packed token count " + std::to_string(total), out.back());
  return out;
}

void fill_seq_of_query(Batch& batch) {
  batch.seq_of_query.resize(static_cast<size_t>(batch.total_q()));
  for (int64_t b = 0; b < batch.size(); ++b)
    for (int64_t row = batch.q_start[b]; row < batch.q_start[b + 1]; ++row)
      batch.seq_of_query[row] = static_cast<int32_t>(b);
}
}  // namespace

Batch varlen_batch(const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k, int64_t total_q,
                   int64_t total_k) {
  Batch batch;
  batch.q_start = offsets(cu_seqlens_q, "cu_seqlens_q", total_q);
  const std::vector<int64_t> k_start = offsets(cu_seqlens_k, "cu_seqlens_k", total_k);
  if (k_start.size() != batch.q_start.size())
    throw_arg_error("cu_seqlens_k", std::to_string(batch.q_start.size()) +
                                        " entries (as cu_seqlens_q)",
                    k_start.size());
  for (size_t b = 0; b + 1 < k_start.size(); ++b) {
    const int64_t k_len = k_start[b + 1] - k_start[b];
    const int64_t q_len = batch.q_start[b + 1] - batch.q_start[b];
    if (q_len > k_len)
      throw_arg_error("cu_seqlens_q", "sequence " + std::to_string(b) + " to have at most its " +
                                          std::to_string(k_len) + " keys as queries",
                      q_len);
    batch.k_len.push_back(k_len);
    batch.k_start.push_back(k_start[b]);
  }
  fill_seq_of_query(batch);
  return batch;
}

Batch paged_batch(const Tensor& cu_seqlens_q, const Tensor& seq_lens, const Tensor& page_table,
                  int64_t num_pages, int64_t block_size, int64_t total_q) {
  Batch batch;
  batch.q_start = offsets(cu_seqlens_q, "cu_seqlens_q", total_q);
  const int64_t count = static_cast<int64_t>(batch.q_start.size()) - 1;
  check_shape(seq_lens, "seq_lens", {count});
  check_int32(seq_lens, "seq_lens");
  check_shape(page_table, "page_table", {count, -1});
  check_int32(page_table, "page_table");
  const int64_t max_pages = page_table.size(1);
  const int32_t* lens = int32_data(seq_lens);
  const int32_t* pages = int32_data(page_table);
  for (int64_t b = 0; b < count; ++b) {
    const int64_t q_len = batch.q_start[b + 1] - batch.q_start[b];
    if (lens[b] < q_len)
      throw_arg_error("seq_lens[" + std::to_string(b) + "]",
                      "at least the request's " + std::to_string(q_len) + " new tokens", lens[b]);
    const int64_t used_pages = (lens[b] + block_size - 1) / block_size;
    if (used_pages > max_pages)
      throw_arg_error("page_table", "at least " + std::to_string(used_pages) +
                                        " pages per request (request " + std::to_string(b) +
                                        " holds " + std::to_string(lens[b]) + " tokens)",
                      std::to_string(max_pages) + " columns");
    for (int64_t j = 0; j < used_pages; ++j) {
      const int32_t page = pages[b * max_pages + j];
      if (page < 0 || page >= num_pages)
        throw_arg_error("page_table[" + std::to_string(b) + "][" + std::to_string(j) + "]",
                        "a page id in [0, " + std::to_string(num_pages) + ")", page);
    }
    batch.k_len.push_back(lens[b]);
  }
  fill_seq_of_query(batch);
  return batch;
}

void check_selection(const Tensor& topk, const Batch& batch, int64_t groups, int64_t block_size) {
  check_shape(topk, "topk", {groups, batch.total_q(), -1});
  check_int32(topk, "topk");
  const int64_t k = topk.size(2);
  if (k < 1) throw_arg_error("topk", "at least one slot per row", k);
  const int32_t* rows = int32_data(topk);
  std::vector<int64_t> seen_at;  // block id -> row index + 1 where last seen (dedup without sorting)
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t row = 0; row < batch.total_q(); ++row) {
      const int64_t own_block = batch.pos(row) / block_size;
      if (static_cast<int64_t>(seen_at.size()) <= own_block) seen_at.resize(own_block + 1, -1);
      const int32_t* entries = rows + (g * batch.total_q() + row) * k;
      const int64_t stamp = g * batch.total_q() + row;
      bool ended = false;
      for (int64_t slot = 0; slot < k; ++slot) {
        const int32_t id = entries[slot];
        const std::string where = "topk[" + std::to_string(g) + "][" + std::to_string(row) +
                                  "][" + std::to_string(slot) + "]";
        if (id == -1) {
          ended = true;
          continue;
        }
        if (ended) throw_arg_error(where, "-1 (unused slots form a suffix)", id);
        if (id < 0 || id > own_block)
          throw_arg_error(where, "a block id in [0, " + std::to_string(own_block) +
                                     "] (the query's own block) or -1",
                          id);
        if (seen_at[id] == stamp) throw_arg_error(where, "a block id not already in the row", id);
        seen_at[id] = stamp;
      }
    }
  }
}

AttentionDims check_qkv(const Tensor& q, const Tensor& k, const Tensor& v) {
  check_shape(q, "q", {-1, -1, -1});
  check_float(q, "q");
  const int64_t head_dim = q.size(2);
  check_shape(k, "k", {-1, -1, head_dim});
  check_float(k, "k");
  check_shape(v, "v", {k.size(0), k.size(1), head_dim});
  check_float(v, "v");
  AttentionDims dims{.q_heads = q.size(1), .kv_heads = k.size(1), .head_dim = head_dim};
  if (dims.kv_heads < 1) throw_arg_error("k", "at least one KV head", dims.kv_heads);
  if (dims.q_heads < 1 || dims.q_heads % dims.kv_heads != 0)
    throw_arg_error("q", "a head count that is a positive multiple of k's " +
                             std::to_string(dims.kv_heads) + " KV heads",
                    dims.q_heads);
  if (head_dim < 1) throw_arg_error("q", "a positive head dim", head_dim);
  return dims;
}

IndexKeyFormat check_paged_index_keys(const PagedKvCache& cache, int64_t block_size,
                                      int64_t index_dim) {
  const Tensor& keys = cache.index_key_cache;
  const Tensor& scale = cache.index_key_scale;
  if (!keys.defined()) throw_arg_error("index_key_cache", "a tensor", "nothing");
  const bool fp8 = keys.dtype() == DType::e4m3, fp4 = keys.dtype() == DType::u8;
  if (!fp8 && !fp4) {
    check_shape(keys, "index_key_cache", {-1, block_size, index_dim});
    check_float(keys, "index_key_cache");
    if (scale.defined())
      throw_arg_error("index_key_scale",
                      "nothing for " + std::string(dtype_name(keys.dtype())) +
                          " index keys (a scale goes with e4m3 (fp8) or u8 (fp4) codes)",
                      "a tensor of shape " + shape_string(scale.shape()));
    return IndexKeyFormat::plain;
  }
  if (fp4 && index_dim % 16 != 0)
    throw_arg_error("qi", "an index head dim that is a multiple of 16 (fp4 index keys: one "
                          "scale per 16 channels)",
                    index_dim);
  check_shape(keys, "index_key_cache", {-1, block_size, fp8 ? index_dim : index_dim / 2});
  const IndexKeyFormat format = index_key_format_of(keys, scale);  // scale dtype and shape
  if (fp8)
    check_shape(scale, "index_key_scale", {keys.size(0), block_size});
  else
    check_shape(scale, "index_key_scale", {keys.size(0), block_size, index_dim / 16});
  return format;
}

namespace {
// One of k_cache / v_cache (`which` = "k" or "v") with its scale, shapes already checked.
void check_kv_dtype(const Tensor& values, const Tensor& scale, const std::string& which, bool fp8) {
  const std::string cache_name = which + "_cache", scale_name = which + "_scale";
  if (!fp8) {
    const DType dtype = values.dtype();
    if (dtype != DType::f32 && dtype != DType::f64 && dtype != DType::bf16 && dtype != DType::f16)
      throw_arg_error(cache_name,
                      which == "k" ? "dtype f32, bf16, f16, f64, or e4m3 with a k_scale (fp8)"
                                   : "a float dtype like k_cache (f32, bf16, f16 or f64: K and V "
                                     "are both fp8 or both float)",
                      dtype_name(dtype));
    if (scale.defined())
      throw_arg_error(scale_name,
                      "nothing for " + std::string(dtype_name(dtype)) + " " + cache_name +
                          " (a scale goes with e4m3 codes: fp8 K/V)",
                      "a tensor of shape " + shape_string(scale.shape()));
    return;
  }
  if (values.dtype() != DType::e4m3)
    throw_arg_error(cache_name, "dtype e4m3 like k_cache (K and V are both fp8 or both float)",
                    dtype_name(values.dtype()));
  const KvScaleLayout layout = kv_scale_layout_of(values, scale, which);  // dtype, shape
  if (layout == KvScaleLayout::per_token_head)
    check_shape(scale, scale_name, {values.size(0), values.size(1), values.size(2)});
  else
    check_shape(scale, scale_name, {1});
}
}  // namespace

void check_kv_formats(const PagedKvCache& cache) {
  const bool fp8 = cache.k_cache.dtype() == DType::e4m3;
  check_kv_dtype(cache.k_cache, cache.k_scale, "k", fp8);
  check_kv_dtype(cache.v_cache, cache.v_scale, "v", fp8);
}

std::vector<int64_t> check_kv_append(const PagedKvCache& cache, const Tensor& k, const Tensor& v,
                                     const Tensor& slot_mapping) {
  check_shape(cache.k_cache, "k_cache", {-1, -1, -1, -1});
  const int64_t pages = cache.k_cache.size(0), heads = cache.k_cache.size(1),
                block_size = cache.k_cache.size(2), dim = cache.k_cache.size(3);
  check_shape(cache.v_cache, "v_cache", {pages, heads, block_size, dim});
  check_kv_formats(cache);
  check_shape(k, "k", {-1, heads, dim});
  check_float(k, "k");
  check_shape(v, "v", {k.size(0), heads, dim});
  check_float(v, "v");
  const int64_t tokens = k.size(0);
  check_shape(slot_mapping, "slot_mapping", {tokens});
  if (slot_mapping.dtype() != DType::i64 && slot_mapping.dtype() != DType::i32)
    throw_arg_error("slot_mapping", "dtype i64 or i32", dtype_name(slot_mapping.dtype()));
  if (is_fp8_kv(cache))  // the quantizers' one content check (docs/msa.md §7)
    for (const auto& [values, name] : {std::pair<const Tensor*, const char*>{&k, "k"}, {&v, "v"}}) {
      const int64_t at = first_non_finite(*values);
      if (at >= 0)
        throw_arg_error(std::string(name) + " (fp8 K/V quantization)", "finite values",
                        "element " + index_string(values->shape(), at) + " = " +
                            std::to_string(values->get(at)));
    }
  if (is_fp8_kv(cache))
    for (const auto& [scale, name] : {std::pair<const Tensor*, const char*>{&cache.k_scale, "k_scale"},
                                      {&cache.v_scale, "v_scale"}}) {
      if (scale->dim() != 1) continue;  // per token and head: written by the append
      const float value = scale->data<float>()[0];
      if (!(value > 0) || !std::isfinite(value))
        throw_arg_error(std::string(name) + "[0]",
                        "a positive finite per-tensor scale (the append divides by it)", value);
    }
  // Slots: page * B + row of an existing page, each at most once (two tokens in one row
  // would race on the GPU and leave the row to whichever came last).
  const int64_t slots_total = pages * block_size;
  std::vector<int64_t> slots(static_cast<size_t>(tokens));
  std::vector<int64_t> seen;  // the non-negative slots, sorted below for the duplicate check
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t slot = slot_mapping.dtype() == DType::i64 ? slot_mapping.data<int64_t>()[t]
                                                             : slot_mapping.data<int32_t>()[t];
    if (slot >= slots_total)
      throw_arg_error("slot_mapping[" + std::to_string(t) + "]",
                      "a slot page * B + row in [0, " + std::to_string(slots_total) + ") (" +
                          std::to_string(pages) + " pages of " + std::to_string(block_size) +
                          " tokens), or negative to skip the token",
                      slot);
    slots[t] = slot;
    if (slot >= 0) seen.push_back(slot);
  }
  std::sort(seen.begin(), seen.end());
  const auto repeat = std::adjacent_find(seen.begin(), seen.end());
  if (repeat != seen.end())
    throw_arg_error("slot_mapping", "distinct slots (one token per cache row)",
                    "slot " + std::to_string(*repeat) + " more than once");
  return slots;
}

AttentionDims check_paged_qkv(const Tensor& q, const PagedKvCache& cache, int64_t block_size) {
  check_shape(q, "q", {-1, -1, -1});
  check_float(q, "q");
  const int64_t head_dim = q.size(2);
  check_shape(cache.k_cache, "k_cache", {-1, -1, block_size, head_dim});
  check_shape(cache.v_cache, "v_cache", {cache.k_cache.size(0), cache.k_cache.size(1), block_size,
                                         head_dim});
  check_kv_formats(cache);
  AttentionDims dims{.q_heads = q.size(1), .kv_heads = cache.k_cache.size(1),
                     .head_dim = head_dim};
  if (dims.kv_heads < 1) throw_arg_error("k_cache", "at least one KV head", dims.kv_heads);
  if (dims.q_heads < 1 || dims.q_heads % dims.kv_heads != 0)
    throw_arg_error("q", "a head count that is a positive multiple of the cache's " +
                             std::to_string(dims.kv_heads) + " KV heads",
                    dims.q_heads);
  return dims;
}

Tensor as_dtype(const Tensor& tensor, DType dtype) {
  return tensor.dtype() == dtype ? tensor : tensor.to(dtype);
}

DType compute_dtype(Impl impl, const Tensor& queries) {
  return impl == Impl::reference && queries.dtype() == DType::f64 ? DType::f64 : DType::f32;
}

}  // namespace msa::detail
