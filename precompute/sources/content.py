"""The rules every source applies to what it reads: text decoding, caption and prompt checks, JSON parsing, and
reading an image file or tar member (regular files only, size checked before reading)."""

from __future__ import annotations

import json
import os
import stat

from theworld.core.paths import file_kind
from theworld.model.control_text import MAX_TEXT_CHARS, text_problem  # noqa: F401 - MAX_TEXT_CHARS: the rule precompute follows

# Larger image files are refused before they are read: PIL's own pixel limit (images.MAX_PIXELS, 89 M pixels) is
# about 270 MB as an uncompressed 8-bit RGB file, so nothing usable is bigger than this.
MAX_IMAGE_BYTES = 512 << 20


class SourceError(ValueError):
    """An entry that cannot be used; the message is the reason recorded in errors.jsonl."""


def decode_text(data: bytes) -> str:
    """UTF-8, strictly (as webdataset decodes a `txt` member), without a leading byte-order mark."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SourceError(f"invalid UTF-8 at byte {e.start}") from None
    return text[1:] if text.startswith("\ufeff") else text


def check_text(text: object, what: str) -> str:
    """A caption or prompt as it is stored: surrounding whitespace removed; refused if blank, not a string, longer than
    MAX_TEXT_CHARS, or holding a Gemma control string (tokenised as a control token, it would not be text)."""
    if text is None:  # a null column value
        text = ""
    if not isinstance(text, str):
        raise SourceError(f"{what} is not a string")
    text = text.strip()
    if not text:
        raise SourceError(f"empty {what}")
    if problem := text_problem(text, what):
        raise SourceError(problem)
    return text


def parse_json(text: str | bytes) -> object:
    """json.loads that reports a document nested too deeply (RecursionError) as a bad document (ValueError)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


PROVENANCE_FIELDS = ("url", "uid", "key")  # kept from a source's per-sample metadata in the sample's json member


def provenance(raw: bytes | None) -> dict:
    """The provenance fields of a per-sample JSON document (img2dataset's json); a broken one is ignored, one nested
    too deeply is refused (it cannot be parsed, and it is not what a tool writes)."""
    if not raw:
        return {}
    try:
        rec = json.loads(raw)
    except RecursionError:
        raise SourceError("json member nested too deeply") from None
    except ValueError:
        return {}
    return {k: rec[k] for k in PROVENANCE_FIELDS if isinstance(rec, dict) and k in rec}


def check_image_size(size: int) -> None:
    if size > MAX_IMAGE_BYTES:
        raise SourceError(f"image file too large: {size} bytes (> {MAX_IMAGE_BYTES})")


def read_file(path: str) -> bytes:
    """An image file's bytes. A FIFO, socket or device is refused before it is opened (reading a FIFO would wait
    forever), and so is a file over MAX_IMAGE_BYTES. Raises SourceError, or OSError for a missing/unreadable file."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise SourceError(f"not a regular file ({file_kind(st.st_mode)})")
    check_image_size(st.st_size)
    with open(path, "rb") as f:
        return f.read(MAX_IMAGE_BYTES + 1)


def read_span(path: str, offset: int, size: int) -> bytes:
    """`size` bytes at `offset` of a tar (a member listed earlier). Raises OSError if the tar got shorter."""
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read(size)
    if len(data) != size:  # the tar changed since it was listed
        raise OSError(f"truncated tar member ({len(data)} of {size} bytes)")
    return data


def read_image_span(path: str, offset: int, size: int) -> bytes:
    check_image_size(size)
    return read_span(path, offset, size)
