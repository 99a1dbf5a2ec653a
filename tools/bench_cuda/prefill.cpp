// msa bench --device cuda: the prefill rows (one sequence of N tokens, all N queries, varlen).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <numeric>
#include <vector>

#include "bench_cuda/common.h"
#include "bench_cuda/inputs.h"
#include "bench_cuda/bench_kernels.h"
#include "cuda/attention/attention_sparse_union.h"
#include "cuda/attention/fp8_kv_widen.h"
#include "cuda/attention/query_major_rule.h"
#include "msa/cuda/quantize.h"

namespace msa::cli::bench_cuda {

Row measure_prefill(Session& s, int64_t n) {
  const Config& c = s.config;
  const int64_t Hq = c.heads, Hkv = c.kv_heads, D = c.head_dim, Di = c.index_dim, Hi = c.kv_heads;
  const int64_t B = c.params.block_size, k = c.params.topk;
  Row row = new_row("prefill", n, 1, n);
  const bool run_dense = c.dense_max_context == 0 || n <= c.dense_max_context;
  // Our dense kernel may be skipped alone at long N (cuDNN is the stronger baseline there).
  const bool run_ours = run_dense && (c.ours_dense_max_context == 0 || n <= c.ours_dense_max_context);
  const bool gate = run_ours && n <= k * B;
  const size_t q_elems = n * Hq * D, kv_elems = n * Hkv * D;
  // --kv-cache: paged fp8 caches of the same K/V, page j = block j of the sequence.
  const int64_t pages = (n + B - 1) / B;
  const size_t cache_elems = static_cast<size_t>(pages * Hkv * B * D);
  size_t set_bytes = 2 * (q_elems + 2 * kv_elems + n * Hi * Di + n * Di) + 4 * static_cast<size_t>(Hi * n * k);
  for (cuda::KvScaleLayout layout : c.fp8_kv_layouts)
    set_bytes += fp8_kv_set_bytes(layout, cache_elems, D);
  DeviceBuffer identity_slots;  // token t -> slot t (page t / B, row t % B)
  if (!c.fp8_kv_layouts.empty()) {
    std::vector<int64_t> slots(static_cast<size_t>(n));
    std::iota(slots.begin(), slots.end(), int64_t{0});
    identity_slots = DeviceBuffer::from(slots);
  }

  Geometry geometry(1, n, n);
  DeviceBuffer o(q_elems * 4), lse(static_cast<size_t>(n * Hq) * 4);
  DeviceBuffer o_msa(gate ? q_elems * 4 : 0);
  std::vector<std::unique_ptr<PrefillSet>> sets;
  auto add_set = [&] {
    auto set = std::make_unique<PrefillSet>();
    set->q = DeviceBuffer(q_elems * 2);
    set->k = DeviceBuffer(kv_elems * 2);
    set->v = DeviceBuffer(kv_elems * 2);
    set->qi = DeviceBuffer(static_cast<size_t>(n * Hi * Di) * 2);
    set->ki = DeviceBuffer(static_cast<size_t>(n * Di) * 2);
    set->topk = DeviceBuffer(static_cast<size_t>(Hi * n * k) * 4);
    for (DeviceBuffer* b : {&set->q, &set->k, &set->v, &set->qi, &set->ki}) fill_normal(*b, s.seed++, s.stream);
    if (c.index_coherence > 0)  // --index-coherence
      cuda::bench::share_block_rows(set->qi.as<uint16_t>(), n, Hi * Di, B, static_cast<float>(c.index_coherence),
                                    s.stream);
    set->index = indexer_params(c, set->qi, varlen_keys(set->ki, 1, Di, B, geometry.k_start),
                                geometry.layout, set->topk);
    set->index.fp8_compute = c.params.index_compute == IndexCompute::fp8;  // --index-compute
    set->index.ki_tokens = n;
    set->index.ranking = c.index_ranking;  // --index-ranking
    cuda::AttentionLaunch& ap = set->sparse;
    set_sparse_inputs(ap, c, set->q, varlen_keys(set->k, Hkv, D, B, geometry.k_start),
                      varlen_keys(set->v, Hkv, D, B, geometry.k_start), geometry.layout, set->topk);
    ap.o = o.as<float>();
    ap.lse = lse.as<float>();
    set->dense = dense_of(ap);
    if (!c.fp8_kv_layouts.empty()) {  // --kv-cache
      std::vector<int32_t> table(static_cast<size_t>(pages));
      std::iota(table.begin(), table.end(), 0);
      set->table = DeviceBuffer::from(table);
      cuda::AttentionLaunch paged = ap;  // k / v data unused: the fp8 launch reads the codes
      paged.k = paged_keys(set->k, Hkv, D, B, set->table, pages);
      paged.v = paged_keys(set->v, Hkv, D, B, set->table, pages);
      for (cuda::KvScaleLayout layout : c.fp8_kv_layouts) {
        cuda::KvAppendParams append;
        append.k = set->k.get();
        append.v = set->v.get();
        append.input = cuda::InputType::bf16;
        append.tokens = n;
        append.kv_heads = Hkv;
        append.head_dim = D;
        append.block_size = B;
        append.slot_mapping = identity_slots.as<int64_t>();
        set->fp8_kv.push_back(quantize_fp8_kv(s, append, cache_elems, Hkv, B, layout, paged));
      }
    }
    sets.push_back(std::move(set));
  };
  add_set();

  cuda::IndexerLaunch exact_index = sets[0]->index;  // --index-compute fp8: the rows to compare with
  exact_index.fp8_compute = false;
  DeviceBuffer index_ws(std::max(cuda::indexer_workspace_bytes(sets[0]->index),
                                 cuda::indexer_workspace_bytes(exact_index)));
  size_t attention_bytes = std::max(cuda::attention_workspace_bytes(sets[0]->sparse),
                                    run_ours ? cuda::attention_workspace_bytes(sets[0]->dense) : 0);
  for (const Fp8KvSet& f : sets[0]->fp8_kv)  // the bf16 copy of the caches, then the bf16 paths'
    attention_bytes = std::max({attention_bytes, cuda::attention_workspace_bytes(f.sparse),
                                run_ours ? cuda::attention_workspace_bytes(f.dense) : 0});
  DeviceBuffer attention_ws(attention_bytes);
  const auto forward_of = [](PrefillSet& set) {
    return cuda::MsaForwardLaunch{.index = set.index, .attention = set.sparse};
  };
  DeviceBuffer forward_ws(cuda::msa_forward_workspace_bytes(forward_of(*sets[0])));
  row.msa_path = cuda::msa_is_dense(sets[0]->index) ? "dense" : "sparse";
  row.index_compute = std::string(index_compute_name(c.params.index_compute));

#ifdef MSA_WITH_CUDNN
  std::unique_ptr<cuda::CudnnSdpa> sdpa;
  DeviceBuffer o_ref;
  if (run_dense && c.cudnn) sdpa = try_cudnn_sdpa(causal_sdpa_shape(c, 1, n, n), row, o_ref, q_elems * 2);
#else
  if (run_dense && c.cudnn) row.cudnn_note = "not built (no cuDNN frontend)";
#endif

  const int64_t target = rotation_sets(c, set_bytes, 8);
  while (static_cast<int64_t>(sets.size()) < target && free_device_bytes() > set_bytes + kReserveBytes)
    add_set();
  const int copies = static_cast<int>(sets.size());
  row.copies = copies;
  MSA_CUDA_CHECK(cudaDeviceSynchronize());

  const int dense_repeats = c.dense_repeats > 0 ? c.dense_repeats : (n >= 524288 ? 2 : 20);
  std::fprintf(stderr, "[bench] prefill N=%lld: %d input set(s) of %.2f GB; indexer ...\n",
               static_cast<long long>(n), copies, set_bytes / 1e9);
  auto& st = s.stream;
  auto set_of = [&](int i) -> PrefillSet& { return *sets[i % copies]; };
  row.indexer = time_events(st, c.warmup, c.repeats, [&](int i) {
    cuda::indexer(set_of(i).index, index_ws.get(), st);
  });
  for (auto& set : sets) cuda::indexer(set->index, index_ws.get(), st);  // every set's topk
  std::fprintf(stderr, "[bench]   sparse attention ...\n");
  row.sparse = time_events(st, c.warmup, c.repeats, [&](int i) {
    cuda::attention(set_of(i).sparse, attention_ws.get(), st);
  });
  if (c.sparse_orders) {  // each order pinned; the automatic workspace covers both
    for (const auto& [order, timing] : {std::pair{cuda::SparseOrder::kv_major, &row.sparse_kv_major},
                                        std::pair{cuda::SparseOrder::query_major, &row.sparse_query_major}}) {
      if (order == cuda::SparseOrder::query_major && !cuda::sparse_query_major_fits(sets[0]->sparse))
        continue;  // not a shape query_major runs (pinning it would be an error)
      std::fprintf(stderr, "[bench]   sparse attention, %s ...\n",
                   cuda::sparse_order_name(order));
      *timing = time_events(st, c.warmup, c.repeats, [&](int i) {
        cuda::AttentionLaunch l = set_of(i).sparse;
        l.sparse_order = order;
        cuda::attention(l, attention_ws.get(), st);
      });
    }
  }
  std::fprintf(stderr, "[bench]   MSA (cuda::msa_forward: indexer + sparse, or dense) ...\n");
  row.msa = time_events(st, c.warmup, c.repeats, [&](int i) {
    cuda::msa_forward(forward_of(set_of(i)), forward_ws.get(), st);
  });
  if (run_ours) {
    std::fprintf(stderr, "[bench]   dense (ours), %d runs ...\n", dense_repeats);
    row.dense = time_events(st, c.warmup, dense_repeats, [&](int i) {
      cuda::attention(set_of(i).dense, attention_ws.get(), st);
    });
  }
  for (size_t f = 0; f < c.fp8_kv_layouts.size(); ++f) {  // --kv-cache
    Row::Fp8Kv q;
    q.layout = layout_name(c.fp8_kv_layouts[f]);
    std::fprintf(stderr, "[bench]   fp8 K/V (%s): sparse attention ...\n", q.layout.c_str());
    q.sparse = time_events(st, c.warmup, c.repeats, [&](int i) {
      cuda::attention(set_of(i).fp8_kv[f].sparse, attention_ws.get(), st);
    });
    q.widen = time_events(st, c.warmup, c.repeats, [&](int i) {
      cuda::widen_fp8_kv(set_of(i).fp8_kv[f].sparse, attention_ws.get(), st);
    });
    if (run_ours) {
      std::fprintf(stderr, "[bench]   fp8 K/V (%s): dense (ours), %d runs ...\n", q.layout.c_str(), dense_repeats);
      q.dense = time_events(st, c.warmup, dense_repeats, [&](int i) {
        cuda::attention(set_of(i).fp8_kv[f].dense, attention_ws.get(), st);
      });
    }
    row.fp8_kv.push_back(q);
  }
#ifdef MSA_WITH_CUDNN
  if (sdpa) {
    std::fprintf(stderr, "[bench]   dense (cuDNN), %d runs ...\n", dense_repeats);
    row.cudnn = time_events(st, c.warmup, dense_repeats, [&](int i) {
      sdpa->run(set_of(i).q.get(), set_of(i).k.get(), set_of(i).v.get(), o_ref.get(), st);
    });
  }
#endif

  // Gates and counts on set 0.
  PrefillSet& first = *sets[0];
  cuda::indexer(first.index, index_ws.get(), st);
  if (run_ours) cuda::attention(first.dense, attention_ws.get(), st);
  if (gate) row.err_msa_dense = msa_dense_error(first.sparse, o_msa, o, q_elems, attention_ws, st);
#ifdef MSA_WITH_CUDNN
  if (sdpa && run_ours) {
    sdpa->run(first.q.get(), first.k.get(), first.v.get(), o_ref.get(), st);
    row.err_dense_cudnn = cuda::bench::relative_l2_error(o.as<float>(), o_ref.get(), true, q_elems, st);
  }
#endif
  MSA_CUDA_CHECK(cudaStreamSynchronize(st));
  const std::vector<int32_t> selected = download_i32(first.topk);
  const SelectionCount count = count_selection(selected, Hi, 1, n, n, k, B, D);
  row.malformed = count.malformed;
  if (Hq / Hkv > 0 && cuda::kUnionTileRows % (Hq / Hkv) == 0) {
    const TileUnionCount unions = count_tile_unions(selected, Hi, n, k, Hq / Hkv);
    row.union_factor = unions.union_factor;
    row.query_major_tiles = unions.query_major_tiles;
  }
  if (!row.fp8_kv.empty()) {  // --kv-cache: O against the bf16 K/V's on the same rows
    DeviceBuffer o_fp8(q_elems * 4);
    cuda::attention(first.sparse, attention_ws.get(), st);  // o: bf16 K/V
    for (size_t f = 0; f < row.fp8_kv.size(); ++f) {
      cuda::AttentionLaunch fp8 = first.fp8_kv[f].sparse;
      fp8.o = o_fp8.as<float>();
      cuda::attention(fp8, attention_ws.get(), st);
      row.fp8_kv[f].err_sparse_vs_bf16 =
          cuda::bench::relative_l2_error(o_fp8.as<float>(), o.get(), false, q_elems, st);
    }
  }
  if (first.index.fp8_compute) {  // how often fp8 scores change the selection (performance.md)
    cuda::indexer(exact_index, index_ws.get(), st);  // set 0's inputs; overwrites its topk
    MSA_CUDA_CHECK(cudaStreamSynchronize(st));
    row.changed_rows_vs_exact = changed_row_fraction(download_i32(first.topk), selected, k);
  }
  const double pairs = 0.5 * static_cast<double>(n) * (n + 1);
  row.dense_flops = 4.0 * D * Hq * pairs;
  row.indexer_flops = 2.0 * Di * Hi * pairs;
  row.sparse_flops = 4.0 * D * (Hq / Hkv) * count.keys;
  return row;
}

}  // namespace msa::cli::bench_cuda
