// The CUDA model tests' config: `shape`'s widths in bf16 with one dense attention + dense MLP
// layer, then two MSA + MoE layers (the layout every part of the runtime meets), bos 1,
// eos 2. Validated.
#pragma once
#include "model/layer_layout.h"
#include "msa/model.h"

namespace msa::testing {

inline ModelConfig three_layer_model(ModelConfig shape) {
  shape.bos_token_id = 1;
  shape.eos_token_ids = {2};
  shape.dtype = "bfloat16";
  ModelConfig c = with_layers(shape, 3, 1);
  c.validate();
  return c;
}

}  // namespace msa::testing
