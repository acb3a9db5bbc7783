"""LLaVA-style sources: a JSON list of {id, image, conversations: [{from: human, value}, {from: gpt, value}]}
(LLaVA-CC3M-Pretrain-595K's chat.json), images relative to `image_root` (default: the JSON's folder).

Order: the list's order; key = safe_key(id). The prompt is the first human turn without the `<image>` token (anywhere
in its text) and its newline, the caption is the first gpt turn; the later human/gpt pairs of a conversation
(LLaVA-Instruct) go into the sample's json member as `turns` (cache_format.TURNS). An item whose turns do not alternate
human, gpt, ... ending with gpt, with `<image>` in a later turn, or with no image (text-only: the model always has an
image) or no id is an error entry.

The list is parsed once per output_dir (on rank 0, the whole file at once: JSON has no streaming form in the
standard library) into `source-index/llava.jsonl`, one line per item, and listed from there like captions.jsonl, so
other processes and reruns never parse it again. A rerun against a chat.json that changed is refused.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path

from precompute.sources import content
from precompute.sources.folder import JsonlListing, check_image_path
from precompute.sources.listing import Entry, Loaded, read_json
from theworld import cache_format as cf
from theworld.cache_format import safe_key
from theworld.core.errors import UserError

IMAGE_TOKEN = "<image>"


def _identity(path: Path) -> list:
    st = os.stat(path)
    return [os.path.abspath(path), st.st_size, st.st_mtime_ns]


def strip_image_token(text: str) -> str:
    """The human turn as a prompt: every `<image>` token removed with the whitespace around it (one space where it
    stood between two words)."""
    return re.sub(r"\s*" + re.escape(IMAGE_TOKEN) + r"\s*", " ", text).strip()


def item_record(item: object, n: int, name: str) -> dict:
    """One list item as a normalised line: {key, source, image, prompt, caption} or {key, source, error}."""
    fallback = {"key": safe_key(f"item-{n}"), "source": f"{name}:{n}"}
    try:
        if not isinstance(item, dict):
            raise ValueError("not a JSON object")
        if not isinstance(item.get("id"), (str, int)) or isinstance(item.get("id"), bool):
            raise ValueError("no 'id'")
        fallback["key"] = safe_key(str(item["id"]))
        if "image" not in item:
            raise ValueError("no 'image' (a text-only item)")
        check_image_path(item["image"])
        turns = item.get("conversations")
        if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
            raise ValueError("'conversations' must be a list of turns")
        if not turns or len(turns) % 2 or [t.get("from") for t in turns] != ["human", "gpt"] * (len(turns) // 2):
            raise ValueError("conversation does not alternate human, gpt turns (starting with human, ending with gpt)")
        if not all(isinstance(t.get("value"), str) for t in turns):
            raise ValueError("a turn's 'value' is not a string")
        if any(IMAGE_TOKEN in t["value"] for t in turns[1:]):
            raise ValueError(f"{IMAGE_TOKEN} outside the first human turn (a sample has one image, in its first turn)")
    except ValueError as e:
        return {**fallback, "error": f"bad item: {e}"}
    values = [t["value"] for t in turns]
    rec = {
        "key": fallback["key"],
        "source": item["image"],
        "image": item["image"],
        "prompt": strip_image_token(values[0]),
        "caption": values[1],
    }
    if len(values) > 2:
        rec[cf.TURNS] = [values[i : i + 2] for i in range(2, len(values), 2)]
    return rec


def _convert(path: Path, out: Path) -> None:
    """chat.json -> normalised lines, written atomically."""
    try:
        items = content.parse_json(path.read_bytes())
    except (OSError, ValueError) as e:
        raise UserError(f"config key 'source.path': cannot read {path} as JSON: {e}") from None
    if not isinstance(items, list):
        raise UserError(f"config key 'source.path': {path} is not a JSON list of items")
    # ASCII JSON: one line per item whatever the captions hold
    lines = (json.dumps(item_record(item, n, path.name)) + "\n" for n, item in enumerate(items))
    cf.atomic_write_bytes(out, "".join(lines).encode())


class LlavaListing(JsonlListing):
    def __init__(
        self,
        path: str,
        image_root: str | None,
        index_dir: Path,
        rank: int = 0,
        barrier: Callable[[], None] = lambda: None,
    ):
        src, index_dir = Path(path), Path(index_dir)
        lines, ident_file = index_dir / "llava.jsonl", index_dir / "llava.json"
        old = read_json(ident_file)
        if old is not None and old.get("identity") != _identity(src):
            raise UserError(
                f"config key 'source.path': {src} changed since the cache in {index_dir.parent} was "
                "started (size or modification time), so its shards follow other items: restore it, or "
                "use another output_dir (or delete that one) to start over"
            )
        if old is None and rank == 0:
            index_dir.mkdir(parents=True, exist_ok=True)
            _convert(src, lines)
            cf.atomic_write_json(ident_file, {"identity": _identity(src)})
        barrier()
        self.json_path, self.image_root_set = src, image_root is not None
        super().__init__(Path(image_root) if image_root else src.parent, "", path=lines)

    def failure_hint(self) -> str:
        """Where image paths were looked for; when they are not there but in an images/ folder beside the JSON
        (LLaVA-Pretrain's layout), the source.image_root that finds them."""
        first = next(
            (e for lo in range(0, len(self), 1024) for e in self.entries(lo, lo + 1024) if e.error is None), None
        )
        if first is None:
            return ""
        rel = Path(first.source)
        hint = f"image paths such as {str(rel)!r} are looked for under {self.root}"
        for folder in (self.json_path.parent / "images", self.json_path.parent / "images" / "images"):
            if folder != self.root and (folder / rel).is_file():
                return f"{hint}; {folder} holds them: set source.image_root={folder}"
        return hint + ("" if self.image_root_set else " (the JSON's folder; set source.image_root to another)")

    def _record(self, n: int, line: str | None) -> Entry:
        rec = json.loads(line)
        if "error" in rec:
            return Entry(key=rec["key"], source=rec["source"], error=rec["error"])
        extra = {cf.TURNS: rec[cf.TURNS]} if cf.TURNS in rec else {}
        return Entry(
            key=rec["key"],
            source=rec["source"],
            caption=rec["caption"],
            prompt=rec["prompt"],
            loc=(str(self.root / rec["image"]),),
            extra=extra,
        )

    def _load(self, entry: Entry) -> Loaded:
        loaded = super()._load(entry)
        if cf.TURNS not in entry.extra:
            return loaded
        turns = [
            [content.check_text(user, f"turn {n} prompt"), content.check_text(model, f"turn {n} answer")]
            for n, (user, model) in enumerate(entry.extra[cf.TURNS], start=2)
        ]
        return loaded._replace(meta={**loaded.meta, cf.TURNS: turns})
