// Host-side checks of the routed experts' weight formats (kernels.h: ExpertWeights), shared by
// the launchers of moe_experts_small.cu and moe_experts_grouped.cu.
#include "expert_weights.h"

#include <string>

#include "cuda/common/workspace_layout.h"
#include "msa/error.h"

namespace msa::model::gpu {

using msa::cuda::is_aligned;

int64_t expert_weights_in_multiple(ExpertWeights format) {
  switch (format) {
    case ExpertWeights::bf16: return 8;
    case ExpertWeights::mxfp8: return 32;
    case ExpertWeights::nvfp4: return 16;
  }
  return 0;  // unreachable: an ExpertWeights outside the enum
}

const char* expert_weights_name(ExpertWeights format) {
  switch (format) {
    case ExpertWeights::bf16: return "bf16";
    case ExpertWeights::mxfp8: return "mxfp8";
    case ExpertWeights::nvfp4: return "nvfp4";
  }
  return "an unknown format";
}

void check_expert_weights(const uint16_t* w, const QuantizedExpertWeights& q, int64_t in) {
  const ExpertWeights format = q.format;
  MSA_CHECK_ARG(format == ExpertWeights::bf16 || format == ExpertWeights::mxfp8 || format == ExpertWeights::nvfp4,
                "quantized.format", "bf16, mxfp8 or nvfp4", static_cast<int>(format));
  const int64_t multiple = expert_weights_in_multiple(format);
  MSA_CHECK_ARG(in > 0 && in % multiple == 0, "in",
                "a positive multiple of " + std::to_string(multiple) + " for " + expert_weights_name(format) +
                    " weights",
                in);
  if (format == ExpertWeights::bf16) {
    MSA_CHECK_ARG(w, "w", "the bf16 weights (format bf16)", "null");
    MSA_CHECK_ARG(is_aligned(w, 16), "w", "16-byte aligned", "a misaligned pointer");
    MSA_CHECK_ARG(!q.codes && !q.scales && !q.global_scale, "quantized",
                  "no codes, scales or global scale with format bf16", "a pointer set");
    return;
  }
  const std::string name = expert_weights_name(format);
  MSA_CHECK_ARG(!w, "w", "null with " + name + " weights (they are quantized.codes)", "a pointer");
  MSA_CHECK_ARG(q.codes, "quantized.codes", name + " codes", "null");
  const size_t alignment = format == ExpertWeights::mxfp8 ? 16 : 8;  // the kernels' code loads
  MSA_CHECK_ARG(is_aligned(q.codes, alignment), "quantized.codes",
                std::to_string(alignment) + "-byte aligned", "a misaligned pointer");
  MSA_CHECK_ARG(q.scales, "quantized.scales", name + " block scales", "null");
  if (format == ExpertWeights::mxfp8) {
    MSA_CHECK_ARG(!q.global_scale, "quantized.global_scale", "null with mxfp8 weights", "a pointer");
  } else {
    MSA_CHECK_ARG(q.global_scale, "quantized.global_scale", "f32 [experts, out] with nvfp4 weights",
                  "null");
    MSA_CHECK_ARG(is_aligned(q.global_scale, 4), "quantized.global_scale", "4-byte aligned",
                  "a misaligned pointer");
  }
}

}  // namespace msa::model::gpu
