#!/usr/bin/env python3
"""Draws the test picture of docs/attention-maps.md's image example (a house, a tree and the
sun over two hills, 448 x 336) with Pillow, so the example can be made again:

    python scripts/draw_example_picture.py /tmp/landscape.png
    msa make-model --config tiny-vl --out /tmp/tiny-vl
    msa attn-map --model /tmp/tiny-vl --image /tmp/landscape.png \\
                 --prompt "Where is the red house?" --out /tmp/maps

Needs Pillow and numpy (both in build/parity-venv).
"""

import sys

import numpy as np
from PIL import Image, ImageDraw, ImageFilter


def draw(path, width=448, height=336):
    rows = np.linspace(0, 1, height)[:, None, None]
    sky = np.array([70, 130, 210]) * (1 - rows) + np.array([200, 225, 245]) * rows
    image = Image.fromarray(np.broadcast_to(sky, (height, width, 3)).astype(np.uint8))
    d = ImageDraw.Draw(image)
    d.ellipse([340, 40, 400, 100], fill=(255, 220, 90))  # the sun
    xs = np.arange(width)
    far = [(int(x), int(210 + 18 * np.sin(x / 45) + 10 * np.sin(x / 17))) for x in xs]
    d.polygon(far + [(width, height), (0, height)], fill=(95, 140, 80))
    near = [(int(x), int(250 + 14 * np.sin(x / 60 + 1.3))) for x in xs]
    d.polygon(near + [(width, height), (0, height)], fill=(70, 120, 55))
    d.rectangle([110, 200, 200, 265], fill=(190, 50, 45))  # the house
    d.polygon([(100, 202), (155, 155), (210, 202)], fill=(110, 60, 40))
    d.rectangle([145, 230, 165, 265], fill=(80, 50, 30))
    d.rectangle([120, 212, 138, 228], fill=(230, 230, 200))
    d.rectangle([172, 212, 190, 228], fill=(230, 230, 200))
    d.rectangle([288, 215, 298, 260], fill=(90, 60, 35))  # the tree
    d.ellipse([265, 165, 322, 225], fill=(40, 100, 40))
    image.filter(ImageFilter.GaussianBlur(0.6)).save(path)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: draw_example_picture.py OUT.png")
    draw(sys.argv[1])
