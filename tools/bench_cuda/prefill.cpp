// msa bench --device cuda: the prefill rows (one sequence of N tokens, all N queries, varlen).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <memory>
#include <vector>

#include "bench_cuda/common.h"
#include "cuda/bench_kernels.h"
#ifdef MSA_WITH_CUDNN
#include "cuda/cudnn_sdpa.h"
#endif

namespace msa::cli::bench_cuda {

namespace {

cuda::KeyLayout varlen_keys(const DeviceBuffer& data, int64_t heads, int64_t dim, int64_t block,
                            const DeviceBuffer& k_start) {
  cuda::KeyLayout l;
  l.data = data.as<uint16_t>();
  l.block_size = block;
  l.token_stride = heads * dim;
  l.head_stride = dim;
  l.block_stride = block * heads * dim;
  l.seq_token_start = k_start.as<int64_t>();
  return l;
}

}  // namespace

Row measure_prefill(Session& s, int64_t n) {
  const Config& c = s.config;
  const int64_t Hq = c.heads, Hkv = c.kv_heads, D = c.head_dim, Di = c.index_dim, Hi = c.kv_heads;
  const int64_t B = c.params.block_size, k = c.params.topk;
  Row row;
  row.phase = "prefill";
  row.context = n;
  row.queries = n;
  const bool run_dense = c.dense_max_context == 0 || n <= c.dense_max_context;
  const bool gate = run_dense && n <= k * B;
  const size_t q_elems = n * Hq * D, kv_elems = n * Hkv * D;
  const size_t set_bytes =
      2 * (q_elems + 2 * kv_elems + n * Hi * Di + n * Di) + 4 * static_cast<size_t>(Hi * n * k);

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
    cuda::IndexerParams& ip = set->index;
    ip.qi = set->qi.as<uint16_t>();
    ip.heads = Hi;
    ip.dim = Di;
    ip.ki = varlen_keys(set->ki, 1, Di, B, geometry.k_start);
    ip.batch = geometry.layout;
    ip.block_size = static_cast<int>(B);
    ip.topk = static_cast<int>(k);
    ip.local_blocks = c.params.local_blocks;
    ip.init_blocks = c.params.init_blocks;
    ip.logit_scale = index_logit_scale(c);
    ip.topk_out = set->topk.as<int32_t>();
    ip.lse_out = nullptr;
    cuda::AttentionParams& ap = set->sparse;
    ap.q = set->q.as<uint16_t>();
    ap.k = varlen_keys(set->k, Hkv, D, B, geometry.k_start);
    ap.v = varlen_keys(set->v, Hkv, D, B, geometry.k_start);
    ap.q_heads = Hq;
    ap.kv_heads = Hkv;
    ap.head_dim = D;
    ap.batch = geometry.layout;
    ap.topk = set->topk.as<int32_t>();
    ap.slots = k;
    ap.scale = main_scale(c);
    ap.o = o.as<float>();
    ap.lse = lse.as<float>();
    set->dense = ap;
    set->dense.topk = nullptr;
    set->dense.slots = 0;
    sets.push_back(std::move(set));
  };
  add_set();

  DeviceBuffer index_ws(cuda::indexer_workspace_bytes(sets[0]->index));
  DeviceBuffer attention_ws(std::max(cuda::attention_workspace_bytes(sets[0]->sparse),
                                     run_dense ? cuda::attention_workspace_bytes(sets[0]->dense) : 0));
  const auto forward_of = [](PrefillSet& set) {
    return cuda::MsaForwardParams{.index = set.index, .attention = set.sparse};
  };
  DeviceBuffer forward_ws(cuda::msa_forward_workspace_bytes(forward_of(*sets[0])));
  row.msa_path = cuda::msa_is_dense(sets[0]->index) ? "dense" : "sparse";

#ifdef MSA_WITH_CUDNN
  std::unique_ptr<cuda::CudnnSdpa> sdpa;
  DeviceBuffer o_ref;
  if (run_dense && c.cudnn) {
    try {
      cuda::CudnnSdpaShape shape;
      shape.batch = 1;
      shape.q_heads = Hq;
      shape.kv_heads = Hkv;
      shape.head_dim = D;
      shape.q_len = n;
      shape.k_len = n;
      shape.scale = main_scale(c);
      shape.causal = true;
      sdpa = std::make_unique<cuda::CudnnSdpa>(shape);
      row.cudnn_plan = sdpa->plan_name();
      o_ref = DeviceBuffer(q_elems * 2);
    } catch (const std::exception& e) {
      row.cudnn_note = e.what();
      std::fprintf(stderr, "[bench]   cuDNN SDPA unavailable: %s\n", e.what());
    }
  }
#else
  if (run_dense && c.cudnn) row.cudnn_note = "not built (no cuDNN frontend)";
#endif

  const int64_t target = std::clamp<int64_t>(
      static_cast<int64_t>(std::ceil(c.rotate_bytes / static_cast<double>(set_bytes))), 1, 8);
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
  std::fprintf(stderr, "[bench]   MSA (cuda::msa_forward: indexer + sparse, or dense) ...\n");
  row.msa = time_events(st, c.warmup, c.repeats, [&](int i) {
    cuda::msa_forward(forward_of(set_of(i)), forward_ws.get(), st);
  });
  if (run_dense) {
    std::fprintf(stderr, "[bench]   dense (ours), %d runs ...\n", dense_repeats);
    row.dense = time_events(st, c.warmup, dense_repeats, [&](int i) {
      cuda::attention(set_of(i).dense, attention_ws.get(), st);
    });
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
  if (run_dense) cuda::attention(first.dense, attention_ws.get(), st);
  if (gate) {
    cuda::AttentionParams p = first.sparse;
    p.o = o_msa.as<float>();
    cuda::attention(p, attention_ws.get(), st);
    row.err_msa_dense = cuda::bench::relative_l2_error(o_msa.as<float>(), o.get(), false, q_elems, st);
  }
#ifdef MSA_WITH_CUDNN
  if (sdpa) {
    sdpa->run(first.q.get(), first.k.get(), first.v.get(), o_ref.get(), st);
    row.err_dense_cudnn = cuda::bench::relative_l2_error(o.as<float>(), o_ref.get(), true, q_elems, st);
  }
#endif
  MSA_CUDA_CHECK(cudaStreamSynchronize(st));
  const SelectionCount count =
      count_selection(download_i32(first.topk), Hi, 1, n, n, k, B, D);
  row.malformed = count.malformed;
  const double pairs = 0.5 * static_cast<double>(n) * (n + 1);
  row.dense_flops = 4.0 * D * Hq * pairs;
  row.indexer_flops = 2.0 * Di * Hi * pairs;
  row.sparse_flops = 4.0 * D * (Hq / Hkv) * count.keys;
  return row;
}

}  // namespace msa::cli::bench_cuda
