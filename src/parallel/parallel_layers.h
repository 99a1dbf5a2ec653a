// The parts of a tensor- / expert-parallel decoder layer that need the communicator.
#pragma once
#include <cstdint>

#include "msa/communicator.h"
#include "msa/model_shard.h"
#include "msa/model_weights.h"

namespace msa::parallel {

// The MoE layer of one rank: xn f32 [T, H] (the same on every rank) -> out f32 [T, H], the
// whole layer's output (routed experts weighted + the shared expert) on every rank. `w` is
// this rank's part (its experts, its shared-expert columns; the router whole), `config` the
// whole model's. Collective: dispatch / combine by all_to_all_v, then one all_reduce_sum.
void moe_expert_parallel(const float* xn, int64_t tokens, const LayerWeights& w,
                         const ModelConfig& config, const ShardPlan& plan, Communicator& comm,
                         float* out);

}  // namespace msa::parallel
