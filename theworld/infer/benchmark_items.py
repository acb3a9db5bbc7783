"""Multiple-choice benchmark items: reading and checking JSONL files and BLINK's parquet layout, and building a
synthetic set from unseen scenes.

JSONL, one item per line: `{"image": path relative to the file (or a list of paths), "question": str,
"choices": [str, ...], "answer": index or letter ("A" / "(A)"), "category": optional str, "prompt": optional str}`;
any other key is refused (a typo such as `categry` would otherwise drop the category silently).
BLINK: a folder of its parquet files (one sub-task folder each, `<split>-*.parquet`, only `split`'s files are read),
or one file, with `idx, sub_task, question, choices, answer "(A)", prompt` and `image_1`..`image_4` as image structs
`{bytes, path}`; `sub_task` is the category, `prompt` what the generate protocol asks (theworld/infer/letters.py).
VSR (Visual Spatial Reasoning, cambridgeltl/visual-spatial-reasoning) as released: a JSONL split (or a JSON list) of
`{image, caption, label, relation, ...}` records, recognised from those fields: each caption is a statement about the
image, asked as a two-way choice (True / False, the label 1 / 0), its relation the category. Its images are COCO
files found beside the split or in an `images/` folder beside it or above it (VSR's `data/images/`).

Items with several images: the world latents come from the first image; every image gets its image tokens, in order,
before the question.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from theworld.core import atomic
from theworld.core.errors import UserError
from theworld.embedded import synthetic
from theworld.model import images as imagelib
from theworld.model.control_text import text_problem

LETTER = re.compile(r"^\(?([A-Za-z])\)?$")
BLINK_IMAGES = ("image_1", "image_2", "image_3", "image_4")


@dataclass
class Item:
    name: str  # where it comes from, for messages: "file.jsonl:12" or "val.parquet:idx 3"
    images: list  # paths or encoded bytes; the first one's world latents are used
    question: str
    choices: list[str]
    answer: int
    category: str | None = None
    prompt: str | None = None  # the benchmark's own lettered prompt (BLINK's `prompt` column), if it has one


def _bad(name: str, field: str, why: str) -> UserError:
    return UserError(f"{name}: field '{field}': {why}")


def parse_answer(answer, choices: list[str], name: str) -> int:
    """An index into `choices`, or a letter A, B, ... (optionally in parentheses)."""
    if isinstance(answer, int) and not isinstance(answer, bool):
        index = answer
    elif isinstance(answer, str) and (m := LETTER.match(answer.strip())):
        index = ord(m.group(1).upper()) - ord("A")
    else:
        raise _bad(name, "answer", f"{answer!r} is neither an index nor a letter such as A or (A)")
    if not 0 <= index < len(choices):
        raise _bad(name, "answer", f"{answer!r} is outside the {len(choices)} choices")
    return index


JSONL_KEYS = ("image", "question", "choices", "answer", "category", "prompt")


def _check_keys(rec: dict, name: str) -> None:
    unknown = [k for k in rec if k not in JSONL_KEYS]
    if unknown:
        raise UserError(
            f"{name}: unknown key {unknown[0]!r} (an item has {', '.join(JSONL_KEYS[:4])} and optionally "
            f"{', '.join(JSONL_KEYS[4:])})"
        )


def _check_optional_text(rec: dict, name: str, field: str) -> str | None:
    value = rec.get(field)
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise _bad(name, field, "not a non-empty string")
    if problem := text_problem(value, field):  # too long, or Gemma would read it as a control token
        raise _bad(name, field, problem.removeprefix(f"{field} "))
    return value


def _check_text(rec: dict, name: str) -> tuple[str, list[str]]:
    question, choices = rec.get("question"), rec.get("choices")
    if not isinstance(question, str) or not question.strip():
        raise _bad(name, "question", "missing or not a non-empty string")
    if choices is None or not isinstance(choices, (list, tuple)):
        raise _bad(name, "choices", "missing or not a list of strings")
    if not choices:
        raise _bad(name, "choices", "empty list of choices")
    if not all(isinstance(c, str) and c.strip() for c in choices):
        raise _bad(name, "choices", "every choice must be a non-empty string")
    if len(choices) < 2:  # always counted correct
        raise _bad(name, "choices", "a single choice: multiple choice needs at least 2")
    first: dict[str, int] = {}
    for k, c in enumerate(choices):  # equal choices score equal, and a tie goes to the first
        if (j := first.setdefault(c.strip(), k)) != k:
            raise _bad(name, "choices", f"choices[{j}] and choices[{k}] are the same text ({_short(c)})")
    for field, text in [("question", question)] + [(f"choices[{k}]", c) for k, c in enumerate(choices)]:
        if problem := text_problem(text, field):  # too long, or Gemma would read it as a control token
            raise _bad(name, field, problem.removeprefix(f"{field} "))
    return question, list(choices)


def _short(text: str) -> str:
    return repr(text if len(text) <= 40 else text[:40] + "...")


def jsonl_records(path: Path) -> Iterator[tuple[str, dict]]:
    """(`path:line`, object) for each non-blank line of a UTF-8 JSONL file; a line that is not a JSON object is one
    error naming it."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: not a readable UTF-8 JSONL file ({type(e).__name__}: {e})") from None
    for n, line in enumerate(text.split("\n"), 1):  # JSONL lines end at \n only: a raw U+2028 is inside a string
        if not line.strip():
            continue
        name = f"{path}:{n}"
        try:
            rec = json.loads(line)
        except ValueError as e:
            raise UserError(f"{name}: malformed line, not JSON ({e})") from None
        except RecursionError:
            raise UserError(f"{name}: malformed line, JSON nested too deeply") from None
        if not isinstance(rec, dict):
            raise UserError(f"{name}: malformed line, not a JSON object")
        yield name, rec


def read_jsonl(path: Path) -> list[Item]:
    items = []
    for name, rec in jsonl_records(path):
        _check_keys(rec, name)
        question, choices = _check_text(rec, name)
        paths = rec.get("image")
        paths = [paths] if isinstance(paths, str) else paths
        if not paths or not isinstance(paths, list) or not all(isinstance(p, str) and p for p in paths):
            raise _bad(name, "image", "missing, or not a path (or a list of paths)")
        files = [path.parent / p for p in paths]
        for f in files:
            if problem := imagelib.path_problem(f):
                raise _bad(name, "image", f"{f}: {problem}")
        category = rec.get("category")
        if category is not None and not isinstance(category, str):
            raise _bad(name, "category", "not a string")
        items.append(
            Item(
                name,
                files,
                question,
                choices,
                parse_answer(rec.get("answer"), choices, name),
                category,
                _check_optional_text(rec, name, "prompt"),
            )
        )
    return items


def split_of(f: Path) -> str:
    """The split a parquet file of the hub layout holds: `val-00000-of-00001.parquet` -> val, `test.parquet` -> test."""
    return f.name.split("-", 1)[0].removesuffix(".parquet")


def blink_files(path: Path, split: str) -> list[Path]:
    """`path` itself (one file), or the folder's parquet files of `split`."""
    if not path.is_dir():
        return [path]
    files = sorted(path.rglob("*.parquet"))
    if not files:
        raise UserError(f"{path}: no .parquet files there")
    chosen = [f for f in files if split_of(f) == split]
    if not chosen:
        raise UserError(
            f"{path}: no parquet file of split {split!r} (--split; the folder holds "
            f"{', '.join(sorted({split_of(f) for f in files}))})"
        )
    return chosen


def read_blink(path: Path, split: str = "val") -> list[Item]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError("reading parquet needs pyarrow (pip install pyarrow)") from None
    items = []
    for f in blink_files(path, split):
        where = f.relative_to(path) if path.is_dir() else f  # the sub-task folder and the file
        try:
            rows = pq.read_table(f).to_pylist()
        except Exception as e:  # noqa: BLE001  (pyarrow raises several types for a file that is not parquet)
            raise UserError(f"{where}: not a readable parquet file ({type(e).__name__}: {e})") from None
        for i, rec in enumerate(rows):
            name = f"{where}:idx {rec.get('idx', i)}"
            question, choices = _check_text(rec, name)
            found = []
            for col in BLINK_IMAGES:
                image = rec.get(col)
                if image is None:
                    continue
                data = image.get("bytes") if isinstance(image, dict) else image if isinstance(image, bytes) else None
                if not data:
                    raise _bad(name, col, "image struct without bytes")
                found.append(data)
            if not found:
                raise _bad(name, "image_1", "no image")
            items.append(
                Item(
                    name,
                    found,
                    question,
                    choices,
                    parse_answer(rec.get("answer"), choices, name),
                    rec.get("sub_task"),
                    _check_optional_text(rec, name, "prompt"),
                )
            )
    return items


VSR_KEYS = ("image", "caption", "label", "relation")  # the fields that make a record VSR's
VSR_CHOICES = ["True", "False"]
VSR_QUESTION = 'Is this statement about the image true or false? "{}"'
VSR_IMAGE_LEVELS = 3  # folders above the split searched for images/ (data/splits/random/test.jsonl -> data/images)


def vsr_records(path: Path) -> list[tuple[str, dict]] | None:
    """(name, record) of a VSR split (JSONL, or a JSON list), or None when the file is not VSR's layout."""
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8-sig"))
        except (OSError, UnicodeDecodeError, ValueError, RecursionError):
            return None
        if not isinstance(data, list):
            return None
        records = [(f"{path}:{k}", r) for k, r in enumerate(data)]
    else:
        records = list(jsonl_records(path))
    if not records or not all(isinstance(r, dict) and all(k in r for k in VSR_KEYS) for _, r in records[:1]):
        return None
    return records if "question" not in records[0][1] else None


def _vsr_image(path: Path, image: str) -> Path:
    """A VSR record's image: beside the split, or in an images/ folder beside it or up to VSR_IMAGE_LEVELS above."""
    here = path.resolve().parent
    places = [here / image] + [d / "images" / image for d in [here, *here.parents][: VSR_IMAGE_LEVELS + 1]]
    return next((p for p in places if p.is_file()), places[0])


def read_vsr(path: Path, records: list[tuple[str, dict]]) -> list[Item]:
    items = []
    for name, rec in records:
        if not isinstance(rec, dict):
            raise UserError(f"{name}: not a JSON object")
        caption, label, relation, image = (rec.get(k) for k in ("caption", "label", "relation", "image"))
        if not isinstance(caption, str) or not caption.strip():
            raise _bad(name, "caption", "missing or not a non-empty string")
        if isinstance(label, bool) or label not in (0, 1):
            raise _bad(name, "label", f"{label!r} is neither 1 (true) nor 0 (false)")
        if not isinstance(image, str) or not image:
            raise _bad(name, "image", "missing or not a file name")
        if problem := text_problem(caption, "caption"):
            raise _bad(name, "caption", problem.removeprefix("caption "))
        file = _vsr_image(path, image)
        if problem := imagelib.path_problem(file):
            raise _bad(name, "image", f"{image}: {problem} (looked beside the split and in images/ folders above it)")
        category = relation if isinstance(relation, str) and relation else None
        items.append(Item(name, [file], VSR_QUESTION.format(caption.strip()), VSR_CHOICES, 0 if label else 1, category))
    return items


def read(path: str | Path, split: str = "val") -> list[Item]:
    """Items of a JSONL file, of BLINK's parquet layout (a folder of parquet files, only `split`'s, or one) or of a
    VSR split (recognised from its fields)."""
    p = Path(path)
    if not p.is_dir() and (problem := imagelib.path_problem(p)):  # never opened: a FIFO would block
        raise UserError(f"{p}: {problem.replace('not an image file', 'not a data file')}")
    if p.is_dir() or p.suffix == ".parquet":
        items = read_blink(p, split)
    elif (vsr := vsr_records(p)) is not None:
        items = read_vsr(p, vsr)
    else:
        items = read_jsonl(p)
    if not items:
        raise UserError(f"{p}: no items")
    return items


def unreadable(items: list[Item]) -> list[dict]:
    """Items with an image that does not decode: [{item, reason}] (they are skipped and reported)."""
    bad = []
    for it in items:
        for k, image in enumerate(it.images):
            try:
                imagelib.decode(imagelib.to_bytes(image))
            except (OSError, imagelib.BadImage) as e:
                bad.append({"item": it.name, "field": f"image {k + 1}", "reason": str(e)})
                break
    return bad


# ----------------------------------------------------------------------------------------------------------------------
# A synthetic set: unseen scenes, the true caption among one-word edits

EDITS = {
    "colour": sorted(synthetic.COLOURS),
    "shape": list(synthetic.SHAPES),
    "position": ["top", "bottom", "left", "right"],
}
CAPTIONS = "captions.jsonl"  # the synthetic set's scenes with their true captions, beside its items
OPPOSITE = {"top": "bottom", "bottom": "top", "left": "right", "right": "left"}


def one_word_edits(caption: str, kind: str) -> list[str]:
    """Every caption that differs from `caption` in one word of `kind` (a colour, a shape, or a position word
    swapped with its opposite)."""
    words = caption.split()
    out = []
    for i, w in enumerate(words):
        if w not in EDITS[kind]:
            continue
        for new in [OPPOSITE[w]] if kind == "position" else [x for x in EDITS[kind] if x != w]:
            edited = " ".join(words[:i] + [new] + words[i + 1 :])
            if edited != caption and edited not in out:
                out.append(edited)
    return out


def make_synthetic(path: str | Path, n: int, seed: int = 1, choices: int = 4, size: int = 64) -> list[dict]:
    """Write `n` items to the JSONL file `path` and their pictures to `images/` beside it. Scenes come from
    `synthetic.scene(seed, i)`; the training cache's scenes use its own seed (0 by default), so seed 1 is unseen.
    Each item's distractors are one-word edits of one kind (its category): colour, shape or position. The same
    scenes with their true captions go to `captions.jsonl` beside it (the caption task's format)."""
    out = Path(path)
    if out.name == CAPTIONS:
        raise UserError(f"--data {out}: {CAPTIONS} is the name of the captions file written beside the items")
    try:
        (out.parent / "images").mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--data {out}: cannot create {out.parent / 'images'} ({e.strerror})") from None
    rng = random.Random(f"mc:{seed}")
    records = []
    for i in range(n):
        img, caption = synthetic.scene(seed, i, size=size)
        rel = f"images/{seed}-{i:06d}.png"
        img.save(out.parent / rel)
        kinds = [k for k in EDITS if one_word_edits(caption, k)]
        kind = rng.choice(kinds)
        edits = one_word_edits(caption, kind)
        wrong = rng.sample(edits, min(choices - 1, len(edits)))
        answer = rng.randrange(len(wrong) + 1)
        records.append(
            {
                "image": rel,
                "question": synthetic.PROMPT,
                "choices": wrong[:answer] + [caption] + wrong[answer:],
                "answer": answer,
                "category": kind,
            }
        )
    caps = [{"image": r["image"], "captions": [r["choices"][r["answer"]]]} for r in records]
    for target, rows in ((out.parent / CAPTIONS, caps), (out, records)):
        atomic.write_text(target, "".join(json.dumps(r) + "\n" for r in rows))
    return records
