"""theworld/model/images.py: pixel conversion (every high-depth mode scaled by one documented rule, never guessed from
the values, or refused) and aspect-ratio buckets (the bucket set, the choice, the resize)."""

from __future__ import annotations

import io
import math
import random

import numpy as np
import pytest
import torch
from PIL import Image

from tests._precompute_helpers import gradient, jpeg_bytes
from theworld.model import images


def _file(img: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def _grey(data: bytes) -> int:
    """The decoded image's value (all three channels equal for a grey file)."""
    arr = np.asarray(images.decode(data))
    assert (arr == arr[0, 0, 0]).all()
    return int(arr[0, 0, 0])


def _sixteen(value: int, mode: str) -> Image.Image:
    dtype = {"I;16": "<u2", "I;16B": ">u2"}[mode]
    return Image.frombuffer(mode, (8, 8), np.full((8, 8), value, dtype).tobytes(), "raw", mode, 0, 1)


@pytest.mark.parametrize("fmt,mode", [("PNG", "I;16"), ("TIFF", "I;16"), ("TIFF", "I;16B")])
@pytest.mark.parametrize("value", [0, 200, 255, 256, 300, 32768, 40000, 65535])
def test_16_bit_values_scale_by_65535_whatever_the_rest_of_the_image(fmt, mode, value):
    data = _file(_sixteen(value, mode), fmt)
    assert Image.open(io.BytesIO(data)).mode == mode
    assert _grey(data) == int(np.floor(value * 255 / 65535 + 0.5))


def test_16_bit_scaling_does_not_depend_on_the_image_peak():
    # a dark image (max 300) and a bright one (max 60000) share the pixel value 300: it decodes the same in both
    dark = np.full((8, 8), 300, np.uint16)
    bright = dark.copy()
    bright[0, 0] = 60000
    a = np.asarray(images.decode(_file(Image.fromarray(dark), "PNG")))
    b = np.asarray(images.decode(_file(Image.fromarray(bright), "PNG")))
    assert a[4, 4, 0] == b[4, 4, 0] == 1


@pytest.mark.parametrize("value,expected", [(0.0, 0), (0.5, 128), (1.0, 255), (-3.0, 0), (7.5, 255), (0.25, 64)])
def test_float_tiff_is_clipped_to_0_1(value, expected):
    data = _file(Image.fromarray(np.full((8, 8), value, np.float32)), "TIFF")
    assert Image.open(io.BytesIO(data)).mode == "F"
    assert _grey(data) == expected


def test_float_tiff_with_nan_is_refused():
    arr = np.full((8, 8), 0.5, np.float32)
    arr[3, 3] = np.nan
    with pytest.raises(images.BadImage, match="non-finite"):
        images.decode(_file(Image.fromarray(arr), "TIFF"))


def test_32_bit_integer_holds_16_bit_values_or_is_refused():
    ok = _file(Image.fromarray(np.full((8, 8), 40000, np.int32)), "TIFF")
    assert Image.open(io.BytesIO(ok)).mode == "I"
    assert _grey(ok) == int(np.floor(40000 * 255 / 65535 + 0.5))
    for bad in (70000, -5):
        data = _file(Image.fromarray(np.full((8, 8), bad, np.int32)), "TIFF")
        with pytest.raises(images.BadImage, match="outside 0..65535"):
            images.decode(data)


@pytest.mark.parametrize(
    "data", [b"not an image at all", b"\x89PNG\r\n\x1a\n" + b"\x00" * 40, b"GIF89a" + b"\x01" * 10]
)
def test_error_reasons_are_deterministic_with_no_memory_address(data):
    reasons = set()
    for _ in range(3):
        with pytest.raises(images.BadImage) as e:
            images.load_for_vae(data, 16)
        reasons.add(str(e.value))
    (reason,) = reasons  # the same bad file gives the same reason every time
    assert "0x" not in reason and "object at" not in reason, reason


def test_cli_lines_carry_no_memory_address(capsys):
    from theworld.core.errors import UserError, cli_entry

    @cli_entry
    def main(argv=None):
        raise UserError(f"bad thing: {object()!r}")

    assert main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: bad thing: <object object>") and "0x" not in err


@pytest.mark.parametrize("res", [128, 256, 512, 1024])
def test_bucket_set_shapes(res):
    from theworld.model.images import BUCKET_STEP, buckets

    bs = buckets(res)
    assert BUCKET_STEP == 32 and (res, res) in bs and len(set(bs)) == len(bs)
    for w, h in bs:
        assert w % 32 == 0 and h % 32 == 0  # every world.pool (1, 2, 4) divides the (h/8, w/8) latent grid
        assert abs(w * h - res * res) <= max(w, h) * 32 / 2  # the generation rule's bound
        assert max(w, h) / min(w, h) <= 2.0
        assert (h, w) in bs
    ratios = [w / h for w, h in bs]
    assert ratios == sorted(ratios) and len(set(ratios)) == len(ratios)


def test_buckets_at_512_are_the_documented_ones_within_4_percent_of_the_area():
    from theworld.model.images import buckets

    landscape = [(512, 512), (544, 480), (576, 448), (608, 416), (640, 416), (672, 384), (704, 384)]
    assert buckets(512) == tuple(sorted({*landscape, *((h, w) for w, h in landscape)}, key=lambda b: b[0] / b[1]))
    assert all(abs(w * h / 512**2 - 1) < 0.04 for w, h in buckets(512))


@pytest.mark.parametrize(
    "size,bucket",
    [
        ((1920, 1080), (672, 384)),
        ((1080, 1920), (384, 672)),
        ((1000, 1000), (512, 512)),
        ((1200, 1000), (544, 480)),
        ((4000, 1000), (704, 384)),
        ((640, 480), (576, 448)),
        ((480, 640), (448, 576)),
        ((3, 2), (640, 416)),
    ],
)
def test_the_chosen_bucket(size, bucket):
    from theworld.model.images import bucket_for

    assert bucket_for(*size, 512) == bucket


def test_the_chosen_bucket_has_the_nearest_log_aspect_ratio():
    from theworld.model.images import bucket_for, buckets

    rng = random.Random(0)
    for _ in range(500):
        w, h = rng.randint(1, 5000), rng.randint(1, 5000)
        got = bucket_for(w, h, 512)
        dist = lambda b: abs(math.log(b[0] / b[1]) - math.log(w / h))
        assert dist(got) == min(dist(b) for b in buckets(512))


def test_bucket_resize_covers_the_bucket_and_crops_at_most_the_remainder():
    from theworld.model.images import bucket_for, load_for_vae

    for w, h in [(300, 150), (150, 300), (200, 120), (90, 300), (128, 128), (1000, 37)]:
        pixels, meta = load_for_vae(jpeg_bytes(gradient(w, h)), 128, "bucket")
        bw, bh = bucket_for(w, h, 128)
        assert tuple(pixels.shape) == (3, bh, bw) and pixels.dtype == torch.uint8
        left, top, right, bottom = meta["crop_box"]
        assert meta["original_size"] == [w, h]
        # the crop box has the bucket's aspect ratio, keeps one whole side and is centred
        assert (left, right) == (0, w) or (top, bottom) == (0, h)
        assert abs((right - left) / (bottom - top) - bw / bh) < 2 / min(right - left, bottom - top) + 1e-9
        assert abs(left - (w - right)) <= 1 and abs(top - (h - bottom)) <= 1


def test_bucket_follows_exif_rotation_and_squares_are_unchanged():
    from theworld.model.images import load_for_vae

    exif = Image.Exif()
    exif[0x0112] = 6  # stored 300 x 150, shown 150 x 300
    pixels, meta = load_for_vae(jpeg_bytes(gradient(300, 150), exif=exif.tobytes()), 128, "bucket")
    assert tuple(pixels.shape) == (3, 192, 96) and meta["original_size"] == [150, 300]
    data = jpeg_bytes(gradient(100, 100))
    crop, _ = load_for_vae(data, 128, "crop")
    bucket, _ = load_for_vae(data, 128, "bucket")
    assert tuple(bucket.shape) == (3, 128, 128) and torch.equal(crop, bucket)


def test_bucket_needs_a_resolution_divisible_by_32():
    from theworld.core.errors import UserError
    from theworld.model.config import ImageConfig

    with pytest.raises(UserError, match="image.resolution.*32"):
        ImageConfig(resolution=72, resize="bucket")
    ImageConfig(resolution=72, resize="crop")


def test_bad_images_in_bucket_mode_are_bad_images(tmp_path):
    """The bucket is chosen from the header before decoding: a broken or zero-size file is still a BadImage."""
    from tests._precompute_helpers import bomb_png
    from theworld.model.images import BadImage, load_for_vae

    for data in (
        b"",
        b"\xff\xd8\xff\xe0" + bytes(range(256)),
        bomb_png(),
        bomb_png(0, 10),
        bomb_png(10, 0),
        jpeg_bytes(gradient(64, 64))[:200],
    ):
        with pytest.raises(BadImage):
            load_for_vae(data, 128, "bucket")


def test_upscaled_compares_the_crop_box_with_the_bucket_not_the_resolution():
    """A 128x64 picture fills its 128x64 bucket at 96 px exactly: not enlarged, though its short side is under 96."""
    from theworld.model import images

    exact = {"original_size": [128, 64], "crop_box": [0, 0, 128, 64]}
    assert not images.upscaled(exact, 96, "bucket")
    assert images.upscaled({"original_size": [64, 32], "crop_box": [0, 0, 64, 32]}, 96, "bucket")
    assert images.upscaled(exact, 96, "crop")  # its 64 px square is enlarged to 96 x 96
    assert not images.upscaled({"original_size": [200, 100], "crop_box": [50, 0, 150, 100]}, 96, "crop")
