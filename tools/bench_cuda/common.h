// msa bench --device cuda: our Hopper MSA kernels (cuda::indexer + cuda::attention) against
// dense causal attention (ours, and cuDNN's SDPA when the build has it), one layer of
// MiniMax-M3's attention shape by default, on one GPU.
//
//   ceilings: bf16 matmul through cuBLASLt, device-to-device copy, a streaming read kernel,
//             measured first in the same run (the denominators of every "% of peak");
//   prefill:  one sequence of N tokens (varlen layout), all N queries, causal;
//   decode:   paged caches (page = block), shuffled page tables, `batch` requests of Q new
//             queries each at the end of an N-token context; the step is replayed as a
//             CUDA graph when it can be captured (else eager launches between events).
// Every time is the median of CUDA-event-timed calls after warm-up, with its coefficient of
// variation; input sets (Q, K, V, index Q/K, caches, page tables) are replicated and
// rotated so repeated calls do not run from L2. Correctness gates in the same run:
// MSA == our dense where N <= topk * block (every visible block is selected), and our
// dense == cuDNN everywhere both run (relative L2 error below --tolerance).
//
// This header holds what the pieces of the command share (namespace msa::cli::bench_cuda):
//   config.cpp     flags, their checks, usage text     timing.cpp     CUDA-event timing, graphs
//   machine.cpp    GPU description and ceilings        selection.cpp  top-k row checks
//   prefill.cpp    measure_prefill                     decode.cpp     measure_decode
//   report.cpp     markdown tables and JSON lines      main.cpp       run_bench_cuda
//   training_backward.cpp  --training: indexer, sparse fwd / bwd, KL, the step, dense (run_training_bench)
//   training_cudnn.cpp     --training: cuDNN SDPA forward + backward   training_report.cpp  its tables
//   report_text.h          table cells and JSON lines shared by report.cpp and training_report.cpp
#pragma once
#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "bench_shape.h"
#include "cli_args.h"
#include "cuda/common/cuda_check.h"
#include "cuda/common/device_buffer.h"
#include "cuda/launch.h"
#include "msa/error.h"
#include "msa/cuda/quantize.h"
#include "msa/ops.h"

namespace msa::cli::bench_cuda {

using cuda::DeviceBuffer;

extern const char* const kUsage;  // config.cpp

// ---------------------------------------------------------------- configuration (config.cpp)

struct Config : BenchShape {  // heads, kv_heads, head_dim, index_dim, params
  std::vector<int64_t> contexts, decode_contexts, batches, decode_queries;
  int repeats = 20, dense_repeats = 0, decode_repeats = 50, warmup = 1;
  int64_t dense_max_context = 0;  // 0 = no limit
  int64_t ours_dense_max_context = 0;  // prefill: our dense kernel only up to this N (0 = no limit)
  bool cudnn = true;
  double rotate_bytes = 1024.0 * 1024 * 1024;
  double tolerance = 1e-2;
  int matmul_size = 8192;
  // --index-keys: formats of the index keys the decode rows also time beyond bf16 (fp8, fp4).
  std::vector<cuda::KeyFormat> quantized_index_keys;
  // --kv-cache: fp8 K/V scale layouts the decode rows also time beyond bf16 K/V.
  std::vector<cuda::KvScaleLayout> fp8_kv_layouts;
  std::string json_path;
  // --index-coherence c > 0: the index queries of each 128-token block are one base row plus c
  // x the token's own noise (prefill rows), a stand-in for a trained indexer's selections, in
  // which neighbouring queries pick mostly the same blocks; 0: independent random rows.
  double index_coherence = 0;
  // --sparse-orders: the prefill rows also time the sparse stage with each order pinned
  // (kv_major, query_major), beside the automatic per-tile choice.
  bool sparse_orders = false;
  // --index-ranking: the prefill rows' index ranking (MsaParams::cuda.index_ranking).
  cuda::IndexRanking index_ranking = cuda::IndexRanking::automatic;
  bool training = false;       // --training: the training kernels instead of prefill / decode
  // --backward-engine: the training rows' attention backward tile engine
  // (MsaParams::cuda.backward: wgmma where D = B = 128, else mma.sync).
  cuda::Engine backward_engine = cuda::Engine::automatic;
  std::string training_seqs;   // --training-seqs: packed layouts, "N" or "BxN" items
};

Config parse_config(Args& args);

// ---------------------------------------------------------------- timing (timing.cpp)

struct Timing {
  double ms = NAN, cv = NAN;
  int runs = 0;
  bool ok() const { return runs > 0; }
};

class Events {
 public:
  explicit Events(size_t count) : events_(count, nullptr) {
    for (auto& e : events_) MSA_CUDA_CHECK(cudaEventCreate(&e));
  }
  ~Events() {
    for (auto e : events_)
      if (e) cudaEventDestroy(e);
  }
  Events(const Events&) = delete;
  Events& operator=(const Events&) = delete;
  cudaEvent_t operator[](size_t i) const { return events_[i]; }

 private:
  std::vector<cudaEvent_t> events_;
};

// `warmup` untimed calls, then `repeats` calls each between two events on `stream`; call(i)
// gets the running call index (warm-up included), which callers use to rotate input sets.
Timing time_events(cudaStream_t stream, int warmup, int repeats,
                   const std::function<void(int)>& call);

struct GraphExec {
  cudaGraphExec_t exec = nullptr;
  GraphExec() = default;
  GraphExec(const GraphExec&) = delete;
  GraphExec& operator=(const GraphExec&) = delete;
  ~GraphExec() {
    if (exec) cudaGraphExecDestroy(exec);
  }
};

// One decode step per input set: a CUDA graph holding one step of every set in turn,
// replayed `repeats` times between events (time per step = replay / sets); eager steps
// between events when the step cannot be captured. `method` says which.
Timing time_steps(cudaStream_t stream, int sets, int warmup, int repeats,
                  const std::function<void(int)>& step, std::string& method);

// ---------------------------------------------------------------- machine and ceilings (machine.cpp)

struct Machine {
  std::string gpu;
  int cc_major = 0, cc_minor = 0, sms = 0;
  double memory_gib = 0, l2_mib = 0;
  int driver = 0, runtime = 0;
  std::string driver_release = "?";  // the kernel module's version, from /proc
  std::string date;                   // UTC, when the run started
  size_t cublaslt = 0;
  std::string cudnn = "not built";
  Timing matmul, copy, read;
  double matmul_tflops = NAN, copy_gbs = NAN, read_gbs = NAN;
  int64_t matmul_size = 0;
};

void fill_normal(const DeviceBuffer& buffer, uint64_t seed, cudaStream_t stream);
void measure_matmul(Machine& m, int n, int repeats, cudaStream_t stream);
void measure_memory(Machine& m, int repeats, cudaStream_t stream);
Machine describe_machine();

// ---------------------------------------------------------------- selection rows (selection.cpp)

struct SelectionCount {
  double keys = 0;      // sum over (group, query) of selected visible keys
  double kv_bytes = 0;  // K and V bytes of the distinct blocks each (request, group) selected
  int64_t malformed = 0;
};

// topk [heads, batch * q_len, k]: checks every row's structure (valid count min(k, L+1),
// own block L last, ids in [0, L] and distinct, -1 suffix) and counts what it selects.
SelectionCount count_selection(const std::vector<int32_t>& topk, int64_t heads, int64_t batch,
                               int64_t q_len, int64_t k_len, int64_t k, int64_t block,
                               int64_t head_dim);

// Fraction of the rows of two selections [rows, k] (-1 suffix) whose sets of ids differ.
double changed_row_fraction(const std::vector<int32_t>& a, const std::vector<int32_t>& b, int64_t k);

// The query-major order's view of one sequence's selection rows (topk [heads, n, k], n = the
// sequence's queries and keys, group G dividing 128): mean union blocks per 128-row tile over
// the mean valid entries per query, and the share of tiles query_major_pays sends query-major.
struct TileUnionCount {
  double union_factor = 0, query_major_tiles = 0;
};
TileUnionCount count_tile_unions(const std::vector<int32_t>& topk, int64_t heads, int64_t n, int64_t k,
                                 int64_t group);

inline std::vector<int32_t> download_i32(const DeviceBuffer& buffer) {
  std::vector<int32_t> out(buffer.bytes() / 4);
  buffer.download(out.data(), buffer.bytes());
  return out;
}

// ---------------------------------------------------------------- layouts

// Request geometry: `batch` requests of q_len queries at the end of k_len keys.
struct Geometry {
  DeviceBuffer q_start, k_len, seq_of_query, k_start, seq_len_q, seq_len_kv;
  cuda::BatchLayout layout;

  Geometry(int64_t batch, int64_t q_len, int64_t keys) {
    std::vector<int64_t> starts(batch + 1), lengths(batch, keys), token_starts(batch);
    std::vector<int32_t> owner(batch * q_len);
    for (int64_t b = 0; b <= batch; ++b) starts[b] = b * q_len;
    for (int64_t b = 0; b < batch; ++b) token_starts[b] = b * keys;
    for (int64_t i = 0; i < batch * q_len; ++i) owner[i] = static_cast<int32_t>(i / q_len);
    q_start = DeviceBuffer::from(starts);
    k_len = DeviceBuffer::from(lengths);
    seq_of_query = DeviceBuffer::from(owner);
    k_start = DeviceBuffer::from(token_starts);
    seq_len_q = DeviceBuffer::from(std::vector<int32_t>(batch, static_cast<int32_t>(q_len)));
    seq_len_kv = DeviceBuffer::from(std::vector<int32_t>(batch, static_cast<int32_t>(keys)));
    layout.q_start = q_start.as<int64_t>();
    layout.k_len = k_len.as<int64_t>();
    layout.seq_of_query = seq_of_query.as<int32_t>();
    layout.batch = batch;
    layout.total_q = batch * q_len;
    layout.max_k_len = keys;
    layout.max_q_len = q_len;
  }
};

inline size_t free_device_bytes() {
  size_t free = 0, total = 0;
  MSA_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  return free;
}

constexpr size_t kReserveBytes = size_t{4} << 30;  // left free for cuDNN/kernel workspaces

// ---------------------------------------------------------------- rows

struct Row {
  std::string phase;
  int64_t context = 0, batch = 1, queries = 0;
  int copies = 0;
  Timing indexer, sparse, msa, dense, cudnn;
  // decode: the step's first kernels alone, graph-replayed like the step: the index scan
  // (`scan`), and the indexer with the attention kernel but not its merge (`unmerged`). With
  // `indexer` and `msa` they split the step by phase (decode_phase_us).
  Timing scan, unmerged;
  std::string timing_method = "events";  // decode: graph or eager
  double indexer_flops = 0, sparse_flops = 0, dense_flops = 0;  // prefill
  double index_bytes = 0, kv_selected_bytes = 0, dense_bytes = 0;  // decode
  double err_msa_dense = -1, err_dense_cudnn = -1;  // relative L2; -1 = not checked
  int64_t malformed = -1;
  std::string cudnn_plan, cudnn_note, error;
  std::string skipped;  // why the row was not measured (e.g. its inputs exceed the GPU's memory)
  std::string msa_path = "sparse";  // prefill: the path cuda::msa_forward took (sparse | dense)
  std::string index_compute = "exact";  // prefill: MsaParams::index_compute (--index-compute)
  // prefill with --index-compute fp8: fraction of (query, head) rows whose selected set
  // differs from exact compute's on the same inputs (-1: not measured)
  double changed_rows_vs_exact = -1;
  // prefill: the selection's 128-row tiles (8 queries x 16 heads for M3) as the query-major
  // order sees them (count_tile_unions): mean union blocks per tile over the mean valid
  // selection per query, and the share of tiles the automatic order runs query-major.
  double union_factor = -1, query_major_tiles = -1;
  Timing sparse_kv_major, sparse_query_major;  // --sparse-orders
  // decode with --index-keys: the same step with quantized index keys
  struct QuantizedIndexKeys {
    std::string format;  // "fp8" | "fp4"
    Timing indexer, msa;
    double index_bytes = 0;     // codes + scales of every context token
    double changed_rows = -1;   // fraction of (query, head) rows whose set differs from bf16's
    int64_t malformed = -1;
  };
  std::vector<QuantizedIndexKeys> quantized;
  // --kv-cache: decode, the same step over fp8 K/V (the bf16 rows' selection); prefill, sparse
  // and dense attention over fp8 caches (the bf16 copy of src/cuda/attention/fp8_kv_widen.h)
  struct Fp8Kv {
    std::string layout;           // "per_token_head" | "per_tensor"
    Timing sparse, msa, dense;    // selected K/V phase, indexer + it, dense decode
    Timing widen;                 // prefill: the bf16 copy alone (fp8_kv_widen.h)
    double kv_selected_bytes = 0;  // codes + scales of the distinct selected blocks
    double dense_bytes = 0;        // codes + scales of every context token
    double err_sparse_vs_bf16 = -1;  // relative L2 of O against the bf16 cache's
  };
  std::vector<Fp8Kv> fp8_kv;
};

// A row of `phase` ("prefill" | "decode") at context N: `batch` requests of `queries` each.
inline Row new_row(const std::string& phase, int64_t context, int64_t batch, int64_t queries) {
  Row row;
  row.phase = phase;
  row.context = context;
  row.batch = batch;
  row.queries = queries;
  return row;
}

// A decode row's phases in us as differences of its prefixes' medians: scan, select (the rest
// of the indexer), attention (split-K, without the merge), merge. Each is what the phase adds
// to the step, its hand-off included; NaN where a prefix was not timed.
struct DecodePhases {
  double scan = NAN, select = NAN, attention = NAN, merge = NAN;
};
inline DecodePhases decode_phase_us(const Row& r) {
  DecodePhases p;
  if (!r.scan.ok() || !r.unmerged.ok() || !r.indexer.ok() || !r.msa.ok()) return p;
  p.scan = 1e3 * r.scan.ms;
  p.select = 1e3 * (r.indexer.ms - r.scan.ms);
  p.attention = 1e3 * (r.unmerged.ms - r.indexer.ms);
  p.merge = 1e3 * (r.msa.ms - r.unmerged.ms);
  return p;
}

// A check that ran and did not pass (NaN fails); -1 marks a check that did not run.
inline bool check_failed(double error, double tolerance) { return error != -1 && !(error < tolerance); }

inline bool row_failed(const Row& r, double tolerance) {
  for (const Row::QuantizedIndexKeys& q : r.quantized)
    if (q.malformed > 0) return true;
  if (!r.skipped.empty()) return false;
  return !r.error.empty() || r.malformed > 0 || check_failed(r.err_msa_dense, tolerance) ||
         check_failed(r.err_dense_cudnn, tolerance);
}

struct Session {
  const Config& config;
  const Machine& machine;
  cudaStream_t stream;
  uint64_t seed = 1000;
};

inline float main_scale(const Config& c) {
  return static_cast<float>(c.params.scale > 0 ? c.params.scale : 1.0 / std::sqrt(double(c.head_dim)));
}
inline float index_logit_scale(const Config& c) {
  const double s = c.params.index_scale > 0 ? c.params.index_scale : 1.0 / std::sqrt(double(c.index_dim));
  return static_cast<float>(s / c.params.temperature);
}

// Prefill: one sequence of n tokens, all of them queries.
// --kv-cache: K and V quantized on the device (msa::cuda::append_kv_fp8) into paged e4m3
// caches, and the set's launches reading them.
struct Fp8KvSet {
  DeviceBuffer k_codes, v_codes, k_scale, v_scale;
  cuda::AttentionLaunch sparse, dense;
};
// Quantizes append.k / append.v (its tokens, heads, block size and slot mapping set by the
// caller) into [pages, Hkv, B, D] caches of cache_elems codes in `layout`; `paged` is the bf16
// launch whose k / v layouts (strides in elements, equal to the codes' in bytes) the fp8 one
// keeps.
Fp8KvSet quantize_fp8_kv(Session& s, cuda::KvAppendParams append, size_t cache_elems, int64_t Hkv, int64_t B,
                         cuda::KvScaleLayout layout, const cuda::AttentionLaunch& paged);  // fp8_kv.cpp
const char* layout_name(cuda::KvScaleLayout layout);                                       // fp8_kv.cpp
// Bytes read per cached element of an fp8 cache: the code and its share of the scale.
double fp8_bytes_per_element(cuda::KvScaleLayout layout, int64_t head_dim);                 // fp8_kv.cpp
// Device bytes of a K and a V cache of cache_elems codes each, with their scales.
size_t fp8_kv_set_bytes(cuda::KvScaleLayout layout, size_t cache_elems, int64_t head_dim);  // fp8_kv.cpp

struct PrefillSet {
  DeviceBuffer q, k, v, qi, ki, topk;
  cuda::IndexerLaunch index;
  cuda::AttentionLaunch sparse, dense;
  DeviceBuffer table;             // --kv-cache: the identity page table of the fp8 caches
  std::vector<Fp8KvSet> fp8_kv;   // one per Config::fp8_kv_layouts
};

Row measure_prefill(Session& s, int64_t n);  // prefill.cpp

// Decode: `batch` requests of q_len new queries at the end of n-token contexts, paged.
struct DecodeSet {
  DeviceBuffer k_cache, v_cache, ki_cache, table, q, qi, topk;
  cuda::IndexerLaunch index;
  cuda::AttentionLaunch sparse, dense;
  // --index-keys: ki_cache quantized on the device, with its own selection rows.
  struct Quantized {
    DeviceBuffer codes, scales, topk;
    cuda::IndexerLaunch index;
    cuda::AttentionLaunch sparse;
  };
  std::vector<Quantized> quantized;  // one per Config::quantized_index_keys
  std::vector<Fp8KvSet> fp8_kv;  // --kv-cache: one per Config::fp8_kv_layouts
};

Row measure_decode(Session& s, int64_t n, int64_t batch, int64_t q_len);  // decode.cpp

// --training: the training stages, the whole step and the dense baselines at each
// --training-seqs layout; prints its own tables (and JSON lines); returns the exit status.
// training_backward.cpp (bench_cuda/training.h).
int run_training_bench(Session& s);

// ---------------------------------------------------------------- output (report.cpp)

void print_header(const Machine& m, const Config& c);
void print_prefill(const std::vector<Row>& rows, const Machine& m);
void print_decode(const std::vector<Row>& rows, const Machine& m);
void write_json(const std::string& path, const std::vector<Row>& rows, const Machine& m,
                const Config& c);

}  // namespace msa::cli::bench_cuda
