// msa bench --device cuda: the command (see bench_cuda/common.h for what each piece does).
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>
#include <vector>

#include "bench_cuda/common.h"

namespace msa::cli {

int run_bench_cuda(Args& args);

using namespace bench_cuda;

int run_bench_cuda(Args& args) {
  return run_reporting_errors("bench", kUsage, [&] {
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
    if (config.training) {
      const int status = run_training_bench(session);
      cudaStreamDestroy(stream);
      return status;
    }
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
      if (r.error.empty() && r.skipped.empty())
        std::fprintf(stderr, "[bench]   MSA %.4f ms, dense %.4f ms, cuDNN %.4f ms; errors %.1e / %.1e, "
                             "bad rows %lld\n",
                     r.msa.ms, r.dense.ms, r.cudnn.ms, r.err_msa_dense, r.err_dense_cudnn,
                     static_cast<long long>(r.malformed));
    };
    for (int64_t n : config.contexts)
      guarded(new_row("prefill", n, 1, n), [&] { return measure_prefill(session, n); });
    for (int64_t n : config.decode_contexts)
      for (int64_t batch : config.batches)
        for (int64_t q : config.decode_queries)
          guarded(new_row("decode", n, batch, q), [&] { return measure_decode(session, n, batch, q); });
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
  });
}

}  // namespace msa::cli
