"""msa against Hugging Face transformers' MiniMax-M3 (the reference), on the CPU in f32:
logits of a prompt longer than k*B (block selection exercised), the same through chunked
prefill, and greedy continuations. Run by ctest (tests/CMakeLists.txt) with MSA_CLI set."""

import random

import pytest
import torch
from transformers import MiniMaxM3SparseForConditionalGeneration, MiniMaxM3VLConfig, MiniMaxM3VLForCausalLM

from m3_reference import (
    build_model,
    layer_report,
    msa_logits,
    reference_intermediates,
    relative_error,
    run_msa,
    tiny_config,
)

PROMPT_LEN = 300  # > k*B = 64: most queries pick 4 of up to 19 blocks
LOGITS_TOLERANCE = 1e-3
GREEDY_TOKENS = 32


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    model = build_model(tiny_config())
    directory = tmp_path_factory.mktemp("m3_tiny")
    model.save_pretrained(directory)  # transformers writes the released checkpoint's names
    rng = random.Random(1234)
    tokens = [rng.randrange(3, 512) for _ in range(PROMPT_LEN)]
    logits, recorded = reference_intermediates(model, tokens)
    return {"model": model, "dir": str(directory), "tokens": tokens, "logits": logits,
            "recorded": recorded, "tmp": tmp_path_factory.mktemp("out")}


def check_logits(reference, chunk=None):
    out = reference["tmp"] / f"logits_{chunk}.safetensors"
    dump = reference["tmp"] / f"dump_{chunk}.safetensors"
    actual = msa_logits(reference["dir"], reference["tokens"], str(out), chunk=chunk,
                        dump=None if chunk else str(dump))
    expected = reference["logits"]
    assert actual.shape == expected.shape
    error = relative_error(actual, expected)
    report = "" if chunk else layer_report(str(dump), reference["recorded"])
    print(f"\nlogits (chunk={chunk}): max relative error {error:.3e}\n{report}")
    assert error < LOGITS_TOLERANCE, f"logits differ: rel err {error:.3e}\n{report}"
    # The argmax agrees wherever the reference's top two are not a near tie.
    top2 = expected.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-3
    assert torch.equal(actual.argmax(-1)[clear], expected.argmax(-1)[clear])


def test_prefill_logits_match(reference):
    check_logits(reference)


def test_chunked_prefill_logits_match(reference):
    # Chunks that straddle block boundaries: MSA over a cached prefix.
    check_logits(reference, chunk=37)


def test_greedy_continuation_matches(reference):
    prompt = reference["tokens"][:200]
    with torch.no_grad():
        generated = reference["model"].generate(
            torch.tensor([prompt]), max_new_tokens=GREEDY_TOKENS, do_sample=False,
            eos_token_id=None, pad_token_id=0)
    expected = generated[0, len(prompt):].tolist()
    result = run_msa("run", "--model", reference["dir"], "--prompt-tokens", ",".join(map(str, prompt)),
                     "--max-tokens", GREEDY_TOKENS, "--temperature", 0, "--stop", 200020,
                     "--chunk", 64)
    actual = [int(t) for t in result.stdout.split()]
    assert actual == expected, f"msa {actual}\nhf  {expected}"


def test_bf16_checkpoint_matches_reference_in_f32(reference, tmp_path):
    # A bf16 save: msa reads bf16 weights and computes in f32; the reference loads the same
    # file into f32. (Casting the live model back to f32 would not do: .to(bf16) also rounds
    # the RoPE inverse frequencies, which are not weights.)
    build_model(tiny_config()).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    model = MiniMaxM3SparseForConditionalGeneration.from_pretrained(
        tmp_path / "bf16", dtype=torch.float32, attn_implementation="eager").eval()
    tokens = reference["tokens"][:150]
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([tokens])).logits[0]
    actual = msa_logits(str(tmp_path / "bf16"), tokens, str(tmp_path / "logits.safetensors"))
    error = relative_error(actual, expected)
    print(f"\nbf16 weights: max relative error {error:.3e}")
    assert error < LOGITS_TOLERANCE


def logits_match_reference(model, directory, tokens, tmp_path):
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([tokens])).logits[0]
    actual = msa_logits(str(directory), tokens, str(tmp_path / "logits.safetensors"))
    return relative_error(actual, expected)


def test_transformers_names_and_shards_load(reference, tmp_path):
    # transformers >= 5.12 in-memory names (mlp.experts.gate_up_proj, self_attn.indexer.*,
    # fused gate_up_proj, model.language_model.*) split over several shards + index.
    model = reference["model"]
    model.save_pretrained(tmp_path / "renamed", save_original_format=False, max_shard_size="100KB")
    assert (tmp_path / "renamed" / "model.safetensors.index.json").exists()
    error = logits_match_reference(model, tmp_path / "renamed", reference["tokens"][:120], tmp_path)
    assert error < LOGITS_TOLERANCE


def test_text_only_class_loads(reference, tmp_path):
    # MiniMaxM3VLForCausalLM: a config.json without text_config, names under model.*.
    model = build_model(tiny_config().text_config, model_class=MiniMaxM3VLForCausalLM)
    model.save_pretrained(tmp_path / "text")
    error = logits_match_reference(model, tmp_path / "text", reference["tokens"][:120], tmp_path)
    assert error < LOGITS_TOLERANCE


def test_make_model_output_loads_in_transformers(tmp_path):
    # msa's own random checkpoints (config.json + released names) are real M3 checkpoints.
    run_msa("make-model", "--config", "tiny", "--out", tmp_path / "made", "--shard-mb", 1)
    # msa writes no vision_config; a small one keeps transformers from building the full ViT.
    config = MiniMaxM3VLConfig.from_pretrained(tmp_path / "made", vision_config=tiny_config().vision_config)
    model = MiniMaxM3SparseForConditionalGeneration.from_pretrained(
        tmp_path / "made", config=config, dtype=torch.float32, attn_implementation="eager").eval()
    tokens = random.Random(7).choices(range(3, 512), k=150)
    assert logits_match_reference(model, tmp_path / "made", tokens, tmp_path) < LOGITS_TOLERANCE
