"""Pixel conversion: every high-depth mode scaled by one documented rule (never guessed from the values), or refused."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

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
