"""The embedded demo dataset: deterministic scenes of coloured shapes whose captions say what is where.

Sample i is a pure function of (seed, i), so every process and every rerun draws the same picture. The captions are
word-level ("top left red circle . bottom right blue square .") and only the picture tells colour and shape, so a
model can beat an image-blind one only by reading its world (or image) tokens.
"""

from __future__ import annotations

import random

from PIL import Image, ImageDraw

COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 190, 60),
    "blue": (50, 80, 230),
    "yellow": (235, 215, 40),
    "white": (245, 245, 245),
    "purple": (150, 60, 200),
}
SHAPES = ("circle", "square", "triangle", "cross")
POSITIONS = ("top left", "top right", "bottom left", "bottom right")
PROMPT = "describe the scene ."
# Every word a caption or the prompt can use: the tiny tokenizer is trained on these.
VOCABULARY = sorted({*COLOURS, *SHAPES, *" ".join(POSITIONS).split(), *PROMPT.split(), "empty", "left", "right"})


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, box: tuple[int, int, int, int], colour: tuple) -> None:
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse(box, fill=colour)
    elif shape == "square":
        draw.rectangle(box, fill=colour)
    elif shape == "triangle":
        draw.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=colour)
    else:  # cross
        w = max(2, (x1 - x0) // 4)
        cx, cy = (x0 + x1) // 2, (y0 + y1) // 2
        draw.rectangle((cx - w, y0, cx + w, y1), fill=colour)
        draw.rectangle((x0, cy - w, x1, cy + w), fill=colour)


def scene(seed: int, index: int, size: int = 64) -> tuple[Image.Image, str]:
    """Picture and caption of synthetic sample `index`: 1 to 3 objects in distinct quadrants, in quadrant order."""
    rng = random.Random(f"{seed}:{index}")
    img = Image.new("RGB", (size, size), tuple(rng.randint(60, 110) for _ in range(3)))
    draw = ImageDraw.Draw(img)
    quadrants = sorted(rng.sample(range(4), rng.randint(1, 3)))
    words = []
    half = size // 2
    for q in quadrants:
        colour, shape = rng.choice(sorted(COLOURS)), rng.choice(SHAPES)
        ox, oy = (q % 2) * half, (q // 2) * half
        margin = rng.randint(half // 8, half // 4)
        _draw_shape(draw, shape, (ox + margin, oy + margin, ox + half - margin, oy + half - margin), COLOURS[colour])
        words.append(f"{POSITIONS[q]} {colour} {shape} .")
    return img, " ".join(words)
