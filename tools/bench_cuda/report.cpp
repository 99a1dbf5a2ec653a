// msa bench --device cuda: the markdown tables on stdout and the --json lines.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "bench_cuda/common.h"
#include "bench_cuda/report_text.h"

namespace msa::cli::bench_cuda {

namespace {

std::string version_text(int v) {  // 13000 -> "13.0"
  return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
}

}  // namespace

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
  for (const Row& r : rows)
    if (r.phase == "prefill" && r.index_compute != "exact") {
      std::printf("index compute: %s (--index-compute: the indexer, alone and in MSA, ranks by %s "
                  "index scores; the indexer TFLOP/s counts the same flops)\n\n",
                  r.index_compute.c_str(), r.index_compute.c_str());
      break;
    }
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
  for (const Row& r : rows)
    if (r.phase == "prefill" && r.union_factor >= 0)
      std::printf("N = %lld: selection tiles of 128 (query, head) rows: union / valid per query %.2f, %.1f%% of "
                  "the tiles query-major under automatic; sparse stage kv_major %s ms, query_major %s ms\n",
                  static_cast<long long>(r.context), r.union_factor, 100.0 * r.query_major_tiles,
                  time_cv(r.sparse_kv_major, 1, "%.3f").c_str(), time_cv(r.sparse_query_major, 1, "%.3f").c_str());
  for (const Row& r : rows)
    if (r.phase == "prefill" && r.changed_rows_vs_exact >= 0)
      std::printf("N = %lld, %s index compute: %.2f%% of the (query, head) selection rows differ from "
                  "exact compute's on the same inputs\n",
                  static_cast<long long>(r.context), r.index_compute.c_str(), 100.0 * r.changed_rows_vs_exact);
  for (const Row& r : rows)  // --kv-cache
    for (const Row::Fp8Kv& f : r.fp8_kv)
      if (r.phase == "prefill" && r.error.empty())
        std::printf("N = %lld, fp8 K/V %s (paged e4m3 caches of the same K/V, widened into a bf16 copy, then "
                    "the bf16 kernels): sparse %s ms (bf16 / fp8 %s; the copy alone %s ms), dense %s ms (%s); "
                    "sparse O vs bf16 K/V: relative L2 %s\n",
                    static_cast<long long>(r.context), f.layout.c_str(), time_cv(f.sparse, 1, "%.3f").c_str(),
                    ratio(r.sparse, f.sparse).c_str(), time_cv(f.widen, 1, "%.3f").c_str(),
                    time_cv(f.dense, 1, "%.3f").c_str(),
                    ratio(r.dense, f.dense).c_str(),
                    f.err_sparse_vs_bf16 < 0 ? "-" : num(f.err_sparse_vs_bf16, "%.4f").c_str());
}

namespace {
// The decode rows split by phase (decode_phase_us): what each phase adds to the step.
void print_decode_phases(const std::vector<Row>& rows) {
  bool any = false;
  for (const Row& r : rows) any |= r.phase == "decode" && r.error.empty() && r.scan.ok();
  if (!any) return;
  std::printf(
      "\ndecode by phase: us each phase adds to the step, its hand-off included, from CUDA-graph "
      "replays of the step's prefixes (medians): scan = the index scan alone; select = indexer - "
      "scan; attention = indexer + split-K attention without its merge - indexer; merge = MSA - "
      "that. A phase near the spread of the medians can come out at or below 0\n\n"
      "| N | batch | Q | scan us | select us | attention us | merge us | MSA us |\n"
      "|---|---|---|---|---|---|---|---|\n");
  for (const Row& r : rows) {
    if (r.phase != "decode" || !r.error.empty() || !r.scan.ok()) continue;
    const DecodePhases p = decode_phase_us(r);
    std::printf("| %lld | %lld | %lld | %s | %s | %s | %s | %s |\n", static_cast<long long>(r.context),
                static_cast<long long>(r.batch), static_cast<long long>(r.queries), num(p.scan, "%.1f").c_str(),
                num(p.select, "%.1f").c_str(), num(p.attention, "%.1f").c_str(), num(p.merge, "%.1f").c_str(),
                num(1e3 * r.msa.ms, "%.1f").c_str());
  }
}

// --index-keys: the decode rows again with fp8 / fp4 index keys (bf16 repeated for reference).
void print_decode_quantized(const std::vector<Row>& rows, const Machine& m) {
  bool any = false;
  for (const Row& r : rows) any |= r.phase == "decode" && !r.quantized.empty();
  if (!any) return;
  std::printf(
      "\ndecode with quantized index keys (--index-keys): the same inputs, the index keys of each "
      "set quantized on the device (fp8: e4m3 + one f32 scale per token; fp4: e2m1 pairs + one "
      "e4m3 scale per 16 channels). indexer GB/s (%% of the %.0f GB/s streaming read) against "
      "the index-key bytes (codes + scales of every context token); MSA = indexer + sparse, "
      "GB/s against those bytes + the distinct selected K/V blocks of the bf16 rows; changed "
      "rows = (query, head) rows whose selected set differs from the bf16 keys' rows\n\n"
      "| N | batch | Q | keys | index MB | indexer us (cv) | indexer GB/s | indexer vs bf16 | "
      "MSA us (cv) | MSA GB/s | changed rows | bad rows |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|\n",
      m.read_gbs);
  for (const Row& r : rows) {
    if (r.phase != "decode" || r.quantized.empty() || !r.error.empty()) continue;
    const auto line = [&](const char* keys, double index_bytes, const Timing& indexer,
                          const Timing& msa, double changed, int64_t malformed) {
      std::printf("| %lld | %lld | %lld | %s | %s | %s | %s | %s | %s | %s | %s | %lld |\n",
                  static_cast<long long>(r.context), static_cast<long long>(r.batch),
                  static_cast<long long>(r.queries), keys, num(index_bytes / 1e6, "%.1f").c_str(),
                  time_cv(indexer, 1e3, "%.1f").c_str(),
                  rate(index_bytes, indexer, 1e9, m.read_gbs).c_str(),
                  ratio(r.indexer, indexer).c_str(), time_cv(msa, 1e3, "%.1f").c_str(),
                  rate(index_bytes + r.kv_selected_bytes, msa, 1e9, m.read_gbs).c_str(),
                  changed < 0 ? "-" : (num(100 * changed, "%.2f") + "%").c_str(),
                  static_cast<long long>(malformed));
    };
    line("bf16", r.index_bytes, r.indexer, r.msa, -1, r.malformed);
    for (const Row::QuantizedIndexKeys& q : r.quantized)
      line(q.format.c_str(), q.index_bytes, q.indexer, q.msa, q.changed_rows, q.malformed);
  }
}

// --kv-cache: the selected-K/V phase, the MSA step and dense decode again over fp8 K/V.
void print_decode_fp8_kv(const std::vector<Row>& rows, const Machine& m) {
  bool any = false;
  for (const Row& r : rows) any |= r.phase == "decode" && !r.fp8_kv.empty();
  if (!any) return;
  std::printf(
      "\ndecode with fp8 K/V caches (--kv-cache): the same inputs and selection rows, the K/V "
      "caches of each set quantized on the device (e4m3 codes; per_token_head: one f32 scale per "
      "token and head, per_tensor: one per tensor). sparse = the selected-K/V phase (sparse "
      "attention over the bf16 rows); GB/s (%% of the %.0f GB/s streaming read) against the "
      "distinct selected blocks' codes + scales (dense: every token's); vs bf16 = bf16 time / "
      "fp8 time; O err = relative L2 of the sparse O against the bf16 caches'\n\n"
      "| N | batch | Q | K/V | sparse us (cv) | sparse GB/s | sparse vs bf16 | MSA us (cv) | "
      "MSA vs bf16 | dense us (cv) | dense GB/s | dense vs bf16 | O err |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
      m.read_gbs);
  for (const Row& r : rows) {
    if (r.phase != "decode" || r.fp8_kv.empty() || !r.error.empty()) continue;
    const auto line = [&](const char* kv, const Timing& sparse, double selected_bytes, const Timing& msa,
                          const Timing& dense, double dense_bytes, double err) {
      std::printf("| %lld | %lld | %lld | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n",
                  static_cast<long long>(r.context), static_cast<long long>(r.batch),
                  static_cast<long long>(r.queries), kv, time_cv(sparse, 1e3, "%.1f").c_str(),
                  rate(selected_bytes, sparse, 1e9, m.read_gbs).c_str(), ratio(r.sparse, sparse).c_str(),
                  time_cv(msa, 1e3, "%.1f").c_str(), ratio(r.msa, msa).c_str(),
                  time_cv(dense, 1e3, "%.1f").c_str(), rate(dense_bytes, dense, 1e9, m.read_gbs).c_str(),
                  ratio(r.dense, dense).c_str(), err < 0 ? "-" : num(err, "%.4f").c_str());
    };
    line("bf16", r.sparse, r.kv_selected_bytes, r.msa, r.dense, r.dense_bytes, -1);
    for (const Row::Fp8Kv& f : r.fp8_kv)
      line(("fp8 " + f.layout).c_str(), f.sparse, f.kv_selected_bytes, f.msa, f.dense, f.dense_bytes,
           f.err_sparse_vs_bf16);
  }
}
}  // namespace

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
    if (!r.error.empty() || !r.skipped.empty()) {
      std::printf("| %lld | %lld | %lld | %s: %s |\n", static_cast<long long>(r.context),
                  static_cast<long long>(r.batch), static_cast<long long>(r.queries),
                  r.error.empty() ? "skipped" : "error", r.error.empty() ? r.skipped.c_str() : r.error.c_str());
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
  print_decode_phases(rows);
  print_decode_quantized(rows, m);
  print_decode_fp8_kv(rows, m);
}

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
          .add("dense_flops", r.dense_flops).add("msa_path", r.msa_path)
          .add("index_compute", r.index_compute)
          .add("index_ranking", cuda::index_ranking_name(c.index_ranking))
          .add("changed_rows_vs_exact", r.changed_rows_vs_exact < 0 ? NAN : r.changed_rows_vs_exact)
          .add("index_coherence", c.index_coherence)
          .add("union_factor", r.union_factor < 0 ? NAN : r.union_factor)
          .add("query_major_tiles", r.query_major_tiles < 0 ? NAN : r.query_major_tiles)
          .add("sparse_kv_major", r.sparse_kv_major).add("sparse_query_major", r.sparse_query_major);
    } else {
      const DecodePhases phases = decode_phase_us(r);
      j.add("index_bytes", r.index_bytes).add("kv_selected_bytes", r.kv_selected_bytes)
          .add("dense_bytes", r.dense_bytes)
          .add("scan_only", r.scan).add("unmerged", r.unmerged)
          .add("phase_scan_us", phases.scan).add("phase_select_us", phases.select)
          .add("phase_attention_us", phases.attention).add("phase_merge_us", phases.merge);
      for (const Row::QuantizedIndexKeys& q : r.quantized)  // --index-keys
        j.add("indexer_" + q.format, q.indexer).add("msa_" + q.format, q.msa)
            .add("index_bytes_" + q.format, q.index_bytes)
            .add("changed_rows_" + q.format, q.changed_rows)
            .add("malformed_rows_" + q.format, q.malformed);
    }
    for (const Row::Fp8Kv& f : r.fp8_kv)  // --kv-cache: decode and prefill rows
      j.add("sparse_fp8_" + f.layout, f.sparse).add("msa_fp8_" + f.layout, f.msa)
          .add("widen_fp8_" + f.layout, f.widen)
          .add("dense_fp8_" + f.layout, f.dense)
          .add("kv_selected_bytes_fp8_" + f.layout, f.kv_selected_bytes)
          .add("dense_bytes_fp8_" + f.layout, f.dense_bytes)
          .add("err_sparse_fp8_vs_bf16_" + f.layout, f.err_sparse_vs_bf16 < 0 ? NAN : f.err_sparse_vs_bf16);
    j.add("msa_vs_cudnn", r.cudnn.ok() && r.msa.ok() ? r.cudnn.ms / r.msa.ms : NAN)
        .add("msa_vs_dense", r.dense.ok() && r.msa.ok() ? r.dense.ms / r.msa.ms : NAN)
        .add("err_msa_dense", r.err_msa_dense == -1 ? NAN : r.err_msa_dense)
        .add("err_dense_cudnn", r.err_dense_cudnn == -1 ? NAN : r.err_dense_cudnn)
        .add("checks_passed", !row_failed(r, c.tolerance) ? 1 : 0)
        .add("malformed_rows", r.malformed).add("cudnn_plan", r.cudnn_plan)
        .add("cudnn_note", r.cudnn_note).add("error", r.error).add("skipped", r.skipped);
    out << j.str() << "\n";
  }
}

}  // namespace msa::cli::bench_cuda
