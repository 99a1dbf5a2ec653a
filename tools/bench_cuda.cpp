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
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cli_args.h"
#include "cuda/bench_kernels.h"
#include "cuda/cuda_check.h"
#include "cuda/device_buffer.h"
#include "cuda/launch.h"
#include "msa/error.h"
#include "msa/ops.h"
#ifdef MSA_WITH_CUDNN
#include "cuda/cudnn_sdpa.h"
#endif

namespace msa::cli {

int run_bench_cuda(Args& args);

namespace {

using cuda::DeviceBuffer;


#define BENCH_CUBLAS(call)                                                               \
  do {                                                                                   \
    const cublasStatus_t bench_status = (call);                                          \
    if (bench_status != CUBLAS_STATUS_SUCCESS)                                           \
      MSA_FAIL("cuBLASLt error at ", __FILE__, ":", __LINE__, ": ", #call, ": ",        \
               cublasLtGetStatusName(bench_status), " (",                                \
               cublasLtGetStatusString(bench_status), ")");                              \
  } while (0)

constexpr const char* kUsage =
    "usage: msa bench --device cuda [--contexts 2048,8192,32768,131072]\n"
    "                 [--decode-contexts 8192,131072 --batches 1,8 --queries 1,8]\n"
    "                 [--heads 64 --kv-heads 4 --head-dim 128 --index-dim 128]\n"
    "                 [--block-size 128 --topk 16 --local-blocks 1 --init-blocks 0]\n"
    "                 [--repeats 20 --dense-repeats AUTO --decode-repeats 50 --warmup 1]\n"
    "                 [--dense-max-context N] [--cudnn 1] [--rotate-mb 1024]\n"
    "                 [--tolerance 1e-2] [--matmul-size 8192] [--json FILE]\n"
    "Times our MSA kernels (indexer, sparse attention, both) against dense causal attention\n"
    "(our kernel with topk = null, and cuDNN SDPA when built with the cuDNN frontend) on one\n"
    "GPU, after measuring the GPU's matmul, copy and read ceilings. `--contexts none` or\n"
    "`--decode-contexts none` skips a phase. --dense-repeats defaults to 20 below 512K tokens\n"
    "and 2 from 512K; --dense-max-context skips both dense prefills above that length.\n"
    "Exit status 1 when a correctness gate fails: MSA vs our dense where N <= topk*block,\n"
    "our dense vs cuDNN everywhere, malformed selection rows.\n";

// ---------------------------------------------------------------- configuration

struct Config {
  std::vector<int64_t> contexts, decode_contexts, batches, decode_queries;
  int64_t heads = 64, kv_heads = 4, head_dim = 128, index_dim = 128;
  MsaParams params;
  int repeats = 20, dense_repeats = 0, decode_repeats = 50, warmup = 1;
  int64_t dense_max_context = 0;  // 0 = no limit
  bool cudnn = true;
  double rotate_bytes = 1024.0 * 1024 * 1024;
  double tolerance = 1e-2;
  int matmul_size = 8192;
  std::string json_path;
};

std::vector<int64_t> parse_list(const std::string& flag, const std::string& text) {
  std::vector<int64_t> out;
  if (text == "none" || text.empty()) return out;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = text.find(',', start);
    const std::string item = text.substr(start, comma - start);
    try {
      size_t used = 0;
      const long long value = std::stoll(item, &used);
      if (used != item.size() || value < 1) throw std::invalid_argument(item);
      out.push_back(value);
    } catch (const std::exception&) {
      throw UsageError("--" + flag + ": expected comma-separated positive integers or none, got \"" +
                       text + "\"");
    }
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

Config parse_config(Args& args) {
  Config c;
  args.get_string("device", "cuda");
  c.contexts = parse_list("contexts", args.get_string("contexts", "2048,8192,32768,131072"));
  c.decode_contexts = parse_list("decode-contexts", args.get_string("decode-contexts", "8192,131072"));
  c.batches = parse_list("batches", args.get_string("batches", "1,8"));
  c.decode_queries = parse_list("queries", args.get_string("queries", "1,8"));
  c.heads = args.get_int("heads", 64);
  c.kv_heads = args.get_int("kv-heads", 4);
  c.head_dim = args.get_int("head-dim", 128);
  c.index_dim = args.get_int("index-dim", 128);
  c.params.block_size = args.get_int("block-size", 128);
  c.params.topk = args.get_int("topk", 16);
  c.params.local_blocks = args.get_int("local-blocks", 1);
  c.params.init_blocks = args.get_int("init-blocks", 0);
  c.repeats = args.get_int("repeats", 20);
  c.dense_repeats = args.get_int("dense-repeats", 0);
  c.decode_repeats = args.get_int("decode-repeats", 50);
  c.warmup = args.get_int("warmup", 1);
  c.dense_max_context = args.get_int("dense-max-context", 0);
  c.cudnn = args.get_int("cudnn", 1) != 0;
  c.rotate_bytes = args.get_double("rotate-mb", 1024) * 1024 * 1024;
  c.tolerance = args.get_double("tolerance", 1e-2);
  c.matmul_size = args.get_int("matmul-size", 8192);
  c.json_path = args.get_string("json", "");
  args.finish();
  validate_params(c.params);
  if (c.repeats < 1 || c.dense_repeats < 0 || c.decode_repeats < 1 || c.warmup < 0)
    throw UsageError("--repeats/--decode-repeats: expected positive counts (--dense-repeats, "
                     "--warmup: >= 0)");
  if (c.kv_heads < 1 || c.heads % c.kv_heads != 0)
    throw UsageError("--heads: expected a multiple of --kv-heads");
  if (c.head_dim < 8 || c.index_dim < 8) throw UsageError("--head-dim/--index-dim: expected >= 8");
  if (c.matmul_size < 256 || c.matmul_size % 256)
    throw UsageError("--matmul-size: expected a multiple of 256");
  for (int64_t n : c.contexts)
    if (n > (int64_t{1} << 20) * 4) throw UsageError("--contexts: at most 4194304 tokens");
  if ((!c.decode_contexts.empty()) && (c.batches.empty() || c.decode_queries.empty()))
    throw UsageError("--batches/--queries: expected at least one value when decoding");
  for (int64_t n : c.decode_contexts)
    for (int64_t q : c.decode_queries)
      if (q > n) throw UsageError("--queries: each must be <= every --decode-contexts value");
  return c;
}

// ---------------------------------------------------------------- timing

struct Timing {
  double ms = NAN, cv = NAN;
  int runs = 0;
  bool ok() const { return runs > 0; }
};

Timing summarize(const std::vector<double>& ms) {
  Timing t;
  if (ms.empty()) return t;
  std::vector<double> sorted = ms;
  std::sort(sorted.begin(), sorted.end());
  const size_t n = sorted.size();
  t.ms = n % 2 ? sorted[n / 2] : 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]);
  double mean = 0, var = 0;
  for (double x : ms) mean += x / n;
  for (double x : ms) var += (x - mean) * (x - mean) / n;
  t.cv = mean > 0 ? std::sqrt(var) / mean : 0;
  t.runs = static_cast<int>(n);
  return t;
}

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
                   const std::function<void(int)>& call) {
  for (int i = 0; i < warmup; ++i) call(i);
  Events events(2 * static_cast<size_t>(repeats));
  for (int i = 0; i < repeats; ++i) {
    MSA_CUDA_CHECK(cudaEventRecord(events[2 * i], stream));
    call(warmup + i);
    MSA_CUDA_CHECK(cudaEventRecord(events[2 * i + 1], stream));
  }
  MSA_CUDA_CHECK(cudaEventSynchronize(events[2 * static_cast<size_t>(repeats) - 1]));
  std::vector<double> ms(repeats);
  for (int i = 0; i < repeats; ++i) {
    float elapsed = 0;
    MSA_CUDA_CHECK(cudaEventElapsedTime(&elapsed, events[2 * i], events[2 * i + 1]));
    ms[i] = elapsed;
  }
  return summarize(ms);
}

struct GraphExec {
  cudaGraphExec_t exec = nullptr;
  GraphExec() = default;
  GraphExec(const GraphExec&) = delete;
  GraphExec& operator=(const GraphExec&) = delete;
  ~GraphExec() {
    if (exec) cudaGraphExecDestroy(exec);
  }
};

// Captures body() on `stream` into `out`; false (with the reason) when it cannot be captured.
bool capture(cudaStream_t stream, const std::function<void()>& body, GraphExec& out,
             std::string& why) {
  cudaGraph_t graph = nullptr;
  if (const cudaError_t e = cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal);
      e != cudaSuccess) {
    cudaGetLastError();
    why = cudaGetErrorString(e);
    return false;
  }
  std::string error;
  try {
    body();
  } catch (const std::exception& e) {
    error = e.what();
  }
  const cudaError_t end = cudaStreamEndCapture(stream, &graph);
  cudaGetLastError();  // a refused call during capture leaves a (non-sticky) error behind
  if (!error.empty() || end != cudaSuccess || !graph) {
    if (graph) cudaGraphDestroy(graph);
    why = !error.empty() ? error : cudaGetErrorString(end);
    return false;
  }
  const cudaError_t inst = cudaGraphInstantiate(&out.exec, graph, 0);
  cudaGraphDestroy(graph);
  if (inst != cudaSuccess) {
    cudaGetLastError();
    out.exec = nullptr;
    why = cudaGetErrorString(inst);
    return false;
  }
  return true;
}

// One decode step per input set: a CUDA graph holding one step of every set in turn,
// replayed `repeats` times between events (time per step = replay / sets); eager steps
// between events when the step cannot be captured. `method` says which.
Timing time_steps(cudaStream_t stream, int sets, int warmup, int repeats,
                  const std::function<void(int)>& step, std::string& method) {
  for (int c = 0; c < sets; ++c) step(c);  // warm-up and lazy module loading, outside capture
  MSA_CUDA_CHECK(cudaStreamSynchronize(stream));
  GraphExec graph;
  std::string why;
  if (capture(stream, [&] { for (int c = 0; c < sets; ++c) step(c); }, graph, why)) {
    Timing t = time_events(stream, std::max(warmup, 1), repeats,
                           [&](int) { MSA_CUDA_CHECK(cudaGraphLaunch(graph.exec, stream)); });
    t.ms /= sets;
    method = "graph";
    return t;
  }
  std::fprintf(stderr, "[bench]     not capturable (%s): timing eager launches\n", why.c_str());
  MSA_CUDA_CHECK(cudaStreamSynchronize(stream));
  method = "eager";
  return time_events(stream, warmup, std::max(repeats, sets), [&](int i) { step(i % sets); });
}

// ---------------------------------------------------------------- machine and ceilings

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

std::string version_text(int v) {  // 13000 -> "13.0"
  return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
}

void fill_normal(const DeviceBuffer& buffer, uint64_t seed, cudaStream_t stream) {
  cuda::bench::fill_normal_bf16(buffer.as<uint16_t>(), buffer.bytes() / 2, seed, 1.0f, stream);
}

void measure_matmul(Machine& m, int n, int repeats, cudaStream_t stream) {
  const size_t elems = static_cast<size_t>(n) * n;
  DeviceBuffer a(elems * 2), b(elems * 2), c(elems * 2);
  const size_t workspace_bytes = size_t{64} << 20;
  DeviceBuffer workspace(workspace_bytes);
  fill_normal(a, 101, stream);
  fill_normal(b, 102, stream);

  cublasLtHandle_t lt = nullptr;
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  auto release = [&] {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (lc) cublasLtMatrixLayoutDestroy(lc);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (op) cublasLtMatmulDescDestroy(op);
    if (lt) cublasLtDestroy(lt);
  };
  try {
    BENCH_CUBLAS(cublasLtCreate(&lt));
    BENCH_CUBLAS(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t transa = CUBLAS_OP_T, transb = CUBLAS_OP_N;  // "TN", row-major A
    BENCH_CUBLAS(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &transa,
                                                sizeof transa));
    BENCH_CUBLAS(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &transb,
                                                sizeof transb));
    BENCH_CUBLAS(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, n, n, n));
    BENCH_CUBLAS(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, n, n, n));
    BENCH_CUBLAS(cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, n, n, n));
    BENCH_CUBLAS(cublasLtMatmulPreferenceCreate(&pref));
    BENCH_CUBLAS(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes, sizeof workspace_bytes));
    cublasLtMatmulHeuristicResult_t heuristic{};
    int found = 0;
    BENCH_CUBLAS(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, lc, lc, pref, 1, &heuristic, &found));
    if (found < 1) MSA_FAIL("cuBLASLt: no bf16 matmul algorithm for ", n, "^3");
    const float alpha = 1, beta = 0;
    m.matmul = time_events(stream, 3, repeats, [&](int) {
      BENCH_CUBLAS(cublasLtMatmul(lt, op, &alpha, a.get(), la, b.get(), lb, &beta, c.get(), lc,
                                  c.get(), lc, &heuristic.algo, workspace.get(), workspace_bytes,
                                  stream));
    });
  } catch (...) {
    release();
    throw;
  }
  release();
  m.matmul_size = n;
  m.matmul_tflops = 2.0 * n * n * static_cast<double>(n) / (m.matmul.ms * 1e-3) / 1e12;
}

void measure_memory(Machine& m, int repeats, cudaStream_t stream) {
  const size_t copy_bytes = size_t{1} << 30, read_bytes = size_t{2} << 30;
  {
    DeviceBuffer src(copy_bytes), dst(copy_bytes);
    fill_normal(src, 103, stream);
    m.copy = time_events(stream, 2, repeats, [&](int) {
      MSA_CUDA_CHECK(cudaMemcpyAsync(dst.get(), src.get(), copy_bytes, cudaMemcpyDeviceToDevice, stream));
    });
    m.copy_gbs = 2.0 * copy_bytes / (m.copy.ms * 1e-3) / 1e9;
  }
  DeviceBuffer data(read_bytes), sink(16);
  fill_normal(data, 104, stream);
  m.read = time_events(stream, 2, repeats, [&](int) {
    cuda::bench::stream_read(data.get(), read_bytes, sink.as<uint32_t>(), stream);
  });
  m.read_gbs = read_bytes / (m.read.ms * 1e-3) / 1e9;
}

Machine describe_machine() {
  Machine m;
  int device = 0;
  MSA_CUDA_CHECK(cudaGetDevice(&device));
  cudaDeviceProp prop{};
  MSA_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  m.gpu = prop.name;
  m.cc_major = prop.major;
  m.cc_minor = prop.minor;
  m.sms = prop.multiProcessorCount;
  m.memory_gib = prop.totalGlobalMem / double(1 << 30);
  m.l2_mib = prop.l2CacheSize / double(1 << 20);
  MSA_CUDA_CHECK(cudaDriverGetVersion(&m.driver));
  MSA_CUDA_CHECK(cudaRuntimeGetVersion(&m.runtime));
  m.cublaslt = cublasLtGetVersion();
  if (std::ifstream proc("/proc/driver/nvidia/version"); proc) {
    std::string line;
    std::getline(proc, line);  // "NVRM version: NVIDIA UNIX ... Kernel Module  580.65.06  ..."
    std::istringstream words(line);
    std::string word, previous;
    while (words >> word) {
      if (previous == "Module") {
        m.driver_release = word;
        break;
      }
      previous = word;
    }
  }
  const std::time_t now = std::time(nullptr);
  char date[32];
  std::strftime(date, sizeof date, "%Y-%m-%d %H:%M UTC", std::gmtime(&now));
  m.date = date;
#ifdef MSA_WITH_CUDNN
  m.cudnn = cuda::cudnn_version_string() + " (frontend " + cuda::cudnn_frontend_version_string() + ")";
#endif
  return m;
}

// ---------------------------------------------------------------- selection rows

struct SelectionCount {
  double keys = 0;      // sum over (group, query) of selected visible keys
  double kv_bytes = 0;  // K and V bytes of the distinct blocks each (request, group) selected
  int64_t malformed = 0;
};

// topk [heads, batch * q_len, k]: checks every row's structure (valid count min(k, L+1),
// own block L last, ids in [0, L] and distinct, -1 suffix) and counts what it selects.
SelectionCount count_selection(const std::vector<int32_t>& topk, int64_t heads, int64_t batch,
                               int64_t q_len, int64_t k_len, int64_t k, int64_t block,
                               int64_t head_dim) {
  SelectionCount out;
  const int64_t total_q = batch * q_len;
  const int64_t pages = (k_len + block - 1) / block;
  std::vector<uint32_t> seen(pages, 0), in_row(pages, 0);
  uint32_t stamp = 0, row_stamp = 0;
  for (int64_t g = 0; g < heads; ++g) {
    for (int64_t r = 0; r < batch; ++r) {
      ++stamp;
      for (int64_t i = 0; i < q_len; ++i) {
        ++row_stamp;
        const int64_t pos = k_len - q_len + i, local = pos / block;
        const int32_t* row = topk.data() + (g * total_q + r * q_len + i) * k;
        int64_t valid = 0;
        while (valid < k && row[valid] >= 0) ++valid;
        bool bad = valid != std::min<int64_t>(k, local + 1);
        for (int64_t s = valid; s < k; ++s) bad |= row[s] != -1;
        if (valid > 0) bad |= row[valid - 1] != local;
        for (int64_t s = 0; s < valid; ++s) {
          const int64_t id = row[s];
          if (id > local) {
            bad = true;
            continue;
          }
          if (in_row[id] == row_stamp) bad = true;
          in_row[id] = row_stamp;
          out.keys += static_cast<double>(std::min(block, pos - id * block + 1));
          if (seen[id] != stamp) {
            seen[id] = stamp;
            out.kv_bytes += 4.0 * head_dim * std::min(block, k_len - id * block);
          }
        }
        out.malformed += bad;
      }
    }
  }
  return out;
}

std::vector<int32_t> download_i32(const DeviceBuffer& buffer) {
  std::vector<int32_t> out(buffer.bytes() / 4);
  buffer.download(out.data(), buffer.bytes());
  return out;
}

// ---------------------------------------------------------------- layouts

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

cuda::KeyLayout paged_keys(const DeviceBuffer& data, int64_t heads, int64_t dim, int64_t block,
                           const DeviceBuffer& table, int64_t table_stride) {
  cuda::KeyLayout l;
  l.data = data.as<uint16_t>();
  l.block_size = block;
  l.token_stride = dim;
  l.head_stride = block * dim;
  l.block_stride = heads * block * dim;
  l.page_table = table.as<int32_t>();
  l.page_table_stride = table_stride;
  return l;
}

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

size_t free_device_bytes() {
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
  std::string timing_method = "events";  // decode: graph or eager
  double indexer_flops = 0, sparse_flops = 0, dense_flops = 0;  // prefill
  double index_bytes = 0, kv_selected_bytes = 0, dense_bytes = 0;  // decode
  double err_msa_dense = -1, err_dense_cudnn = -1;  // relative L2; -1 = not checked
  int64_t malformed = -1;
  std::string cudnn_plan, cudnn_note, error;
  std::string msa_path = "sparse";  // prefill: the path cuda::msa_forward took (sparse | dense)
};

// A check that ran and did not pass (NaN fails); -1 marks a check that did not run.
bool check_failed(double error, double tolerance) { return error != -1 && !(error < tolerance); }

bool row_failed(const Row& r, double tolerance) {
  return !r.error.empty() || r.malformed > 0 || check_failed(r.err_msa_dense, tolerance) ||
         check_failed(r.err_dense_cudnn, tolerance);
}

struct Session {
  const Config& config;
  const Machine& machine;
  cudaStream_t stream;
  uint64_t seed = 1000;
};

float main_scale(const Config& c) {
  return static_cast<float>(c.params.scale > 0 ? c.params.scale : 1.0 / std::sqrt(double(c.head_dim)));
}
float index_logit_scale(const Config& c) {
  const double s = c.params.index_scale > 0 ? c.params.index_scale : 1.0 / std::sqrt(double(c.index_dim));
  return static_cast<float>(s / c.params.temperature);
}

// Prefill: one sequence of n tokens, all of them queries.
struct PrefillSet {
  DeviceBuffer q, k, v, qi, ki, topk;
  cuda::IndexerParams index;
  cuda::AttentionParams sparse, dense;
};

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

// Decode: `batch` requests of q_len new queries at the end of n-token contexts, paged.
struct DecodeSet {
  DeviceBuffer k_cache, v_cache, ki_cache, table, q, qi, topk;
  cuda::IndexerParams index;
  cuda::AttentionParams sparse, dense;
};

Row measure_decode(Session& s, int64_t n, int64_t batch, int64_t q_len) {
  const Config& c = s.config;
  const int64_t Hq = c.heads, Hkv = c.kv_heads, D = c.head_dim, Di = c.index_dim, Hi = c.kv_heads;
  const int64_t B = c.params.block_size, k = c.params.topk;
  Row row;
  row.phase = "decode";
  row.context = n;
  row.batch = batch;
  row.queries = q_len;
  const bool gate = n <= k * B;
  const int64_t pages_per_request = (n + B - 1) / B, pages = batch * pages_per_request;
  const int64_t total_q = batch * q_len;
  const size_t q_elems = total_q * Hq * D;
  const size_t cache_elems = static_cast<size_t>(pages) * Hkv * B * D;
  const size_t set_bytes = 2 * (2 * cache_elems + static_cast<size_t>(pages) * B * Di + q_elems +
                                total_q * Hi * Di) +
                           4 * static_cast<size_t>(pages + Hi * total_q * k);

  Geometry geometry(batch, q_len, n);
  DeviceBuffer o(q_elems * 4), lse(static_cast<size_t>(total_q * Hq) * 4);
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
    cuda::IndexerParams& ip = set->index;
    ip.qi = set->qi.as<uint16_t>();
    ip.heads = Hi;
    ip.dim = Di;
    ip.ki = paged_keys(set->ki_cache, 1, Di, B, set->table, pages_per_request);
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
    ap.k = paged_keys(set->k_cache, Hkv, D, B, set->table, pages_per_request);
    ap.v = paged_keys(set->v_cache, Hkv, D, B, set->table, pages_per_request);
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
                                     cuda::attention_workspace_bytes(sets[0]->dense)));

#ifdef MSA_WITH_CUDNN
  std::unique_ptr<cuda::CudnnSdpa> sdpa;
  DeviceBuffer o_ref;
  if (c.cudnn) {
    try {
      cuda::CudnnSdpaShape shape;
      shape.batch = batch;
      shape.q_heads = Hq;
      shape.kv_heads = Hkv;
      shape.head_dim = D;
      shape.q_len = q_len;
      shape.k_len = pages_per_request * B;
      shape.scale = main_scale(c);
      shape.causal = true;
      shape.block_size = B;
      shape.pages = pages;
      shape.table_stride = pages_per_request;
      sdpa = std::make_unique<cuda::CudnnSdpa>(shape);
      row.cudnn_plan = sdpa->plan_name();
      o_ref = DeviceBuffer(q_elems * 2);
    } catch (const std::exception& e) {
      row.cudnn_note = e.what();
      std::fprintf(stderr, "[bench]   cuDNN SDPA (paged) unavailable: %s\n", e.what());
    }
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

  const int64_t target = std::clamp<int64_t>(
      static_cast<int64_t>(std::ceil(c.rotate_bytes / static_cast<double>(set_bytes))), 1, 32);
  while (static_cast<int64_t>(sets.size()) < target && free_device_bytes() > set_bytes + kReserveBytes)
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
  row.dense = time_steps(st, copies, c.warmup, c.decode_repeats, [&](int i) {
    cuda::attention(sets[i]->dense, attention_ws.get(), st);
  }, method);
  if (row.timing_method.find(method) == std::string::npos) row.timing_method += "/" + method;
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
  if (gate) {
    cuda::AttentionParams p = first.sparse;
    p.o = o_msa.as<float>();
    cuda::attention(p, attention_ws.get(), st);
    row.err_msa_dense = cuda::bench::relative_l2_error(o_msa.as<float>(), o.get(), false, q_elems, st);
  }
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
  row.index_bytes = 2.0 * batch * n * Di;
  row.kv_selected_bytes = count.kv_bytes;
  row.dense_bytes = 4.0 * batch * n * Hkv * D;
  return row;
}

// ---------------------------------------------------------------- output

std::string num(double value, const char* format) {
  if (!std::isfinite(value)) return "-";
  char text[64];
  std::snprintf(text, sizeof text, format, value);
  return text;
}

std::string time_cv(const Timing& t, double scale, const char* format) {
  if (!t.ok()) return "-";
  return num(t.ms * scale, format) + " (" + num(t.cv, "%.2f") + ")";
}

std::string rate(double work, const Timing& t, double unit, double peak) {  // "123 (45%)"
  if (!t.ok() || work <= 0) return "-";
  const double r = work / (t.ms * 1e-3) / unit;
  return num(r, "%.0f") + " (" + num(100.0 * r / peak, "%.0f") + "%)";
}

std::string ratio(const Timing& base, const Timing& t) {
  if (!base.ok() || !t.ok()) return "-";
  return num(base.ms / t.ms, "%.2f") + "x";
}

std::string error_text(double e) {
  if (e == -1) return "-";
  return std::isnan(e) ? "NaN" : num(e, "%.1e");
}

void print_header(const Machine& m, const Config& c) {
  std::printf("msa bench: cuda, %s (sm_%d%d, %d SMs, %.1f GiB, L2 %.0f MiB); driver %s "
              "(CUDA %s), runtime %s, cuBLASLt %zu, cuDNN %s; %s\n",
              m.gpu.c_str(), m.cc_major, m.cc_minor, m.sms, m.memory_gib, m.l2_mib,
              m.driver_release.c_str(), version_text(m.driver).c_str(),
              version_text(m.runtime).c_str(), m.cublaslt, m.cudnn.c_str(), m.date.c_str());
  std::printf("ceilings measured in this run (median of %d, cv): bf16 matmul %lld^3 (cuBLASLt, "
              "random normal) %.1f TFLOP/s (%.3f); device-to-device copy %.0f GB/s read+write "
              "(%.3f); streaming read %.0f GB/s (%.3f)\n",
              m.matmul.runs, static_cast<long long>(m.matmul_size), m.matmul_tflops, m.matmul.cv,
              m.copy_gbs, m.copy.cv, m.read_gbs, m.read.cv);
  std::printf("shape: Hq %lld, Hkv %lld, D %lld, Hi %lld, Di %lld, block %d, top-%d, local %d, "
              "init %d; bf16 random normal inputs, f32 outputs (ours), bf16 (cuDNN)\n",
              static_cast<long long>(c.heads), static_cast<long long>(c.kv_heads),
              static_cast<long long>(c.head_dim), static_cast<long long>(c.kv_heads),
              static_cast<long long>(c.index_dim), c.params.block_size, c.params.topk,
              c.params.local_blocks, c.params.init_blocks);
  std::printf("baselines: dense (ours) = cuda::attention with topk = null; cuDNN = SDPA forward "
              "(cuDNN frontend graph, heuristics A), causal: prefill top-left (= bottom-right, "
              "Sq == Sk), decode bottom-right with padding mask over the paged caches\n");
}

void print_prefill(const std::vector<Row>& rows, const Machine& m) {
  std::printf(
      "\nprefill: one sequence of N tokens, all N queries (varlen); ms = median of CUDA-event "
      "timed calls (cv); TFLOP/s (%% of the measured %.0f TFLOP/s matmul): dense 4*D*Hq per "
      "causal pair, indexer 2*Di*Hi per visible pair, sparse 4*D*G per selected visible key "
      "and q-head group. MSA = cuda::msa_forward, which runs the dense kernel where every "
      "context is <= topk * block (MSA equals dense there); the stage columns time the "
      "indexer and the sparse kernel alone\n\n"
      "| N | sets | indexer ms | indexer TFLOP/s | sparse ms | sparse TFLOP/s | MSA path | MSA ms (cv) | "
      "dense ms (cv) | dense TFLOP/s | cuDNN ms (cv) | cuDNN TFLOP/s | MSA vs cuDNN | "
      "MSA vs dense | MSA-dense err | dense-cuDNN err | bad rows |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
      m.matmul_tflops);
  for (const Row& r : rows) {
    if (r.phase != "prefill") continue;
    if (!r.error.empty()) {
      std::printf("| %lld | error: %s |\n", static_cast<long long>(r.context), r.error.c_str());
      continue;
    }
    std::printf("| %lld | %d | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %lld |\n",
                static_cast<long long>(r.context), r.copies, time_cv(r.indexer, 1, "%.3f").c_str(),
                rate(r.indexer_flops, r.indexer, 1e12, m.matmul_tflops).c_str(),
                time_cv(r.sparse, 1, "%.3f").c_str(),
                rate(r.sparse_flops, r.sparse, 1e12, m.matmul_tflops).c_str(), r.msa_path.c_str(),
                time_cv(r.msa, 1, "%.3f").c_str(), time_cv(r.dense, 1, "%.3f").c_str(),
                rate(r.dense_flops, r.dense, 1e12, m.matmul_tflops).c_str(),
                time_cv(r.cudnn, 1, "%.3f").c_str(),
                rate(r.dense_flops, r.cudnn, 1e12, m.matmul_tflops).c_str(),
                ratio(r.cudnn, r.msa).c_str(), ratio(r.dense, r.msa).c_str(),
                error_text(r.err_msa_dense).c_str(), error_text(r.err_dense_cudnn).c_str(),
                static_cast<long long>(r.malformed));
  }
}

void print_decode(const std::vector<Row>& rows, const Machine& m) {
  std::printf(
      "\ndecode: paged caches (page = block), shuffled page tables; us per step = median of "
      "CUDA-graph replays over the input sets (or eager launches), (cv); GB/s (%% of the "
      "measured %.0f GB/s streaming read) against the bytes each must read: MSA = index keys "
      "scanned + distinct selected K/V blocks, dense = all K/V\n\n"
      "| N | batch | Q | sets | indexer us | sparse us | MSA us (cv) | MSA GB/s | dense us (cv) | "
      "dense GB/s | cuDNN us (cv) | cuDNN GB/s | MSA vs cuDNN | MSA vs dense | timing | "
      "MSA-dense err | dense-cuDNN err | bad rows |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
      m.read_gbs);
  for (const Row& r : rows) {
    if (r.phase != "decode") continue;
    if (!r.error.empty()) {
      std::printf("| %lld | %lld | %lld | error: %s |\n", static_cast<long long>(r.context),
                  static_cast<long long>(r.batch), static_cast<long long>(r.queries), r.error.c_str());
      continue;
    }
    std::printf("| %lld | %lld | %lld | %d | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %lld |\n",
                static_cast<long long>(r.context), static_cast<long long>(r.batch),
                static_cast<long long>(r.queries), r.copies,
                time_cv(r.indexer, 1e3, "%.1f").c_str(), time_cv(r.sparse, 1e3, "%.1f").c_str(),
                time_cv(r.msa, 1e3, "%.1f").c_str(),
                rate(r.index_bytes + r.kv_selected_bytes, r.msa, 1e9, m.read_gbs).c_str(),
                time_cv(r.dense, 1e3, "%.1f").c_str(),
                rate(r.dense_bytes, r.dense, 1e9, m.read_gbs).c_str(),
                time_cv(r.cudnn, 1e3, "%.1f").c_str(),
                rate(r.dense_bytes, r.cudnn, 1e9, m.read_gbs).c_str(), ratio(r.cudnn, r.msa).c_str(),
                ratio(r.dense, r.msa).c_str(), r.timing_method.c_str(),
                error_text(r.err_msa_dense).c_str(), error_text(r.err_dense_cudnn).c_str(),
                static_cast<long long>(r.malformed));
  }
}

std::string json_escape(const std::string& text) {
  std::string out;
  for (char ch : text) {
    if (ch == '"' || ch == '\\') {
      out += '\\';
      out += ch;
    } else if (static_cast<unsigned char>(ch) < 0x20) {
      out += ' ';
    } else {
      out += ch;
    }
  }
  return out;
}

class JsonLine {
 public:
  JsonLine& add(const std::string& key, double value) {
    return raw(key, std::isfinite(value) ? num(value, "%.6g") : "null");
  }
  JsonLine& add(const std::string& key, int64_t value) { return raw(key, std::to_string(value)); }
  JsonLine& add(const std::string& key, int value) { return raw(key, std::to_string(value)); }
  JsonLine& add(const std::string& key, const std::string& value) {
    return raw(key, "\"" + json_escape(value) + "\"");
  }
  JsonLine& add(const std::string& key, const char* value) { return add(key, std::string(value)); }
  JsonLine& add(const std::string& key, const Timing& t) {
    add(key + "_ms", t.ok() ? t.ms : NAN);
    add(key + "_cv", t.ok() ? t.cv : NAN);
    return add(key + "_runs", t.runs);
  }
  std::string str() const { return "{" + body_ + "}"; }

 private:
  JsonLine& raw(const std::string& key, const std::string& value) {
    if (!body_.empty()) body_ += ",";
    body_ += "\"" + key + "\":" + value;
    return *this;
  }
  std::string body_;
};

void write_json(const std::string& path, const std::vector<Row>& rows, const Machine& m,
                const Config& c) {
  std::ofstream out(path);
  if (!out) throw Error("--json: cannot write \"" + path + "\"");
  for (const Row& r : rows) {
    JsonLine j;
    j.add("device", "cuda").add("gpu", m.gpu).add("sms", m.sms)
        .add("date", m.date).add("driver", m.driver_release)
        .add("driver_api", version_text(m.driver)).add("runtime", version_text(m.runtime))
        .add("cublaslt", static_cast<int64_t>(m.cublaslt)).add("cudnn", m.cudnn)
        .add("matmul_tflops", m.matmul_tflops).add("copy_gb_per_s", m.copy_gbs)
        .add("read_gb_per_s", m.read_gbs)
        .add("phase", r.phase).add("context", r.context).add("batch", r.batch)
        .add("queries", r.queries).add("heads", c.heads).add("kv_heads", c.kv_heads)
        .add("head_dim", c.head_dim).add("index_dim", c.index_dim)
        .add("block_size", c.params.block_size).add("topk", c.params.topk)
        .add("input_sets", r.copies).add("timing", r.timing_method)
        .add("indexer", r.indexer).add("sparse", r.sparse).add("msa", r.msa)
        .add("dense", r.dense).add("cudnn", r.cudnn);
    if (r.phase == "prefill") {
      j.add("indexer_flops", r.indexer_flops).add("sparse_flops", r.sparse_flops)
          .add("dense_flops", r.dense_flops).add("msa_path", r.msa_path);
    } else {
      j.add("index_bytes", r.index_bytes).add("kv_selected_bytes", r.kv_selected_bytes)
          .add("dense_bytes", r.dense_bytes);
    }
    j.add("msa_vs_cudnn", r.cudnn.ok() && r.msa.ok() ? r.cudnn.ms / r.msa.ms : NAN)
        .add("msa_vs_dense", r.dense.ok() && r.msa.ok() ? r.dense.ms / r.msa.ms : NAN)
        .add("err_msa_dense", r.err_msa_dense == -1 ? NAN : r.err_msa_dense)
        .add("err_dense_cudnn", r.err_dense_cudnn == -1 ? NAN : r.err_dense_cudnn)
        .add("checks_passed", !row_failed(r, c.tolerance) ? 1 : 0)
        .add("malformed_rows", r.malformed).add("cudnn_plan", r.cudnn_plan)
        .add("cudnn_note", r.cudnn_note).add("error", r.error);
    out << j.str() << "\n";
  }
}

}  // namespace

int run_bench_cuda(Args& args) {
  try {
    if (args.get_switch("help")) {
      std::fputs(kUsage, stdout);
      return 0;
    }
    const Config config = parse_config(args);
    if (cuda::device_count() < 1) {
      std::fprintf(stderr, "msa bench: error: --device cuda: no CUDA device is visible\n");
      return 2;
    }
    cudaStream_t stream = nullptr;
    MSA_CUDA_CHECK(cudaStreamCreate(&stream));  // blocking: ordered after legacy-stream uploads
    Machine machine = describe_machine();
    std::fprintf(stderr, "[bench] %s: measuring the ceilings (matmul %d^3, copy, read) ...\n",
                 machine.gpu.c_str(), config.matmul_size);
    measure_matmul(machine, config.matmul_size, 20, stream);
    measure_memory(machine, 20, stream);
    std::fprintf(stderr, "[bench]   matmul %.1f TFLOP/s, copy %.0f GB/s, read %.0f GB/s\n",
                 machine.matmul_tflops, machine.copy_gbs, machine.read_gbs);
    print_header(machine, config);
    std::fflush(stdout);

    Session session{config, machine, stream};
    std::vector<Row> rows;
    bool failed = false, device_lost = false;
    auto guarded = [&](Row fallback, const std::function<Row()>& measure) {
      if (device_lost) return;
      try {
        rows.push_back(measure());
      } catch (const std::exception& e) {
        fallback.error = e.what();
        rows.push_back(fallback);
        std::fprintf(stderr, "[bench]   error: %s\n", e.what());
        const cudaError_t sticky = cudaDeviceSynchronize();
        if (sticky != cudaSuccess) {
          std::fprintf(stderr, "[bench]   the device is unusable (%s): stopping\n",
                       cudaGetErrorString(sticky));
          device_lost = true;
        }
      }
      const Row& r = rows.back();
      if (row_failed(r, config.tolerance)) failed = true;
      if (r.error.empty())
        std::fprintf(stderr, "[bench]   MSA %.4f ms, dense %.4f ms, cuDNN %.4f ms; errors %.1e / %.1e, "
                             "bad rows %lld\n",
                     r.msa.ms, r.dense.ms, r.cudnn.ms, r.err_msa_dense, r.err_dense_cudnn,
                     static_cast<long long>(r.malformed));
    };
    for (int64_t n : config.contexts) {
      Row fallback;
      fallback.phase = "prefill";
      fallback.context = n;
      fallback.queries = n;
      guarded(fallback, [&] { return measure_prefill(session, n); });
    }
    for (int64_t n : config.decode_contexts)
      for (int64_t batch : config.batches)
        for (int64_t q : config.decode_queries) {
          Row fallback;
          fallback.phase = "decode";
          fallback.context = n;
          fallback.batch = batch;
          fallback.queries = q;
          guarded(fallback, [&] { return measure_decode(session, n, batch, q); });
        }
    if (!config.contexts.empty()) print_prefill(rows, machine);
    if (!config.decode_contexts.empty()) print_decode(rows, machine);
    std::printf("\ncorrectness gates: relative L2 error < %.0e for MSA vs our dense (N <= topk * "
                "block) and our dense vs cuDNN; selection rows well formed: %s\n",
                config.tolerance, failed ? "FAILED" : "passed");
    for (const Row& r : rows)
      if (!r.cudnn_note.empty())
        std::printf("note (%s N=%lld): cuDNN: %s\n", r.phase.c_str(),
                    static_cast<long long>(r.context), r.cudnn_note.c_str());
    if (!config.json_path.empty()) write_json(config.json_path, rows, machine, config);
    if (!device_lost) cudaStreamDestroy(stream);
    if (failed) {
      std::fprintf(stderr, "msa bench: error: a correctness gate failed or a row errored (see "
                           "the tables)\n");
      return 1;
    }
    return 0;
  } catch (const UsageError& e) {
    std::fprintf(stderr, "msa bench: %s\n%s", e.what(), kUsage);
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "msa bench: error: %s\n", e.what());
    return 2;
  }
}

}  // namespace msa::cli
