"""Image decoding and the resize both the cache and live encoding use.

Everything here runs in DataLoader workers: it takes bytes and returns uint8 tensors, so only compact arrays cross the
process boundary and the [-1, 1] scaling happens once, on the device, in `WorldEncoder`.
"""

from __future__ import annotations

import functools
import io
import math
import os
import warnings
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image, ImageOps

from theworld.core import paths
from theworld.core.errors import one_line
from theworld.model.arch import BUCKET_STEP

if TYPE_CHECKING:
    import torch

# PIL's own decompression-bomb threshold; above it we refuse instead of allocating gigabytes.
MAX_PIXELS = 89_478_485
_SIXTEEN_BIT = {"I;16", "I;16B", "I;16L", "I;16N"}
_HIGH_DEPTH = _SIXTEEN_BIT | {"I", "F"}  # converted by _to_8bit, one rule per kind (docs/cache-format.md)


class BadImage(ValueError):
    """An input image that cannot be used; the message is the reason recorded in errors.jsonl."""


class _ImageBytes(io.BytesIO):
    """The bytes PIL opens. PIL names the file object in its errors ("cannot identify image file %r"); a plain
    BytesIO would put its memory address there, and the same bad file would give a different reason each run."""

    def __repr__(self) -> str:
        return "<image bytes>"


def _to_8bit(img: Image.Image) -> Image.Image:
    """A one-channel high-depth image -> mode L, the same rule for every image of a mode (never guessed from the
    values): 16-bit unsigned v -> round(v * 255 / 65535); 32-bit integer ("I") holds 16-bit values, scaled the same,
    and anything outside 0..65535 is refused; 32-bit float ("F") v -> round(clip(v, 0, 1) * 255), non-finite refused.
    Rounding is half up. PIL's own convert("RGB") would clip these at 255 instead."""
    arr = np.asarray(img)
    if img.mode == "F":
        arr = arr.astype(np.float64)
        if not np.isfinite(arr).all():
            raise BadImage("float image has non-finite pixels")
        scaled = np.clip(arr, 0.0, 1.0) * 255.0
    else:
        arr = arr.astype(np.int64)
        if arr.size and (arr.min() < 0 or arr.max() > 65535):  # only mode I can hold these
            raise BadImage(
                f"32-bit integer image with values outside 0..65535 ({arr.min()}..{arr.max()}): "
                "no defined scale to 8 bits"
            )
        scaled = arr * 255 / 65535.0
    return Image.fromarray(np.floor(scaled + 0.5).astype(np.uint8), "L")


def _to_rgb(img: Image.Image) -> Image.Image:
    if img.mode in _HIGH_DEPTH:
        img = _to_8bit(img)
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        img = Image.alpha_composite(background, rgba)
    return img.convert("RGB")


def _open(data: bytes, max_pixels: int) -> Image.Image:
    """The image's header, read (no pixels decoded): PIL's lazily opened image, its size checked."""
    if not data:
        raise BadImage("empty file")
    img = Image.open(_ImageBytes(data))
    w, h = img.size
    if w * h > max_pixels:
        raise BadImage(f"oversized image {w}x{h} (> {max_pixels} pixels)")
    if w == 0 or h == 0:
        raise BadImage("image has zero size")
    return img


def _bad_image(e: Exception) -> BadImage:
    if isinstance(e, BadImage):
        return e
    if isinstance(e, (Image.DecompressionBombError, Image.DecompressionBombWarning)):
        return BadImage(f"oversized image: {one_line(e)}")
    return BadImage(f"unreadable image: {type(e).__name__}: {one_line(e)}")  # PIL raises many types for broken files


def check_header(data: bytes, max_pixels: int = MAX_PIXELS) -> None:
    """Raise BadImage, as `decode` would, when the bytes are not an image format PIL reads or its header gives an
    empty or oversized picture; the pixels are not decoded (a file cut short past its header passes)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            _open(data, max_pixels)
    except Exception as e:  # noqa: BLE001 - see _bad_image
        raise _bad_image(e) from None


def decode(data: bytes, draft_size: int | None = None, max_pixels: int = MAX_PIXELS) -> Image.Image:
    """Bytes -> RGB image, upright (EXIF orientation applied). Raises BadImage with a reason.

    `draft_size` lets the JPEG decoder downscale by 2/4/8 while decoding (never below draft_size on either side),
    which makes a 4000 px photo several times cheaper to turn into a 512 px input.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = _open(data, max_pixels)
            if draft_size and img.format == "JPEG":
                img.draft("RGB", (draft_size, draft_size))
            img.load()
            img = ImageOps.exif_transpose(img)
            return _to_rgb(img)
    except Exception as e:  # noqa: BLE001 - see _bad_image
        raise _bad_image(e) from None


# Buckets are at most 2:1 (a wider picture loses its sides to the crop, as a square crop would); their sides are
# multiples of BUCKET_STEP (theworld/model/arch.py).
BUCKET_MAX_ASPECT = 2.0


@functools.cache
def buckets(resolution: int) -> tuple[tuple[int, int], ...]:
    """The aspect-ratio buckets (width, height) for `resolution`, sorted by aspect ratio (tallest first).

    Rule: landscape widths w = R, R + s, R + 2s, ... (s = BUCKET_STEP), each with the height h = s * round(R^2 / (w s))
    that brings w * h nearest R^2, while w / h <= BUCKET_MAX_ASPECT; the portrait buckets are their transposes. So
    |w h - R^2| <= w s / 2, and R x R is always a bucket.
    """
    if resolution <= 0 or resolution % BUCKET_STEP:
        raise ValueError(f"bucket resolution must be a positive multiple of {BUCKET_STEP}, got {resolution}")
    s, area, out = BUCKET_STEP, resolution * resolution, set()
    w = resolution
    while True:
        h = s * max(1, round(area / (w * s)))
        if w / h > BUCKET_MAX_ASPECT:
            break
        out.update({(w, h), (h, w)})
        w += s
    return tuple(sorted(out, key=lambda b: b[0] / b[1]))


def bucket_for(width: int, height: int, resolution: int) -> tuple[int, int]:
    """The bucket (width, height) whose log aspect ratio is nearest the image's; a tie goes to the taller bucket."""
    target = math.log(width / height)
    return min(buckets(resolution), key=lambda b: abs(math.log(b[0] / b[1]) - target))


def resize(
    img: Image.Image, resolution: int, mode: str = "crop", bucket: tuple[int, int] | None = None
) -> tuple[Image.Image, tuple[float, float, float, float]]:
    """Resize to the VAE input size; returns the image and the crop box (left, top, right, bottom) in the source.

    crop: short side to `resolution`, then a centred square; squash: the whole picture, aspect ratio ignored;
    bucket: scaled to cover `bucket` (default: the image's own, `bucket_for`), then the centred bucket-sized window.
    """
    w, h = img.size
    if mode == "bucket":
        size = bucket or bucket_for(w, h, resolution)
        scale = min(w / size[0], h / size[1])  # source pixels per output pixel, so the bucket is covered
        bw, bh = size[0] * scale, size[1] * scale
        box = ((w - bw) / 2, (h - bh) / 2, (w + bw) / 2, (h + bh) / 2)
    elif mode == "squash":
        size, box = (resolution, resolution), (0, 0, w, h)
    else:
        side = min(w, h)
        left, top = (w - side) // 2, (h - side) // 2
        size, box = (resolution, resolution), (left, top, left + side, top + side)
    return img.resize(size, Image.BICUBIC, box=box, reducing_gap=3.0), box


def output_size(original_size: tuple[int, int], resolution: int, mode: str) -> tuple[int, int]:
    """(width, height) of the VAE input made from an upright image of `original_size`."""
    return bucket_for(*original_size, resolution) if mode == "bucket" else (resolution, resolution)


def upscaled(meta: dict, resolution: int, mode: str) -> bool:
    """Whether a sample's VAE input was enlarged from its source: the crop box is smaller than the output on a side."""
    left, top, right, bottom = meta["crop_box"]
    out_w, out_h = output_size(tuple(meta["original_size"]), resolution, mode)
    return right - left < out_w or bottom - top < out_h


def to_uint8_tensor(img: Image.Image) -> torch.Tensor:
    """RGB image -> (3, H, W) uint8."""
    import torch  # here alone: the configs read this module's limits before torch loads

    return torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1).contiguous()


def upright_size(data: bytes) -> tuple[int, int]:
    """(width, height) of encoded image bytes as shown, EXIF rotation applied, from the header alone."""
    src = Image.open(_ImageBytes(data))  # lazy: reads the header only
    w, h = src.size
    if src.getexif().get(0x0112, 1) in (5, 6, 7, 8):  # EXIF orientations that swap width and height
        w, h = h, w
    return w, h


def prepare(
    img: Image.Image, resolution: int, mode: str = "crop", original_size: tuple[int, int] | None = None
) -> tuple[torch.Tensor, dict]:
    """An upright RGB image -> ((3, H, W) uint8 VAE input, metadata with original size and crop box).

    (H, W) is R x R, or with mode "bucket" the bucket of `original_size` (default: the image's size; a draft-decoded
    JPEG can be a pixel off its source's aspect ratio). The crop box is reported in `original_size` pixels.
    """
    orig_w, orig_h = original_size or img.size
    small, box = resize(img, resolution, mode, bucket_for(orig_w, orig_h, resolution) if mode == "bucket" else None)
    sx, sy = orig_w / img.size[0], orig_h / img.size[1]
    box = (round(box[0] * sx), round(box[1] * sy), round(box[2] * sx), round(box[3] * sy))
    return to_uint8_tensor(small), {"original_size": [orig_w, orig_h], "crop_box": list(box)}


def load_for_vae(data: bytes, resolution: int, mode: str = "crop") -> tuple[torch.Tensor, dict]:
    """Bytes -> ((3, H, W) uint8 tensor, metadata with original size and crop box). Raises BadImage."""
    try:
        orig = upright_size(data)
    except Exception:  # noqa: BLE001 - decode() below names what is wrong with the file
        orig = None
    if orig is not None and 0 in orig:
        orig = None  # decode() refuses it
    # JPEG draft decoding keeps both sides >= the largest output side, enough to cover any bucket
    draft = max(bucket_for(*orig, resolution)) if mode == "bucket" and orig else resolution
    img = decode(data, draft_size=draft)
    # Draft mode may have shrunk a JPEG by 2^k; report the crop box in the true source's pixels.
    return prepare(img, resolution, mode, orig)


def siglip_pixels(image_processor, img: Image.Image) -> torch.Tensor:
    """What Gemma's vision tower sees: the whole upright picture through Gemma's own image processor, (3, S, S)."""
    return image_processor(images=[img], return_tensors="pt")["pixel_values"][0]


def path_problem(path: str | os.PathLike) -> str | None:
    """Why `path` cannot be read as an image file, said as what it is ("no such file", "a FIFO, not an image file",
    "a symlink loop, not an image file"...), or None for a regular file. Never opens it."""
    what = paths.path_kind(path)
    if what is None:
        return "no such file"
    return None if what == paths.REGULAR else f"{what}, not an image file"


def to_bytes(image) -> bytes:
    """A path, bytes or a PIL image -> encoded bytes (a PIL image as PNG, lossless: decoding gives its pixels back).
    A path that is not a regular file is BadImage saying what it is."""
    if isinstance(image, (bytes, bytearray)):
        return bytes(image)
    if isinstance(image, Image.Image):
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        return buf.getvalue()
    if problem := path_problem(image):
        raise BadImage(f"{image}: {problem}")
    with open(image, "rb") as f:
        return f.read()


def input_size(image, resolution: int, mode: str) -> tuple[int, int]:
    """(width, height) of the VAE input made from `image` (a path, bytes or PIL image), as precompute makes it: R x R,
    or with mode "bucket" its aspect-ratio bucket, from the header alone. Raises BadImage."""
    if mode != "bucket":
        return resolution, resolution
    try:
        return output_size(upright_size(to_bytes(image)), resolution, mode)
    except (OSError, SyntaxError, ValueError) as e:  # PIL's errors for a header it cannot read
        raise _bad_image(e) from None


def same_shape_groups(keys: list) -> list[list[int]]:
    """Indices of `keys` grouped by equal key (an input shape, or a tuple of them), groups in order of first
    appearance: a batch of images from a bucketed model runs as one forward per shape."""
    groups: dict = {}
    for i, k in enumerate(keys):
        groups.setdefault(k, []).append(i)
    return list(groups.values())


def for_model(data: bytes, resolution: int, mode: str, image_processor) -> tuple[torch.Tensor, torch.Tensor]:
    """(VAE pixels, SigLIP pixel values) of one encoded image, computed as the cache computes them. Raises BadImage."""
    pixels, _ = load_for_vae(data, resolution, mode)
    return pixels, siglip_pixels(image_processor, decode(data))
