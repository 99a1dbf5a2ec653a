// `msa op` input validation: a file of tensors into one op on tiny shapes, through the same
// code as the CLI (tools/op_command.cpp: lookup, int64 narrowing, finite-value checks).
// The first four bytes choose the op and its parameters; the rest is the .safetensors file.
//   byte 0: the op (index into msa op's table)
//   byte 1: block_size = 1 + bits 0-2, topk = 1 + bits 3-5
//   byte 2: local_blocks = 1 + bit 0, init_blocks = bit 1, Impl::reference if bit 2 else
//           Impl::cpu, finite-value checks unless bits 3-4 are both 0 (a quarter of the
//           inputs reach the kernels with NaN and infinities: the library promises
//           unspecified values there, never a crash or an out-of-bounds access),
//           IndexCompute::fp8 if bit 5, temperature 2 if bit 6
//   byte 3: scale = index_scale = 0 (1/sqrt(D)) unless bit 0 (then 0.5 and -0.25)
// A returned selection must hold distinct ids of blocks in the query's causal range, then
// only -1 (check_selection).
#include <cstddef>
#include <cstdint>
#include <vector>

#include "fuzz_util.h"
#include "msa/ops.h"
#include "msa/safetensors.h"
#include "op_command.h"

namespace {

std::vector<int64_t> int_values(const msa::SafetensorsModel& file, const std::string& name) {
  const msa::Tensor tensor = file.get(name);
  std::vector<int64_t> out(static_cast<size_t>(tensor.numel()));
  for (int64_t i = 0; i < tensor.numel(); ++i) out[static_cast<size_t>(i)] = static_cast<int64_t>(tensor.get(i));
  return out;
}

// The promise of msa/ops.h for every input, finite or not: a selection row [k] of query i
// holds distinct ids of blocks 0..L (L = pos / B, its own block) and then only -1.
void check_selection(const std::string& op, const msa::SafetensorsModel& inputs,
                     const msa::Tensor& topk, int block_size) {
  const std::vector<int64_t> cu_q = int_values(inputs, "cu_seqlens_q");
  const bool paged = op == "paged_indexer";
  const std::vector<int64_t> keys = int_values(inputs, paged ? "seq_lens" : "cu_seqlens_k");
  const int64_t heads = topk.size(0), total_q = topk.size(1), k = topk.size(2);
  const int32_t* ids = topk.data<int32_t>();
  for (size_t b = 0; b + 1 < cu_q.size(); ++b) {
    const int64_t q_len = cu_q[b + 1] - cu_q[b];
    const int64_t k_len = paged ? keys[b] : keys[b + 1] - keys[b];
    for (int64_t i = 0; i < q_len; ++i) {
      const int64_t row_index = cu_q[b] + i;
      if (row_index >= total_q) msa::fuzz::invariant_failed(op + ": more queries than rows");
      const int64_t own = (k_len - q_len + i) / block_size;
      for (int64_t h = 0; h < heads; ++h) {
        const int32_t* row = ids + (h * total_q + row_index) * k;
        std::vector<bool> seen(static_cast<size_t>(own + 1), false);
        bool ended = false;
        for (int64_t s = 0; s < k; ++s) {
          if (row[s] == -1) {
            ended = true;
            continue;
          }
          if (ended || row[s] < 0 || row[s] > own || seen[static_cast<size_t>(row[s])])
            msa::fuzz::invariant_failed(op + ": selection row of query " + std::to_string(row_index) +
                                        " holds id " + std::to_string(row[s]) + " at slot " +
                                        std::to_string(s) + " (own block " + std::to_string(own) + ")");
          seen[static_cast<size_t>(row[s])] = true;
        }
      }
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  msa::set_num_threads(1);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace msa;
  if (size < 4) return 0;
  static const std::vector<std::string> ops = cli::op_command_names();
  const std::string& op = ops[data[0] % ops.size()];
  MsaParams params;
  params.block_size = 1 + (data[1] & 7);
  params.topk = 1 + ((data[1] >> 3) & 7);
  params.local_blocks = 1 + (data[2] & 1);
  params.init_blocks = (data[2] >> 1) & 1;
  const Impl impl = (data[2] >> 2) & 1 ? Impl::reference : Impl::cpu;
  const bool check_finite = ((data[2] >> 3) & 3) != 0;
  params.index_compute = (data[2] >> 5) & 1 ? IndexCompute::fp8 : IndexCompute::exact;
  params.temperature = (data[2] >> 6) & 1 ? 2.0 : 1.0;
  if (data[3] & 1) {
    params.scale = 0.5;
    params.index_scale = -0.25;
  }
  const std::filesystem::path file = fuzz::scratch_dir() / "in.safetensors";
  fuzz::write_file(file, std::string_view(reinterpret_cast<const char*>(data) + 4, size - 4));
  try {
    const SafetensorsModel inputs = SafetensorsModel::open(file.string());
    const cli::NamedTensors outputs = cli::run_op_on_inputs(op, inputs, params, impl, check_finite);
    for (const auto& [name, tensor] : outputs)
      if (name == "topk") check_selection(op, inputs, tensor, params.block_size);
  } catch (const Error&) {
  }
  return 0;
}
