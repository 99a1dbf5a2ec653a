// A config.json in the released checkpoint's spelling (MiniMaxM3SparseForConditionalGeneration,
// `text_config` with `sparse_attention_config`), tiny widths: read by the config tests and
// written as a valid seed of the config fuzz target.
#pragma once

inline constexpr const char* kReleasedConfigJson = R"({
    "architectures": ["MiniMaxM3SparseForConditionalGeneration"], "model_type": "minimax_m3_vl",
    "text_config": {
      "vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
      "num_key_value_heads": 2, "head_dim": 16, "rotary_dim": 8, "rope_theta": 10000,
      "intermediate_size": 32, "dense_intermediate_size": 48, "shared_intermediate_size": 24,
      "n_shared_experts": 1, "num_local_experts": 8, "num_experts_per_tok": 2,
      "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "hidden_act": "swigluoai",
      "use_gemma_norm": true, "qk_norm_type": "per_head", "moe_layer_freq": [0, 1, 1],
      "eos_token_id": 7, "bos_token_id": 6,
      "sparse_attention_config": {"use_sparse_attention": true, "sparse_attention_freq": [0, 0, 1],
        "sparse_num_index_heads": 2, "sparse_index_dim": 16, "sparse_block_size": 32,
        "sparse_topk_blocks": 8, "sparse_local_block": 1, "sparse_init_block": 0,
        "sparse_score_type": "max"}}})";
