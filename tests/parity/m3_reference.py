"""Tiny random MiniMax-M3 models built with transformers (the reference), and the helpers
that run the msa binary on them and compare the two layer by layer."""

import os
import subprocess

import torch
from safetensors.torch import load_file
from transformers import MiniMaxM3SparseForConditionalGeneration, MiniMaxM3VLConfig

MSA_CLI = os.environ.get("MSA_CLI", "build/tools/msa")


def tiny_config(**overrides):
    """Dense and MSA layers, dense MLP and MoE; block 16, top-4 blocks, so a prompt of a few
    hundred tokens exercises the block selection (k*B = 64)."""
    text = dict(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=64,
        dense_intermediate_size=192,
        shared_intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5},
        layer_types=["full_attention", "minimax_m3_sparse", "minimax_m3_sparse", "full_attention"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        index_n_heads=2,
        index_head_dim=32,
        index_block_size=16,
        index_topk_blocks=4,
        index_local_blocks=1,
        bos_token_id=1,
        eos_token_id=2,
    )
    text.update(overrides)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    return MiniMaxM3VLConfig(text_config=text, vision_config=vision, projector_hidden_size=64)


def build_model(config, seed=0, model_class=MiniMaxM3SparseForConditionalGeneration):
    """A transformers model whose weights are all random at a scale that gives O(1)
    activations and well-separated logits (the default init is too small for that), with
    non-zero norm weights and correction biases so that every term is exercised."""
    torch.manual_seed(seed)
    model = model_class(config)
    model.config._attn_implementation = "eager"
    if hasattr(model.config, "text_config"):
        model.config.text_config._attn_implementation = "eager"
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "layernorm" in name:
                param.normal_(0.0, 0.1)
            elif name.endswith("embed_tokens.weight"):
                param.normal_(0.0, 1.0)
            elif param.dim() >= 2:
                param.normal_(0.0, param.shape[-1] ** -0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.05)
    return model.eval()


def run_msa(*args):
    result = subprocess.run([MSA_CLI, *map(str, args)], capture_output=True, text=True)
    if result.returncode != 0:
        raise AssertionError(f"msa {' '.join(map(str, args))} failed:\n{result.stderr}")
    return result


def msa_logits(model_dir, tokens, out_path, chunk=None, dump=None):
    args = ["logits", "--model", model_dir, "--tokens", ",".join(map(str, tokens)), "--out", out_path]
    if chunk:
        args += ["--chunk", chunk]
    if dump:
        args += ["--dump", dump]
    run_msa(*args)
    return load_file(out_path)["logits"]


def reference_intermediates(model, tokens):
    """Runs the reference once, recording each layer's attention output, MLP output, layer
    output and (MSA layers) selected blocks, under msa's --dump names."""
    recorded = {}
    hooks = []
    text_model = model.model.language_model if hasattr(model.model, "language_model") else model.model
    layers = text_model.layers
    for i, layer in enumerate(layers):
        def save(name):
            def hook(_module, _inputs, output):
                recorded[name] = (output[0] if isinstance(output, tuple) else output).detach()
            return hook
        hooks.append(layer.self_attn.register_forward_hook(save(f"layers.{i}.attn")))
        hooks.append(layer.mlp.register_forward_hook(save(f"layers.{i}.mlp")))
        hooks.append(layer.register_forward_hook(save(f"layers.{i}")))
        if layer.self_attn.indexer is not None:
            hooks.append(layer.self_attn.indexer.register_forward_hook(save(f"layers.{i}.topk")))
    try:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([tokens])).logits[0]
    finally:
        for hook in hooks:
            hook.remove()
    return logits, recorded


def relative_error(actual, expected):
    """max |actual - expected| / max |expected| (0 when both are zero)."""
    scale = expected.abs().max().item()
    return (actual - expected).abs().max().item() / (scale if scale > 0 else 1.0)


def selection_mismatches(msa_topk, reference_topk):
    """Rows (group, token) whose selected block sets differ. msa: [G, T, k] int32;
    transformers: [1, G, T, k'] (k' = min(k, blocks)), both with -1 padding."""
    reference = reference_topk[0]
    mismatched = 0
    for g in range(reference.shape[0]):
        for t in range(reference.shape[1]):
            a = {int(b) for b in msa_topk[g, t] if b >= 0}
            b = {int(b) for b in reference[g, t] if b >= 0}
            mismatched += a != b
    return mismatched


def layer_report(dump_path, recorded):
    """One line per intermediate: its relative error against the reference."""
    dumped = load_file(dump_path)
    lines = []
    for name, expected in recorded.items():
        if name not in dumped:
            lines.append(f"{name}: missing from msa's dump")
            continue
        actual = dumped[name]
        if name.endswith(".topk"):
            lines.append(f"{name}: {selection_mismatches(actual, expected)} rows select other blocks")
        else:
            lines.append(f"{name}: rel err {relative_error(actual.float(), expected[0].float()):.3e}")
    return "\n".join(lines)
