// msa bench --device cuda: the decode rows (paged caches, shuffled page tables, `batch`
// requests of Q new queries), timed as CUDA-graph replays where the step can be captured.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench_cuda/common.h"
#include "bench_cuda/inputs.h"
#include "bench_cuda/bench_kernels.h"
#include "msa/cuda/quantize.h"

namespace msa::cli::bench_cuda {

namespace {

// --index-keys formats: bytes of one token's codes and scales.
int64_t code_bytes(cuda::KeyFormat format, int64_t dim) {
  return format == cuda::KeyFormat::fp8 ? dim : dim / 2;
}
int64_t scale_bytes(cuda::KeyFormat format, int64_t dim) {
  return format == cuda::KeyFormat::fp8 ? 4 : dim / 16;
}
const char* format_name(cuda::KeyFormat format) {
  return format == cuda::KeyFormat::fp8 ? "fp8" : format == cuda::KeyFormat::fp4 ? "fp4" : "bf16";
}

}  // namespace

Row measure_decode(Session& s, int64_t n, int64_t batch, int64_t q_len) {
  const Config& c = s.config;
  const int64_t Hq = c.heads, Hkv = c.kv_heads, D = c.head_dim, Di = c.index_dim, Hi = c.kv_heads;
  const int64_t B = c.params.block_size, k = c.params.topk;
  Row row = new_row("decode", n, batch, q_len);
  const bool gate = n <= k * B;
  const int64_t pages_per_request = (n + B - 1) / B, pages = batch * pages_per_request;
  const int64_t total_q = batch * q_len;
  const size_t q_elems = total_q * Hq * D;
  const size_t cache_elems = static_cast<size_t>(pages) * Hkv * B * D;
  const size_t set_bytes = 2 * (2 * cache_elems + static_cast<size_t>(pages) * B * Di + q_elems +
                                total_q * Hi * Di) +
                           4 * static_cast<size_t>(pages + Hi * total_q * k);
  size_t quantized_set_bytes = 0;  // --index-keys: codes, scales and rows per format
  for (cuda::KeyFormat format : c.quantized_index_keys)
    quantized_set_bytes += static_cast<size_t>(pages * B * (code_bytes(format, Di) + scale_bytes(format, Di))) +
                           4 * static_cast<size_t>(Hi * total_q * k);

  for (cuda::KvScaleLayout layout : c.fp8_kv_layouts)  // --kv-cache: codes and scales
    quantized_set_bytes += fp8_kv_set_bytes(layout, cache_elems, D);

  // "Where memory allows": a row whose single input set cannot fit is reported as skipped
  // (e.g. 1M x batch 64: 128 GiB of K/V cache alone), not as an error.
  if (set_bytes + quantized_set_bytes + kReserveBytes > free_device_bytes()) {
    row.skipped = "one input set needs " + std::to_string((set_bytes + quantized_set_bytes) >> 30) +
                  " GiB, " + std::to_string(free_device_bytes() >> 30) + " GiB free";
    std::fprintf(stderr, "[bench] decode N=%lld batch %lld Q %lld: skipped (%s)\n",
                 static_cast<long long>(n), static_cast<long long>(batch),
                 static_cast<long long>(q_len), row.skipped.c_str());
    return row;
  }
  Geometry geometry(batch, q_len, n);
  // The kernels DecodePlan runs check every page id they read (KeyLayout::page_fault): so do
  // the timed ones. Every id is in range, so the status must stay -1 (checked at the end).
  DeviceBuffer page_fault(sizeof(cuda::GeometryStatus));
  page_fault.fill_bytes(0xff);
  cuda::GeometryStatus* fault = page_fault.as<cuda::GeometryStatus>();
  DeviceBuffer o(q_elems * 4), lse(static_cast<size_t>(total_q * Hq) * 4);
  // --kv-cache: every (page, head, row) of a cache is one "token" of one head in pages of one
  // row for the append kernel, which quantizes it in place of the identity slot mapping.
  const int64_t kv_rows = pages * Hkv * B;
  DeviceBuffer identity_slots;
  if (!c.fp8_kv_layouts.empty()) {
    std::vector<int64_t> slots(static_cast<size_t>(kv_rows));
    std::iota(slots.begin(), slots.end(), int64_t{0});
    identity_slots = DeviceBuffer::from(slots);
  }
  DeviceBuffer o_msa(gate ? q_elems * 4 : 0);
  std::vector<std::unique_ptr<DecodeSet>> sets;
  auto add_set = [&] {
    auto set = std::make_unique<DecodeSet>();
    set->k_cache = DeviceBuffer(cache_elems * 2);
    set->v_cache = DeviceBuffer(cache_elems * 2);
    set->ki_cache = DeviceBuffer(static_cast<size_t>(pages * B * Di) * 2);
    set->q = DeviceBuffer(q_elems * 2);
    set->qi = DeviceBuffer(static_cast<size_t>(total_q * Hi * Di) * 2);
    set->topk = DeviceBuffer(static_cast<size_t>(Hi * total_q * k) * 4);
    for (DeviceBuffer* b : {&set->k_cache, &set->v_cache, &set->ki_cache, &set->q, &set->qi})
      fill_normal(*b, s.seed++, s.stream);
    std::vector<int32_t> table(pages);
    std::iota(table.begin(), table.end(), 0);
    std::mt19937_64 rng(s.seed++);
    std::shuffle(table.begin(), table.end(), rng);
    set->table = DeviceBuffer::from(table);
    set->index = indexer_params(
        c, set->qi, paged_keys(set->ki_cache, 1, Di, B, set->table, pages_per_request, fault, pages),
        geometry.layout, set->topk);
    const cuda::IndexerLaunch& ip = set->index;
    cuda::AttentionLaunch& ap = set->sparse;
    set_sparse_inputs(ap, c, set->q, paged_keys(set->k_cache, Hkv, D, B, set->table, pages_per_request, fault, pages),
                      paged_keys(set->v_cache, Hkv, D, B, set->table, pages_per_request, fault, pages),
                      geometry.layout, set->topk);
    ap.o = o.as<float>();
    ap.lse = lse.as<float>();
    set->dense = dense_of(ap);
    for (cuda::KeyFormat format : c.quantized_index_keys) {  // the same keys, quantized
      DecodeSet::Quantized qs;
      qs.codes = DeviceBuffer(static_cast<size_t>(pages * B * code_bytes(format, Di)));
      qs.scales = DeviceBuffer(static_cast<size_t>(pages * B * scale_bytes(format, Di)));
      qs.topk = DeviceBuffer(static_cast<size_t>(Hi * total_q * k) * 4);
      cuda::quantize_index_keys(set->ki_cache.as<uint16_t>(), pages * B, Di, format,
                                qs.codes.as<uint8_t>(), qs.scales.as<uint8_t>(), s.stream);
      qs.index = ip;
      qs.index.ki_format = format;
      qs.index.ki_quantized = {qs.codes.as<uint8_t>(), qs.scales.as<uint8_t>()};
      qs.index.topk_out = qs.topk.as<int32_t>();
      qs.sparse = ap;
      qs.sparse.topk = qs.topk.as<int32_t>();
      set->quantized.push_back(std::move(qs));
    }
    for (cuda::KvScaleLayout layout : c.fp8_kv_layouts) {  // the same K/V, quantized
      cuda::KvAppendParams append;
      append.k = set->k_cache.get();
      append.v = set->v_cache.get();
      append.input = cuda::InputType::bf16;
      append.tokens = kv_rows;
      append.kv_heads = 1;
      append.head_dim = D;
      append.block_size = 1;
      append.slot_mapping = identity_slots.as<int64_t>();
      set->fp8_kv.push_back(quantize_fp8_kv(s, append, cache_elems, Hkv, B, layout, ap));
    }
    sets.push_back(std::move(set));
  };
  add_set();

  DeviceBuffer index_ws(cuda::indexer_workspace_bytes(sets[0]->index));
  DeviceBuffer attention_ws(std::max(cuda::attention_workspace_bytes(sets[0]->sparse),
                                     cuda::attention_workspace_bytes(sets[0]->dense)));

#ifdef MSA_WITH_CUDNN
  std::unique_ptr<cuda::CudnnSdpa> sdpa;
  DeviceBuffer o_ref;
  if (c.cudnn) {
    cuda::CudnnSdpaShape shape = causal_sdpa_shape(c, batch, q_len, pages_per_request * B);
    shape.block_size = B;
    shape.pages = pages;
    shape.table_stride = pages_per_request;
    sdpa = try_cudnn_sdpa(shape, row, o_ref, q_elems * 2);
  }
  auto run_cudnn = [&](DecodeSet& set) {
    cuda::CudnnSdpaArgs a;
    a.q = set.q.get();
    a.k = set.k_cache.get();
    a.v = set.v_cache.get();
    a.o = o_ref.get();
    a.page_table = set.table.as<int32_t>();
    a.seq_len_q = geometry.seq_len_q.as<int32_t>();
    a.seq_len_kv = geometry.seq_len_kv.as<int32_t>();
    sdpa->run(a, s.stream);
  };
#else
  if (c.cudnn) row.cudnn_note = "not built (no cuDNN frontend)";
#endif

  const int64_t target = rotation_sets(c, set_bytes, 32);
  while (static_cast<int64_t>(sets.size()) < target &&
         free_device_bytes() > set_bytes + quantized_set_bytes + kReserveBytes)
    add_set();
  const int copies = static_cast<int>(sets.size());
  row.copies = copies;
  MSA_CUDA_CHECK(cudaDeviceSynchronize());

  std::fprintf(stderr, "[bench] decode N=%lld batch %lld Q %lld: %d input set(s) of %.3f GB ...\n",
               static_cast<long long>(n), static_cast<long long>(batch),
               static_cast<long long>(q_len), copies, set_bytes / 1e9);
  auto& st = s.stream;
  std::string method;
  row.indexer = time_steps(st, copies, c.warmup, c.decode_repeats, [&](int i) {
    cuda::indexer(sets[i]->index, index_ws.get(), st);
  }, method);
  row.timing_method = method;
  row.sparse = time_steps(st, copies, c.warmup, c.decode_repeats, [&](int i) {
    cuda::attention(sets[i]->sparse, attention_ws.get(), st);
  }, method);
  if (method != row.timing_method) row.timing_method += "/" + method;
  row.msa = time_steps(st, copies, c.warmup, c.decode_repeats, [&](int i) {
    cuda::indexer(sets[i]->index, index_ws.get(), st);
    cuda::attention(sets[i]->sparse, attention_ws.get(), st);
  }, method);
  if (row.timing_method.find(method) == std::string::npos) row.timing_method += "/" + method;
  // The step's prefixes (decode_phase_us): the scan alone, then everything but the merge.
  if (cuda::indexer_uses_decode_path(sets[0]->index) && cuda::attention_uses_decode_path(sets[0]->sparse)) {
    row.scan = time_steps(st, copies, c.warmup, c.decode_repeats, [&](int i) {
      cuda::IndexerLaunch scan = sets[i]->index;
      scan.decode_scan_only = true;
      cuda::indexer(scan, index_ws.get(), st);
    }, method);
    row.unmerged = time_steps(st, copies, c.warmup, c.decode_repeats, [&](int i) {
      cuda::indexer(sets[i]->index, index_ws.get(), st);
      cuda::AttentionLaunch unmerged = sets[i]->sparse;
      unmerged.decode_skip_merge = true;
      cuda::attention(unmerged, attention_ws.get(), st);
    }, method);
  }
  row.dense = time_steps(st, copies, c.warmup, c.decode_repeats, [&](int i) {
    cuda::attention(sets[i]->dense, attention_ws.get(), st);
  }, method);
  if (row.timing_method.find(method) == std::string::npos) row.timing_method += "/" + method;
  for (size_t f = 0; f < c.quantized_index_keys.size(); ++f) {
    const cuda::KeyFormat format = c.quantized_index_keys[f];
    Row::QuantizedIndexKeys q;
    q.format = format_name(format);
    q.index_bytes = static_cast<double>(batch * n * (code_bytes(format, Di) + scale_bytes(format, Di)));
    q.indexer = time_steps(st, copies, c.warmup, c.decode_repeats, [&](int i) {
      cuda::indexer(sets[i]->quantized[f].index, index_ws.get(), st);
    }, method);
    q.msa = time_steps(st, copies, c.warmup, c.decode_repeats, [&](int i) {
      cuda::indexer(sets[i]->quantized[f].index, index_ws.get(), st);
      cuda::attention(sets[i]->quantized[f].sparse, attention_ws.get(), st);
    }, method);
    row.quantized.push_back(q);
  }
  for (size_t f = 0; f < c.fp8_kv_layouts.size(); ++f) {  // --kv-cache
    Row::Fp8Kv q;
    q.layout = layout_name(c.fp8_kv_layouts[f]);
    q.sparse = time_steps(st, copies, c.warmup, c.decode_repeats, [&](int i) {
      cuda::attention(sets[i]->fp8_kv[f].sparse, attention_ws.get(), st);
    }, method);
    q.msa = time_steps(st, copies, c.warmup, c.decode_repeats, [&](int i) {
      cuda::indexer(sets[i]->index, index_ws.get(), st);
      cuda::attention(sets[i]->fp8_kv[f].sparse, attention_ws.get(), st);
    }, method);
    q.dense = time_steps(st, copies, c.warmup, c.decode_repeats, [&](int i) {
      cuda::attention(sets[i]->fp8_kv[f].dense, attention_ws.get(), st);
    }, method);
    row.fp8_kv.push_back(q);
  }
#ifdef MSA_WITH_CUDNN
  if (sdpa) {
    std::string cudnn_method;
    row.cudnn = time_steps(st, copies, c.warmup, c.decode_repeats,
                           [&](int i) { run_cudnn(*sets[i]); }, cudnn_method);
    if (cudnn_method != "graph") row.cudnn_note = "cuDNN timed " + cudnn_method;
  }
#endif

  DecodeSet& first = *sets[0];
  cuda::indexer(first.index, index_ws.get(), st);
  cuda::attention(first.dense, attention_ws.get(), st);
  if (gate) row.err_msa_dense = msa_dense_error(first.sparse, o_msa, o, q_elems, attention_ws, st);
#ifdef MSA_WITH_CUDNN
  if (sdpa) {
    run_cudnn(first);
    row.err_dense_cudnn = cuda::bench::relative_l2_error(o.as<float>(), o_ref.get(), true, q_elems, st);
  }
#endif
  MSA_CUDA_CHECK(cudaStreamSynchronize(st));
  const SelectionCount count =
      count_selection(download_i32(first.topk), Hi, batch, q_len, n, k, B, D);
  row.malformed = count.malformed;
  // --index-keys: well-formed rows, and how many select another set than the bf16 keys.
  const std::vector<int32_t> bf16_rows = download_i32(first.topk);
  for (size_t f = 0; f < row.quantized.size(); ++f) {
    cuda::indexer(first.quantized[f].index, index_ws.get(), st);
    MSA_CUDA_CHECK(cudaStreamSynchronize(st));
    const std::vector<int32_t> rows = download_i32(first.quantized[f].topk);
    row.quantized[f].malformed = count_selection(rows, Hi, batch, q_len, n, k, B, D).malformed;
    row.quantized[f].changed_rows = changed_row_fraction(rows, bf16_rows, k);
  }
  {
    cuda::GeometryStatus status;
    page_fault.download(&status, sizeof status);
    if (status.request != -1)
      row.error = "a page id out of range was recorded (request " + std::to_string(status.request) + ")";
  }
  row.index_bytes = 2.0 * batch * n * Di;
  row.kv_selected_bytes = count.kv_bytes;
  row.dense_bytes = 4.0 * batch * n * Hkv * D;
  // --kv-cache: bytes (codes: half of bf16's; per token and head: 4 bytes of scale per D
  // codes) and O against the bf16 caches' on the same selection rows (first.topk).
  if (!row.fp8_kv.empty()) {
    DeviceBuffer o_fp8(q_elems * 4);
    cuda::attention(first.sparse, attention_ws.get(), st);  // o: bf16 K/V
    for (size_t f = 0; f < row.fp8_kv.size(); ++f) {
      Row::Fp8Kv& q = row.fp8_kv[f];
      const double per_byte = 0.5 * fp8_bytes_per_element(c.fp8_kv_layouts[f], D);
      q.kv_selected_bytes = per_byte * count.kv_bytes;
      q.dense_bytes = per_byte * row.dense_bytes;
      cuda::AttentionLaunch fp8 = first.fp8_kv[f].sparse;
      fp8.o = o_fp8.as<float>();
      cuda::attention(fp8, attention_ws.get(), st);
      q.err_sparse_vs_bf16 = cuda::bench::relative_l2_error(o_fp8.as<float>(), o.get(), false, q_elems, st);
    }
  }
  return row;
}

}  // namespace msa::cli::bench_cuda
