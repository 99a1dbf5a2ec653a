"""msa's media input (`msa preprocess`) against Hugging Face transformers' MiniMax-M3
processors (the reference): MiniMaxM3VLImageProcessor on image files as transformers loads
them (load_image: PIL, convert("RGB"); the processors' own loader, torchvision's RGB decode,
must give the same pixels) and MiniMaxM3VLVideoProcessor on the frames msa samples from a
folder, with default and model-directory settings. Run by ctest (tests/CMakeLists.txt) with
MSA_CLI set.

Tolerance: none. Decoding (libpng / libjpeg-turbo against PIL's), the resize (torchvision's
uint8 antialiased bicubic: integer arithmetic on int16 weights that both compute in f64 the
same way) and the normalisation (f32 (x - mean * 255) / (std * 255), as torch rounds it) are
reproduced bit for bit, so every comparison is exact. A one-level difference in a resized
sample would show as 1 / (255 * std) = 0.0142 to 0.0150 in pixel_values.
"""

import json
import os
import struct
import subprocess
import zlib

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from torchvision.transforms.v2 import functional as tvF
from transformers.image_utils import load_image, load_image_as_tensor
from transformers.models.minimax_m3_vl.image_processing_minimax_m3_vl import MiniMaxM3VLImageProcessor
from transformers.models.minimax_m3_vl.video_processing_minimax_m3_vl import MiniMaxM3VLVideoProcessor
from transformers.video_utils import VideoMetadata, default_sample_indices_fn

MSA = os.environ["MSA_CLI"]


def run_msa(*args):
    result = subprocess.run([MSA, *map(str, args)], capture_output=True, text=True)
    assert result.returncode == 0, f"msa {' '.join(map(str, args))}\n{result.stdout}{result.stderr}"
    return result


def msa_preprocess(out_dir, *args):
    out = out_dir / f"msa_{len(list(out_dir.iterdir()))}.safetensors"
    run_msa("preprocess", *args, "--out", out)
    return load_file(str(out))


def photo(height, width, seed):
    """Gradients, texture and hard edges: where a wrong filter, rounding or order shows."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    r = (x * 255 // max(width - 1, 1)).astype(np.int64)
    g = (y * 255 // max(height - 1, 1)).astype(np.int64)
    b = np.where(((x // 9) + (y // 7)) % 2 == 0, 40, 215)
    noise = rng.integers(-25, 26, size=(height, width, 3))
    image = np.stack([r, g, b], axis=-1) + noise
    return np.clip(image, 0, 255).astype(np.uint8)


def assert_same_pixels(ours, expected, what):
    assert ours.shape == expected.shape, f"{what}: shape {tuple(ours.shape)} vs {tuple(expected.shape)}"
    diff = (ours.float() - expected.float()).abs().max().item() if ours.numel() else 0.0
    assert diff == 0.0, f"{what}: max |difference| {diff}"


def check_image(tmp_path, path, processor, model_dir=None):
    args = ["--image", path, "--keep-decoded"] + (["--model", model_dir] if model_dir else [])
    ours = msa_preprocess(tmp_path, *args)
    loaded = load_image(str(path))
    decoded = np.array(loaded)
    assert np.array_equal(ours["decoded"].numpy(), decoded), f"{path}: decoded pixels differ from load_image"
    # The processor given the file's path decodes it with torchvision (RGB): the same pixels,
    # except 16-bit PNGs, which come as uint16; those go in as load_image's PIL image. (A PIL
    # image keeps a PNG's colour key in its info, which the processor then composites onto
    # white: the file path is the reference, as msa reads files.)
    as_tensor = load_image_as_tensor(str(path))
    if as_tensor.dtype == torch.uint8:
        assert np.array_equal(ours["decoded"].numpy(), as_tensor.permute(1, 2, 0).numpy()), \
            f"{path}: decoded pixels differ from load_image_as_tensor"
        expected = processor(images=[str(path)], return_tensors="pt")
    else:
        expected = processor(images=[loaded], return_tensors="pt")
    assert torch.equal(ours["grid_thw"], expected["image_grid_thw"]), (ours["grid_thw"], expected["image_grid_thw"])
    # The resized image, through torchvision as transformers calls it.
    _, height, width = (int(v) for v in expected["image_grid_thw"][0] * torch.tensor([1, 14, 14]))
    resized = tvF.resize(torch.from_numpy(decoded).permute(2, 0, 1), [height, width],
                         interpolation=tvF.InterpolationMode.BICUBIC, antialias=True)
    assert torch.equal(ours["resized"][0].permute(2, 0, 1), resized), f"{path}: resized image differs"
    assert_same_pixels(ours["pixel_values"], expected["pixel_values"], str(path))


# (name, height, width): within the bounds, below min_pixels (upscaled), above max_pixels
# (clamped), already multiples of 28 (no resize), an extreme aspect ratio, one pixel.
IMAGE_SIZES = [
    ("landscape", 480, 640),
    ("small_upscaled", 37, 53),
    ("clamped", 1200, 1800),
    ("exact", 224, 336),
    ("tall", 1500, 40),
    ("one_pixel", 1, 1),
]


@pytest.mark.parametrize("name,height,width", IMAGE_SIZES, ids=[c[0] for c in IMAGE_SIZES])
@pytest.mark.parametrize("fmt", ["png", "jpeg"])
def test_image_sizes(tmp_path, name, height, width, fmt):
    path = tmp_path / f"{name}.{fmt}"
    Image.fromarray(photo(height, width, seed=height * 7 + width)).save(path, quality=90)
    check_image(tmp_path, path, MiniMaxM3VLImageProcessor())


def png_16bit_rgb(path, samples):
    """A 16-bit RGB PNG (PIL writes none): signature, IHDR, one IDAT, IEND."""
    height, width, _ = samples.shape
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    rows = b"".join(b"\0" + samples[y].astype(">u2").tobytes() for y in range(height))
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 16, 2, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


def image_modes(tmp_path):
    """Files of every colour mode transformers' loaders meet."""
    rgb = photo(45, 61, seed=3)
    alpha = ((np.arange(45 * 61).reshape(45, 61) * 37) % 256).astype(np.uint8)
    grey = rgb[..., 1]
    files = {}
    def save(name, image, **kwargs):
        files[name] = tmp_path / name
        image.save(files[name], **kwargs)
    save("rgba.png", Image.fromarray(np.dstack([rgb, alpha]), "RGBA"))
    save("grey_alpha.png", Image.fromarray(np.dstack([grey, alpha]), "LA"))
    save("grey.png", Image.fromarray(grey, "L"))
    save("bilevel.png", Image.fromarray(grey > 128).convert("1"))
    palette = Image.fromarray(rgb).quantize(colors=37)
    save("palette.png", palette)
    save("palette_transparent.png", palette, transparency=bytes(range(0, 256, 7))[:37])
    save("rgb_colour_key.png", Image.fromarray(rgb), transparency=tuple(int(v) for v in rgb[3, 5]))
    save("grey.jpg", Image.fromarray(grey, "L"), quality=92)
    save("progressive.jpg", Image.fromarray(rgb), quality=85, progressive=True)
    save("subsampled.jpg", Image.fromarray(rgb), quality=75, subsampling=2)
    cmyk = Image.fromarray(rgb).convert("CMYK")  # PIL writes Adobe-inverted CMYK
    save("cmyk.jpg", cmyk, quality=95)
    files["rgb16.png"] = tmp_path / "rgb16.png"
    png_16bit_rgb(files["rgb16.png"], rgb.astype(np.uint16) * 257 + 100)
    return files


def test_image_modes(tmp_path):
    processor = MiniMaxM3VLImageProcessor()
    for name, path in image_modes(tmp_path).items():
        check_image(tmp_path, path, processor)


# preprocessor_config.json variants: bounds and statistics of a model directory, the legacy
# size of the released checkpoint, size as transformers writes it.
CONFIGS = {
    "bounds_and_stats": {"min_pixels": 20000, "max_pixels": 100000, "image_mean": [0.5, 0.5, 0.5],
                         "image_std": [0.5, 0.25, 0.5]},
    "legacy_size": {"size": [672, 672], "image_processor_type": "MiniMaxM3VLImageProcessor"},
    "size_dict": {"size": {"shortest_edge": 3136, "longest_edge": 200704}, "resample": 3},
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_image_processor_configs(tmp_path, name):
    model = tmp_path / "model"
    model.mkdir()
    (model / "preprocessor_config.json").write_text(json.dumps(CONFIGS[name]))
    path = tmp_path / "photo.png"
    Image.fromarray(photo(300, 700, seed=11)).save(path)
    check_image(tmp_path, path, MiniMaxM3VLImageProcessor.from_pretrained(str(model)), model_dir=model)


def write_frames(folder, count, height, width):
    folder.mkdir()
    frames = []
    for i in range(count):
        frame = photo(height, width, seed=100 + i)
        frame[: height // 4, : width // 4] = (i * 23) % 256  # each frame tells its index
        Image.fromarray(frame).save(folder / f"frame_{i + 1}.png")  # natural order: 2 before 10
        frames.append(frame)
    return frames


# (frames in the folder, its frame rate, sampling rate, height, width): sampled counts even
# and odd (padded with the last frame), frames upscaled and clamped to the video max_pixels.
VIDEO_CASES = [
    (40, 4.0, 1.0, 90, 160),
    (30, 4.0, 1.0, 64, 48),
    (9, 2.0, 2.0, 30, 30),
    (12, 3.0, 1.5, 700, 1000),
]


@pytest.mark.parametrize("count,folder_fps,fps,height,width", VIDEO_CASES)
def test_video_frames(tmp_path, count, folder_fps, fps, height, width):
    frames = write_frames(tmp_path / "frames", count, height, width)
    ours = msa_preprocess(tmp_path, "--video", tmp_path / "frames", "--folder-fps", folder_fps, "--fps", fps)
    metadata = VideoMetadata(total_num_frames=count, fps=folder_fps)
    indices = default_sample_indices_fn(metadata, fps=fps)
    assert 4 <= len(indices) <= 768, "a case outside msa's [min_frames, max_frames] clamp"
    metadata.frames_indices = indices
    assert ours["frame_indices"].tolist() == list(indices)
    video = torch.from_numpy(np.stack([frames[i] for i in indices])).permute(0, 3, 1, 2)
    processor = MiniMaxM3VLVideoProcessor()
    expected = processor(videos=[video], return_tensors="pt")
    assert_same_pixels(ours["pixel_values"], expected["pixel_values_videos"], "video")
    assert torch.equal(ours["segments_thw"], expected["video_grid_thw"]), (ours["segments_thw"], expected["video_grid_thw"])
    grid_t = int(expected["video_grid_thw"][:, 0].sum())
    assert ours["grid_thw"].tolist() == [[grid_t, *expected["video_grid_thw"][0, 1:].tolist()]]
    # The timestamps of the chat template, as MiniMaxM3VLProcessor.replace_video_token prints them.
    tps = processor.temporal_patch_size
    theirs = [metadata.frames_indices[min(t * tps, len(metadata.frames_indices) - 1)] / metadata.fps
              for t in range(grid_t)]
    assert [f"{v:.1f}" for v in ours["timestamps"].tolist()] == [f"{v:.1f}" for v in theirs]
    assert ours["timestamps"].tolist() == pytest.approx(theirs, abs=1e-12)


def test_video_processor_config(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "video_preprocessor_config.json").write_text(json.dumps(
        {"max_pixels": 50176, "min_pixels": 12544, "fps": 2.0, "image_mean": [0.4, 0.4, 0.4]}))
    frames = write_frames(tmp_path / "frames", 16, 120, 200)
    ours = msa_preprocess(tmp_path, "--video", tmp_path / "frames", "--folder-fps", 8, "--model", model)
    processor = MiniMaxM3VLVideoProcessor.from_pretrained(str(model))
    indices = default_sample_indices_fn(VideoMetadata(total_num_frames=16, fps=8.0), fps=processor.fps)
    assert ours["frame_indices"].tolist() == list(indices)
    video = torch.from_numpy(np.stack([frames[i] for i in indices])).permute(0, 3, 1, 2)
    expected = processor(videos=[video], return_tensors="pt")
    assert_same_pixels(ours["pixel_values"], expected["pixel_values_videos"], "video with config")
    assert torch.equal(ours["segments_thw"], expected["video_grid_thw"])
