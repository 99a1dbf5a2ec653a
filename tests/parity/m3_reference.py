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


# ---- the vision tower (docs/vision.md "Vision tower") ----

IMAGE, VIDEO, START, END = 500, 501, 502, 503  # placeholder and bracket ids inside the tiny vocabulary


def tiny_vl_config(**vision_overrides):
    """The tiny text model with a vision tower of M3's structure at tiny widths, as msa's
    `make-model --config tiny-vl` has it: head dim 20 (18 rotated channels + 2 passed), a
    projector width (48) unlike either tower's, placeholder ids inside the vocabulary."""
    config = tiny_config()
    vision = dict(hidden_size=40, intermediate_size=80, num_hidden_layers=2, num_attention_heads=2)
    vision.update(vision_overrides)
    return MiniMaxM3VLConfig(text_config=config.text_config.to_dict(), vision_config=vision,
                             projector_hidden_size=48, image_token_index=IMAGE, video_token_index=VIDEO,
                             vision_start_token_id=START, vision_end_token_id=END)


def build_vl_model(config, seed=0):
    """build_model's scales, and non-zero random biases (the default init zeroes some)."""
    model = build_model(config, seed=seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1 and "norm" not in name and "layrnorm" not in name:
                param.normal_(0.0, 0.1)
    return model.eval()


def random_pixels(grids, seed):
    """Normal pixel values [sum t*h*w, 1176] (preprocessing parity is tested elsewhere)."""
    generator = torch.Generator().manual_seed(seed)
    rows = sum(t * h * w for t, h, w in grids)
    return torch.randn(rows, 3 * 2 * 14 * 14, generator=generator)


def image_tokens(rows):
    return [START] + [IMAGE] * rows + [END]


def video_tokens(grid_t, rows_per_frame):
    """transformers' processor layout: per temporal patch, start + placeholders + end."""
    tokens = []
    for _ in range(grid_t):
        tokens += [START] + [VIDEO] * rows_per_frame + [END]
    return tokens


def hf_chunked_video_grid(t, h, w, max_frames=4):
    """The grid rows transformers' video processor emits for one video (vision_segment_max_frames)."""
    return [[min(max_frames, t - start), h, w] for start in range(0, t, max_frames)]


def segment_reference_vit(model, pixel_values, grids, max_frames=4):
    """The ViT written here in f64 from docs/vision.md, with msa's segmenting (a video of more
    than max_frames temporal patches cut into chunks, RoPE time restarting per chunk); reads the
    transformers model's weights only."""
    tower = model.model.vision_tower
    config = tower.config
    heads, hidden = config.num_attention_heads, config.hidden_size
    head_dim = hidden // heads
    freqs = head_dim // 3 // 2
    m = config.spatial_merge_size
    inv = config.rope_parameters["rope_theta"] ** (-2.0 * torch.arange(freqs, dtype=torch.float64) / (2 * freqs))
    weight = tower.embeddings.proj.weight.double().reshape(hidden, -1)
    pixels = pixel_values.double()

    def linear(module, x):
        return x @ module.weight.double().T + module.bias.double()

    def layer_norm(module, x):
        return torch.nn.functional.layer_norm(x, (hidden,), module.weight.double(), module.bias.double(),
                                              config.layer_norm_eps)

    def rope(x, angles):  # x [n, heads, D]; angles [n, 3F]
        half = 3 * freqs
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
        a, b, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin, rest], dim=-1)

    outputs, row = [], 0
    for t, h, w in grids:
        for start in range(0, t, max_frames):
            chunk = min(max_frames, t - start)
            n = chunk * h * w
            index = torch.arange(n)
            within = index % (h * w)
            window = within // (m * m)
            pos_h = window // (w // m) * m + within % (m * m) // m
            pos_w = window % (w // m) * m + within % m
            pos_t = index // (h * w)
            angles = torch.cat([p.double()[:, None] * inv for p in (pos_t, pos_h, pos_w)], dim=-1)
            x = layer_norm(tower.pre_layrnorm, pixels[row:row + n] @ weight.T)
            for layer in tower.layers:
                xn = layer_norm(layer.layer_norm1, x)
                attn = layer.self_attn
                q = rope(linear(attn.q_proj, xn).view(n, heads, head_dim), angles)
                k = rope(linear(attn.k_proj, xn).view(n, heads, head_dim), angles)
                v = linear(attn.v_proj, xn).view(n, heads, head_dim)
                scores = torch.einsum("qhd,khd->hqk", q, k) / head_dim ** 0.5
                o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, hidden)
                x = x + linear(attn.out_proj, o)
                mlp = layer.mlp
                x = x + linear(mlp.fc2, torch.nn.functional.gelu(linear(mlp.fc1, layer_norm(layer.layer_norm2, x))))
            outputs.append(x)
            row += n
    return torch.cat(outputs)


def msa_vision_encode(model_dir, pixel_path, out_path):
    run_msa("vision-encode", "--model", model_dir, "--pixels", pixel_path, "--out", out_path)
    return load_file(out_path)


def msa_logits_with_pixels(model_dir, tokens, pixel_path, out_path, chunk=None):
    args = ["logits", "--model", model_dir, "--tokens", ",".join(map(str, tokens)), "--pixels", pixel_path,
            "--out", out_path]
    if chunk:
        args += ["--chunk", chunk]
    run_msa(*args)
    return load_file(out_path)["logits"]
