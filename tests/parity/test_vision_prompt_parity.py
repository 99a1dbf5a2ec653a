"""The prompt ids of `msa run --image/--video --prompt` against transformers'
MiniMaxM3VLProcessor on the same files and text: the made tiny-vl model's chat template
rendered by transformers (jinja2) with image / video content items, then the processor's
expansion of the markers (start of image + N placeholders + end of image; a video's per
temporal patch timestamp text) and tokenization. Also the raw layout (no template: markers
before the text, BOS from the tokenizer) and markers written in the text. Run by ctest
(run_parity.sh) with MSA_CLI set."""

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer
from transformers.models.minimax_m3_vl.image_processing_minimax_m3_vl import MiniMaxM3VLImageProcessor
from transformers.models.minimax_m3_vl.processing_minimax_m3_vl import MiniMaxM3VLProcessor
from transformers.models.minimax_m3_vl.video_processing_minimax_m3_vl import MiniMaxM3VLVideoProcessor

from m3_reference import run_msa


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    directory = tmp_path_factory.mktemp("vl_prompt") / "tiny-vl"
    run_msa("make-model", "--config", "tiny-vl", "--seed", 4, "--out", directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    processor = MiniMaxM3VLProcessor(
        image_processor=MiniMaxM3VLImageProcessor.from_pretrained(directory),
        tokenizer=tokenizer,
        video_processor=MiniMaxM3VLVideoProcessor.from_pretrained(directory))
    return {"dir": directory, "tokenizer": tokenizer, "processor": processor,
            "files": tmp_path_factory.mktemp("vl_prompt_files")}


def picture(path, height, width, seed):
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)).save(path)
    return path


def msa_prompt(model_dir, *args):
    """The prompt ids `msa run --print-prompt` reports."""
    result = run_msa("run", "--model", model_dir, "--max-tokens", 1, "--print-prompt", *args)
    line = next(line for line in result.stderr.splitlines() if line.startswith("prompt:"))
    return [int(x) for x in line[len("prompt:"):].split()]


def chat_text(made, items, text):
    messages = [{"role": "user", "content": [*items, {"type": "text", "text": text}]}]
    return made["tokenizer"].apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def expected_ids(made, text, add_special_tokens, images=None, videos=None, video_metadata=None, fps=None):
    kwargs = {}
    if videos is not None:
        kwargs.update(videos=videos, video_metadata=video_metadata, do_sample_frames=True, fps=fps)
    inputs = made["processor"](text=[text], images=images, add_special_tokens=add_special_tokens,
                               return_tensors="pt", **kwargs)
    return inputs["input_ids"][0].tolist(), inputs


def test_one_and_two_images_through_the_chat_template(made):
    files = made["files"]
    a = picture(files / "a.png", 70, 100, 1)
    b = picture(files / "b.png", 130, 60, 2)
    for paths in ([a], [a, b]):
        text = chat_text(made, [{"type": "image"}] * len(paths), "what is in the picture?")
        expected, inputs = expected_ids(made, text, False, images=[Image.open(p).convert("RGB") for p in paths])
        args = [x for p in paths for x in ("--image", p)]
        actual = msa_prompt(made["dir"], *args, "--prompt", "what is in the picture?")
        assert actual == expected
        # The placeholders are what the grids need.
        grids = inputs["image_grid_thw"]
        assert actual.count(made["processor"].image_token_id) == int((grids.prod(dim=1) // 4).sum())


def test_video_with_timestamps(made):
    # 8 frames at 2 fps sampled at 1 fps: frames 0, 2, 4, 6, two temporal patches at 0.0 s and
    # 2.0 s. Frames are multiples of 28 within the pixel bounds, so a resize leaves them alone.
    files = made["files"]
    frames = files / "frames"
    frames.mkdir()
    arrays = []
    for i in range(8):
        picture(frames / f"frame{i}.png", 56, 84, 10 + i)
        arrays.append(np.asarray(Image.open(frames / f"frame{i}.png").convert("RGB")))
    video = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2)
    text = chat_text(made, [{"type": "video"}], "what happens?")
    expected, inputs = expected_ids(made, text, False, videos=[video],
                                    video_metadata=[{"total_num_frames": 8, "fps": 2.0}], fps=1.0)
    actual = msa_prompt(made["dir"], "--video", frames, "--folder-fps", 2, "--fps", 1, "--prompt", "what happens?")
    assert actual == expected
    decoded = made["tokenizer"].decode(actual)
    assert "]<]0.0 seconds[>[" in decoded and "]<]2.0 seconds[>[" in decoded, decoded
    # An image and a video together: content items images first, then videos.
    a = files / "a.png"
    if not a.exists():
        picture(a, 70, 100, 1)
    text = chat_text(made, [{"type": "image"}, {"type": "video"}], "and now?")
    expected, _ = expected_ids(made, text, False, images=[Image.open(a).convert("RGB")], videos=[video],
                               video_metadata=[{"total_num_frames": 8, "fps": 2.0}], fps=1.0)
    actual = msa_prompt(made["dir"], "--image", a, "--video", frames, "--folder-fps", 2, "--fps", 1,
                        "--prompt", "and now?")
    assert actual == expected


def test_raw_layout_and_markers_in_the_text(made):
    files = made["files"]
    a = picture(files / "raw.png", 90, 90, 3)
    image = [Image.open(a).convert("RGB")]
    # No template: the marker before the text, the tokenizer's own special tokens (BOS).
    expected, _ = expected_ids(made, "]<]image[>[describe", True, images=image)
    assert msa_prompt(made["dir"], "--image", a, "--raw-prompt", "--prompt", "describe") == expected
    # A marker the user wrote stays in place (through the template as the message's text).
    messages = [{"role": "user", "content": "left ]<]image[>[ right"}]
    text = made["tokenizer"].apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected, _ = expected_ids(made, text, False, images=image)
    assert msa_prompt(made["dir"], "--image", a, "--prompt", "left ]<]image[>[ right") == expected
