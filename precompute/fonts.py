"""The font `inspect decode` labels its sheet with: one that has glyphs for the captions' characters.

PIL's built-in font covers Latin only (anything else is a box). So a TrueType font found at run time is used: a
preferred one with wide coverage (DejaVu Sans, Noto Sans, ...), or, when it lacks characters the labels hold, the
installed font that covers most of them. What no installed font covers is drawn as boxes and named in one line.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from theworld.core import log

_log = log.get(__name__)

FONT_DIRS = (
    "/usr/share/fonts",
    "/usr/local/share/fonts",
    "~/.local/share/fonts",
    "~/.fonts",
    "/Library/Fonts",
    "/System/Library/Fonts",
    "C:/Windows/Fonts",
)
PREFERRED = (
    "DejaVuSans.ttf",
    "NotoSans-Regular.ttf",
    "NotoSansCJK-Regular.ttc",
    "LiberationSans-Regular.ttf",
    "Arial Unicode.ttf",
    "Arial.ttf",
)
MAX_SCANNED = 400  # font files tried for coverage at most (a system with thousands stays quick)
SIZE = 11


@functools.lru_cache(maxsize=1)
def installed() -> list[Path]:
    """Font files under the usual folders, preferred names first."""
    found: list[Path] = []
    for d in FONT_DIRS:
        root = Path(os.path.expanduser(d))
        if root.is_dir():
            found += sorted(p for p in root.rglob("*") if p.suffix.lower() in (".ttf", ".otf", ".ttc"))
    rank = {name: k for k, name in enumerate(PREFERRED)}
    return sorted(found, key=lambda p: rank.get(p.name, len(rank)))[:MAX_SCANNED]


def _drawn(font, c: str) -> bytes:
    from PIL import Image, ImageDraw

    img = Image.new("L", (3 * SIZE, 2 * SIZE))
    ImageDraw.Draw(img).text((0, 0), c, font=font, fill=255)
    return img.tobytes()


def missing(font, chars: set[str]) -> set[str]:
    """The characters of `chars` `font` has no glyph for: drawn like a character no font has (its .notdef box)."""
    probe = _drawn(font, "\U0010fffd")  # a private-use code point: the font's missing-glyph box
    return {c for c in chars if not c.isspace() and _drawn(font, c) == probe}


def for_text(texts: list[str]):
    """(font, characters it cannot draw) for labels `texts`: the first preferred font that covers them, else the
    installed font that covers most; PIL's default font when none is installed."""
    from PIL import ImageFont

    chars = {c for t in texts for c in t}
    best = None
    for path in installed():
        try:
            font = ImageFont.truetype(str(path), SIZE)
        except OSError:
            continue
        lacks = missing(font, chars)
        if best is None or len(lacks) < len(best[1]):
            best = (font, lacks)
        if not lacks:
            break
    if best is None:
        default = ImageFont.load_default(SIZE)
        return default, missing(default, chars)
    return best


def say_missing(lacks: set[str]) -> None:
    if lacks:
        shown = ", ".join(repr(c) for c in sorted(lacks)[:8]) + (" ..." if len(lacks) > 8 else "")
        _log.info(
            f"inspect decode: no installed font has glyphs for {len(lacks)} character(s) of the captions "
            f"({shown}): they are drawn as boxes"
        )
