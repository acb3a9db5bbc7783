"""Flip augmentation's text rule (docs/training.md, "Flip"): `left`/`right` (and `leftmost`/`rightmost`) are
swapped, case kept, only where they name a side of the picture."""

from __future__ import annotations

import re

_SWAP = {"left": "right", "right": "left", "leftmost": "rightmost", "rightmost": "leftmost"}
SIDE_AFTER = frozenset(
    "of side sides half halves hand hands corner corners edge edges part parts portion portions "
    "quadrant quadrants third thirds column columns border margin wing".split()
)
SIDE_BEFORE = frozenset(
    "to on at from toward towards top bottom upper lower far center centre middle facing faces "
    "face looking looks pointing points turned turning turn turns leaning leans moving moves "
    "heading heads".split()
)
ARTICLES = frozenset("the its their his her a".split())
PREPOSITIONS = frozenset("to on at from toward towards in into onto near by off".split())
LINKS = frozenset(("and", "or", "to"))  # "left and right", "from right to left": both words swap
_WORD = re.compile(r"[A-Za-z']+")


def swap_left_right(text: str) -> str:
    """The caption of the mirrored picture: see the rule above and in docs/training.md."""
    words = list(_WORD.finditer(text))
    low = [m.group().lower() for m in words]

    def joined(i: int, j: int) -> bool:  # words i < j with nothing but spaces or hyphens between them
        return 0 <= i and j < len(words) and not text[words[i].end() : words[j].start()].strip(" -\t")

    swap = set()
    for i, w in enumerate(low):
        if w in ("leftmost", "rightmost"):
            swap.add(i)
        elif w in ("left", "right"):
            before = low[i - 1] if joined(i - 1, i) else ""
            article_after_preposition = before in ARTICLES and joined(i - 2, i - 1) and low[i - 2] in PREPOSITIONS
            after = low[i + 1] if joined(i, i + 1) else ""
            if after in SIDE_AFTER or before in SIDE_BEFORE or article_after_preposition:
                swap.add(i)
    for i in sorted(swap):  # a swapped word's partner across and/or/to
        for j in (i - 2, i + 2):
            lo, hi = min(i, j), max(i, j)
            if (
                0 <= lo
                and hi < len(low)
                and low[j] in _SWAP
                and low[lo + 1] in LINKS
                and joined(lo, lo + 1)
                and joined(lo + 1, hi)
            ):
                swap.add(j)
    out, end = [], 0
    for i in sorted(swap):
        m = words[i]
        word = _SWAP[low[i]]
        if m.group().isupper():
            word = word.upper()
        elif m.group()[0].isupper():
            word = word.capitalize()
        out += [text[end : m.start()], word]
        end = m.end()
    return "".join(out) + text[end:]
