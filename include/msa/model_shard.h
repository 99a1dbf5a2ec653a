// Which part of MiniMax-M3 a rank of a tensor- / expert-parallel run owns (docs/parallel.md).
//
// Attention is split by KV group: rank r owns whole GQA groups (its KV heads, their query
// heads and their index heads; index head g selects the blocks of KV group g). With more ranks
// than KV heads (M3: 4 KV heads on 8 ranks), world / kv_heads ranks share a group: each holds
// that group's KV head and index head (the K/V and the selection are computed on each of
// them, identically) and a contiguous 1 / replicas of its query heads. The single index-key
// head is shared by all groups, so every rank computes and caches it.
//
// The dense MLP and the shared expert are split by intermediate columns: gate/up rows
// [begin, end) of [I, H], down columns [begin, end) of [H, I]; their outputs are partial sums
// that an all-reduce completes (as is o_proj's, over the owned heads). The routed experts are
// split contiguously by rank (experts / world each). The embedding, the router, the norms and
// lm_head are replicated (every rank computes the logits; no vocabulary split).
#pragma once
#include <cstdint>

#include "msa/model_config.h"

namespace msa {

struct ShardPlan {
  int rank = 0;
  int world = 1;
  // Attention: KV heads [kv_begin, kv_begin + kv_heads) (= index heads), query heads
  // [q_begin, q_begin + q_heads); kv_replicas ranks hold each of this rank's KV heads.
  int64_t kv_begin = 0, kv_heads = 0;
  int64_t q_begin = 0, q_heads = 0;
  int64_t kv_replicas = 1;
  // Intermediate columns of the dense MLP and of the shared expert.
  int64_t dense_begin = 0, dense_columns = 0;
  int64_t shared_begin = 0, shared_columns = 0;
  // Routed experts [expert_begin, expert_begin + experts).
  int64_t expert_begin = 0, experts = 0;

  // The rank that owns routed expert e.
  int expert_owner(int64_t e) const { return static_cast<int>(e / experts); }
  bool covers_everything() const { return world == 1; }
};

// The plan of `rank` among `world` ranks. Throws msa::Error naming the config field when world
// does not fit the model: world must divide num_key_value_heads, or be a multiple of it whose
// replicas divide each group's query heads; and divide num_local_experts,
// dense_intermediate_size and shared_intermediate_size.
ShardPlan make_shard_plan(const ModelConfig& config, int rank, int world);

// The shapes one rank computes with: its query / KV / index heads and MLP columns
// (num_heads = q_heads, num_kv_heads = index_heads = kv_heads, the intermediate sizes divided
// by world). num_experts stays the full count (the router is replicated). A KvCache built from
// it holds this rank's KV heads only.
ModelConfig rank_config(const ModelConfig& config, const ShardPlan& plan);

}  // namespace msa
