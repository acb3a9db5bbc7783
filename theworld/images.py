"""Image decoding and the resize both the cache and live encoding use (design section 2).

Everything here runs in DataLoader workers: it takes bytes and returns uint8 tensors, so only compact arrays cross the
process boundary and the [-1, 1] scaling happens once, on the device, in `WorldEncoder`.
"""
from __future__ import annotations

import io
import warnings

import numpy as np
import torch
from PIL import Image, ImageOps

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
            raise BadImage(f"32-bit integer image with values outside 0..65535 ({arr.min()}..{arr.max()}): "
                           "no defined scale to 8 bits")
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


def decode(data: bytes, draft_size: int | None = None, max_pixels: int = MAX_PIXELS) -> Image.Image:
    """Bytes -> RGB image, upright (EXIF orientation applied). Raises BadImage with a reason.

    `draft_size` lets the JPEG decoder downscale by 2/4/8 while decoding (never below draft_size on either side),
    which makes a 4000 px photo several times cheaper to turn into a 512 px input.
    """
    if not data:
        raise BadImage("empty file")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(_ImageBytes(data))
            w, h = img.size
            if w * h > max_pixels:
                raise BadImage(f"oversized image {w}x{h} (> {max_pixels} pixels)")
            if w == 0 or h == 0:
                raise BadImage("image has zero size")
            if draft_size and img.format == "JPEG":
                img.draft("RGB", (draft_size, draft_size))
            img.load()
            img = ImageOps.exif_transpose(img)
            return _to_rgb(img)
    except BadImage:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise BadImage(f"oversized image: {e}") from None
    except Exception as e:  # PIL raises many types (OSError, SyntaxError, ValueError...) for broken files
        raise BadImage(f"unreadable image: {type(e).__name__}: {e}") from None


def resize(img: Image.Image, resolution: int, mode: str = "crop") -> tuple[Image.Image, tuple[int, int, int, int]]:
    """Resize to resolution x resolution; returns the image and the crop box (left, top, right, bottom) in the source.

    crop: short side to `resolution`, then a centred square; squash: the whole picture, aspect ratio ignored.
    """
    w, h = img.size
    if mode == "squash":
        box = (0, 0, w, h)
    else:
        side = min(w, h)
        left, top = (w - side) // 2, (h - side) // 2
        box = (left, top, left + side, top + side)
    out = img.resize((resolution, resolution), Image.BICUBIC, box=box, reducing_gap=3.0)
    return out, box


def to_uint8_tensor(img: Image.Image) -> torch.Tensor:
    """RGB image -> (3, H, W) uint8."""
    return torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1).contiguous()


def load_for_vae(data: bytes, resolution: int, mode: str = "crop"
                 ) -> tuple[torch.Tensor, dict]:
    """Bytes -> ((3, R, R) uint8 tensor, metadata with original size and crop box). Raises BadImage."""
    img = decode(data, draft_size=resolution)
    # Draft mode may have shrunk a JPEG by 2^k; report the crop box in the true source's pixels.
    src = Image.open(_ImageBytes(data))  # lazy: reads the header only
    orig_w, orig_h = src.size
    if src.getexif().get(0x0112, 1) in (5, 6, 7, 8):  # EXIF orientations that swap width and height
        orig_w, orig_h = orig_h, orig_w
    small, box = resize(img, resolution, mode)
    sx, sy = orig_w / img.size[0], orig_h / img.size[1]
    box = (round(box[0] * sx), round(box[1] * sy), round(box[2] * sx), round(box[3] * sy))
    return to_uint8_tensor(small), {"original_size": [orig_w, orig_h], "crop_box": list(box)}
