"""msa's vision tower, projector and image/video prompts against transformers' minimax_m3_vl
(f32 on the CPU): the ViT's and the projector's outputs (`msa vision-encode`), the logits of
prompts with one image, two images and a video longer than one attention segment (`msa logits
--pixels`), chunked prefill through an image, both tensor name sets, msa's own tiny-vl
checkpoint in transformers, and image / frame files through `msa preprocess` end to end.
Pixel values are random elsewhere: preprocessing parity is test_vision_parity.py's. Run by
ctest (run_parity.sh) with MSA_CLI set."""

import random

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from transformers import MiniMaxM3SparseForConditionalGeneration
from transformers.models.minimax_m3_vl.image_processing_minimax_m3_vl import MiniMaxM3VLImageProcessor

from m3_reference import (
    IMAGE,
    build_vl_model,
    hf_chunked_video_grid,
    image_tokens,
    msa_logits_with_pixels,
    msa_vision_encode,
    random_pixels,
    relative_error,
    run_msa,
    segment_reference_vit,
    tiny_vl_config,
    video_tokens,
)

TOLERANCE = 1e-3  # relative to the largest |value|: f32 against f32 in another order, ~1e-6 seen

IMAGE_GRIDS = [[1, 4, 6], [1, 2, 2]]  # two images: 24 and 4 patches, 6 and 1 placeholder rows
VIDEO_GRID = [6, 2, 4]                # 6 temporal patches: segments of 4 + 2 (12 placeholder rows)


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    model = build_vl_model(tiny_vl_config())
    directory = tmp_path_factory.mktemp("m3_tiny_vl")
    model.save_pretrained(directory)  # the released checkpoint's names
    return {"model": model, "dir": str(directory), "tmp": tmp_path_factory.mktemp("vl_out")}


def write_pixels(path, images=None, videos=None):
    tensors = {}
    if images is not None:
        tensors["pixel_values"], tensors["image_grid_thw"] = images
    if videos is not None:
        tensors["pixel_values_videos"], tensors["video_grid_thw"] = videos
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return str(path)


def text(rng, n):
    return [rng.randrange(3, 490) for _ in range(n)]


def check(name, actual, expected):
    assert actual.shape == expected.shape, f"{name}: {tuple(actual.shape)} vs {tuple(expected.shape)}"
    error = relative_error(actual.double(), expected.double())
    print(f"\n{name}: max relative error {error:.3e}")
    assert error < TOLERANCE, f"{name}: rel err {error:.3e}"


def test_vision_tower_and_projector_match(vl):
    model = vl["model"]
    pixels = random_pixels(IMAGE_GRIDS, seed=1)
    grids = torch.tensor(IMAGE_GRIDS)
    path = write_pixels(vl["tmp"] / "images.safetensors", images=(pixels, grids))
    ours = msa_vision_encode(vl["dir"], path, str(vl["tmp"] / "encoded.safetensors"))
    with torch.no_grad():
        features = model.model.vision_tower(pixel_values=pixels, grid_thw=grids).last_hidden_state.squeeze(0)
        embeds = model.model.multi_modal_projector(features)
    check("vit", ours["image_features"], features)
    check("projector", ours["image_embeds"], embeds)
    # Our f64 reference of the doc agrees with transformers on images (one segment each).
    check("f64 reference vit", segment_reference_vit(model, pixels, IMAGE_GRIDS), features)


def image_prompt(rng, grids):
    tokens = text(rng, 20)
    for t, h, w in grids:
        tokens += image_tokens(t * h * w // 4) + text(rng, 5)
    return tokens + text(rng, 7)


@pytest.mark.parametrize("grids", [IMAGE_GRIDS[:1], IMAGE_GRIDS], ids=["one_image", "two_images"])
def test_image_prompt_logits_match(vl, grids):
    model = vl["model"]
    tokens = image_prompt(random.Random(len(grids)), grids)
    pixels = random_pixels(grids, seed=2)
    path = write_pixels(vl["tmp"] / f"prompt{len(grids)}.safetensors", images=(pixels, torch.tensor(grids)))
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([tokens]), pixel_values=pixels,
                         image_grid_thw=torch.tensor(grids)).logits[0]
    for chunk in (None, 23):  # 23: the first chunk ends inside the first image
        actual = msa_logits_with_pixels(vl["dir"], tokens, path, str(vl["tmp"] / "logits.safetensors"), chunk)
        check(f"logits {len(grids)} image(s), chunk {chunk}", actual, expected)
    # The images matter: text-only logits differ after the first image.
    first = tokens.index(IMAGE)
    with torch.no_grad():
        placeholders = model(input_ids=torch.tensor([tokens])).logits[0]
    assert relative_error(placeholders[first:], expected[first:]) > 1e-2


def test_video_longer_than_a_segment(vl):
    """msa gets the video as one grid of 6 temporal patches and cuts it into segments of 4 + 2;
    transformers gets the two chunks as grids of their own (what its video processor emits).
    Both must agree, and with our f64 reference of the segmenting; one unsegmented grid
    (attention over all 6) gives other features."""
    model = vl["model"]
    t, h, w = VIDEO_GRID
    pixels = random_pixels([VIDEO_GRID], seed=3)
    chunked = torch.tensor(hf_chunked_video_grid(t, h, w))
    path = write_pixels(vl["tmp"] / "video.safetensors", videos=(pixels, torch.tensor([VIDEO_GRID])))
    ours = msa_vision_encode(vl["dir"], path, str(vl["tmp"] / "video_encoded.safetensors"))
    with torch.no_grad():
        features = model.model.vision_tower(pixel_values=pixels, grid_thw=chunked).last_hidden_state.squeeze(0)
        unsegmented = model.model.vision_tower(pixel_values=pixels,
                                               grid_thw=torch.tensor([VIDEO_GRID])).last_hidden_state.squeeze(0)
        embeds = model.model.multi_modal_projector(features)
    check("video vit vs transformers' chunks", ours["video_features"], features)
    check("video vit vs f64 reference", ours["video_features"], segment_reference_vit(model, pixels, [VIDEO_GRID]))
    check("video projector", ours["video_embeds"], embeds)
    assert relative_error(ours["video_features"], unsegmented) > 1e-2

    rng = random.Random(9)
    tokens = text(rng, 11) + video_tokens(t, h * w // 4) + text(rng, 6)
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([tokens]), pixel_values_videos=pixels,
                         video_grid_thw=chunked).logits[0]
    for chunk in (None, 16):
        actual = msa_logits_with_pixels(vl["dir"], tokens, path, str(vl["tmp"] / "vlogits.safetensors"), chunk)
        check(f"video prompt logits, chunk {chunk}", actual, expected)


def test_transformers_names_load(vl, tmp_path):
    # transformers >= 5.12 names: model.vision_tower.embeddings.proj, .layers.N,
    # model.multi_modal_projector.merge_linear_*; sharded.
    vl["model"].save_pretrained(tmp_path / "renamed", save_original_format=False, max_shard_size="200KB")
    pixels = random_pixels(IMAGE_GRIDS, seed=4)
    path = write_pixels(tmp_path / "p.safetensors", images=(pixels, torch.tensor(IMAGE_GRIDS)))
    renamed = msa_vision_encode(str(tmp_path / "renamed"), path, str(tmp_path / "a.safetensors"))
    released = msa_vision_encode(vl["dir"], path, str(tmp_path / "b.safetensors"))
    assert torch.equal(renamed["image_embeds"], released["image_embeds"])


def test_make_model_tiny_vl_loads_in_transformers(tmp_path):
    run_msa("make-model", "--config", "tiny-vl", "--out", tmp_path / "made")
    model = MiniMaxM3SparseForConditionalGeneration.from_pretrained(
        tmp_path / "made", dtype=torch.float32, attn_implementation="eager").eval()
    assert model.config.image_token_id == IMAGE
    grids = [[1, 4, 4], VIDEO_GRID]
    pixels = random_pixels(grids, seed=5)
    image_pixels, video_pixels = pixels[:16], pixels[16:]
    path = write_pixels(tmp_path / "p.safetensors", images=(image_pixels, torch.tensor([grids[0]])),
                        videos=(video_pixels, torch.tensor([VIDEO_GRID])))
    rng = random.Random(5)
    t, h, w = VIDEO_GRID
    tokens = text(rng, 9) + image_tokens(4) + text(rng, 3) + video_tokens(t, h * w // 4) + text(rng, 4)
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([tokens]), pixel_values=image_pixels,
                         image_grid_thw=torch.tensor([grids[0]]), pixel_values_videos=video_pixels,
                         video_grid_thw=torch.tensor(hf_chunked_video_grid(t, h, w))).logits[0]
    actual = msa_logits_with_pixels(str(tmp_path / "made"), tokens, path, str(tmp_path / "l.safetensors"), chunk=10)
    check("make-model tiny-vl: image + video prompt logits", actual, expected)


def test_image_and_video_files_end_to_end(vl, tmp_path):
    """A PNG and a folder of PNG frames through `msa preprocess` (the media front end) and
    `msa logits --pixels`, against transformers' processors and model on the same files. The
    preprocessing itself is bit for bit (test_vision_parity.py); here the whole chain."""
    model = vl["model"]
    rng = np.random.default_rng(11)
    Image.fromarray(rng.integers(0, 256, size=(70, 100, 3), dtype=np.uint8)).save(tmp_path / "image.png")
    frames = tmp_path / "frames"
    frames.mkdir()
    for i in range(10):
        Image.fromarray(rng.integers(0, 256, size=(56, 84, 3), dtype=np.uint8)).save(frames / f"{i:03d}.png")

    run_msa("preprocess", "--image", tmp_path / "image.png", "--out", tmp_path / "image.safetensors")
    run_msa("preprocess", "--video", frames, "--folder-fps", 1, "--fps", 1, "--out", tmp_path / "video.safetensors")
    image = load_file(str(tmp_path / "image.safetensors"))
    video = load_file(str(tmp_path / "video.safetensors"))

    # transformers' image processor on the same file gives the same pixels and grid.
    processed = MiniMaxM3VLImageProcessor()(images=[Image.open(tmp_path / "image.png").convert("RGB")],
                                             return_tensors="pt")
    assert torch.equal(processed["image_grid_thw"], image["grid_thw"])
    assert torch.equal(processed["pixel_values"], image["pixel_values"])

    t, h, w = image["grid_thw"][0].tolist()
    rng_tokens = random.Random(12)
    tokens = text(rng_tokens, 6) + image_tokens(t * h * w // 4) + text(rng_tokens, 4)
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([tokens]), pixel_values=image["pixel_values"],
                         image_grid_thw=image["grid_thw"]).logits[0]
    actual = msa_logits_with_pixels(vl["dir"], tokens, str(tmp_path / "image.safetensors"),
                                    str(tmp_path / "li.safetensors"), chunk=9)
    check("PNG -> msa preprocess -> logits", actual, expected)

    # The video file: one grid row (msa segments it); transformers gets the segments.
    vt, vh, vw = video["grid_thw"][0].tolist()
    assert vt > 4, "the frames should make more temporal patches than one segment holds"
    tokens = text(rng_tokens, 5) + video_tokens(vt, vh * vw // 4) + text(rng_tokens, 3)
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([tokens]), pixel_values_videos=video["pixel_values"],
                         video_grid_thw=video["segments_thw"]).logits[0]
    actual = msa_logits_with_pixels(vl["dir"], tokens, str(tmp_path / "video.safetensors"),
                                    str(tmp_path / "lv.safetensors"), chunk=13)
    check("frames -> msa preprocess -> logits", actual, expected)

