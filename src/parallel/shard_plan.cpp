// The sharding plan of a tensor- / expert-parallel rank (msa/model_shard.h).
#include <string>

#include "msa/model_shard.h"

namespace msa {
namespace {

std::string world_text(int world) { return "world size " + std::to_string(world); }

// `field` (of `value`) split into `world` equal parts.
void check_divides(const char* field, int64_t value, int world) {
  if (value % world != 0)
    throw_arg_error(std::string("config.") + field,
                    "a multiple of the " + world_text(world) + " (split evenly over the ranks)",
                    value);
}

}  // namespace

ShardPlan make_shard_plan(const ModelConfig& c, int rank, int world) {
  MSA_CHECK_ARG(world >= 1, "world", "at least 1 rank", world);
  MSA_CHECK_ARG(rank >= 0 && rank < world, "rank", "a rank in [0, " + std::to_string(world) + ")", rank);
  c.validate();
  ShardPlan plan{.rank = rank, .world = world};
  const int64_t Hkv = c.num_kv_heads, group = c.num_heads / c.num_kv_heads;
  if (Hkv % world == 0) {
    // Whole groups per rank.
    plan.kv_heads = Hkv / world;
    plan.kv_begin = rank * plan.kv_heads;
    plan.q_heads = plan.kv_heads * group;
    plan.q_begin = plan.kv_begin * group;
  } else if (world % Hkv == 0) {
    // A group's K/V (and selection) replicated on `replicas` ranks, its query heads split.
    plan.kv_replicas = world / Hkv;
    if (group % plan.kv_replicas != 0)
      throw_arg_error("config.num_attention_heads",
                      "query heads per KV group (" + std::to_string(group) + ") divisible by the " +
                          std::to_string(plan.kv_replicas) + " ranks that share a group at " +
                          world_text(world),
                      c.num_heads);
    plan.kv_heads = 1;
    plan.kv_begin = rank / plan.kv_replicas;
    plan.q_heads = group / plan.kv_replicas;
    plan.q_begin = plan.kv_begin * group + (rank % plan.kv_replicas) * plan.q_heads;
  } else {
    throw_arg_error("config.num_key_value_heads",
                    "a multiple or a divisor of the " + world_text(world) +
                        " (attention is split by KV group)",
                    Hkv);
  }
  bool any_moe = false, any_dense = false;
  for (int64_t i = 0; i < c.num_layers; ++i) (c.moe_layers[i] ? any_moe : any_dense) = true;
  if (any_dense) {
    check_divides("dense_intermediate_size", c.dense_intermediate_size, world);
    plan.dense_columns = c.dense_intermediate_size / world;
    plan.dense_begin = rank * plan.dense_columns;
  }
  if (any_moe) {
    check_divides("num_local_experts", c.num_experts, world);
    plan.experts = c.num_experts / world;
    plan.expert_begin = rank * plan.experts;
    if (c.shared_intermediate_size > 0) {
      check_divides("shared_intermediate_size", c.shared_intermediate_size, world);
      plan.shared_columns = c.shared_intermediate_size / world;
      plan.shared_begin = rank * plan.shared_columns;
    }
  }
  return plan;
}

ModelConfig rank_config(const ModelConfig& c, const ShardPlan& plan) {
  ModelConfig local = c;
  local.num_heads = plan.q_heads;
  local.num_kv_heads = plan.kv_heads;
  local.index_heads = plan.kv_heads;
  if (plan.dense_columns > 0) local.dense_intermediate_size = plan.dense_columns;
  if (plan.shared_columns > 0) local.shared_intermediate_size = plan.shared_columns;
  return local;
}

}  // namespace msa
