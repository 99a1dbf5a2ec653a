// The layer layout of the M3-shaped configs built in code (model_config_preset, the model
// benchmark's --config, the CUDA model tests): the first `dense_layers` of `layers` layers
// dense attention + dense MLP, the rest MSA + MoE. Defined in config.cpp.
#pragma once
#include <cstdint>

#include "msa/model_config.h"

namespace msa {

ModelConfig with_layers(ModelConfig c, int64_t layers, int64_t dense_layers);

}  // namespace msa
