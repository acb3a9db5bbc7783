"""Parquet sources: files as HF `datasets` or DataComp tooling write them, read with pyarrow in row batches.

Order: files in `source.path` order (a file, a glob, a folder = every *.parquet in it sorted, "::" between
patterns; a folder written by `datasets`' `save_to_disk` = its Arrow files in state.json's order), rows in file
order. Columns:
  image:   `source.image_column` (default `image`): an {bytes, path} struct (HF datasets' Image feature) or raw bytes;
           a row without bytes is an error entry (nothing is downloaded).
  caption: `source.caption_column` (default: the first of `caption`, `text` that exists).
  prompt:  `source.prompt_column` (optional; a null value or no column: `source.prompt`).
  key:     the first of `key`, `uid`, `id` that exists (else "<file stem>-<row>"), through safe_key.
  meta:    `url`, `uid`, `key` columns go to the sample's json member.

The listing (per file: identity, row count, row-group sizes; the duplicate-key errors) is written once by rank 0
into `source-index/parquet.json`; a rerun whose files differ from it (a file added, removed, or with another size or
modification time) is refused, since the shards already written follow the recorded rows.
Only the key column is read to list; an entry's row is read when it is loaded, one batch of `BATCH_ROWS` rows of one
row group at a time (a DataLoader worker reads its shard's rows in order, so each batch is read once).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from precompute.sources import content
from precompute.sources.arrow_files import open_table, saved_dataset_files
from precompute.sources.content import SourceError
from precompute.sources.listing import (
    Entry,
    Listing,
    Loaded,
    check_unchanged,
    duplicates_from_hashes,
    file_identity,
    key_hash,
    read_json,
)
from precompute.sources.webdataset import shard_files
from theworld import cache_format as cf
from theworld.cache_format import safe_key
from theworld.core.errors import UserError, one_line

KEY_COLUMNS = ("key", "uid", "id")
CAPTION_COLUMNS = ("caption", "text")
BATCH_ROWS = 64
INDEX_VERSION = 1


def _pq():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError("source.type=parquet needs pyarrow: pip install pyarrow") from None
    return pq


def _identity(path: str) -> list:
    return file_identity(path) + [INDEX_VERSION]


def _first(names: list[str], wanted: tuple[str, ...]) -> str | None:
    return next((c for c in wanted if c in names), None)


def resolve_columns(schema, path: str, image: str | None, caption: str | None, prompt: str | None) -> dict:
    """{image, caption, prompt, key, meta} column names for a file's arrow schema; a missing or wrongly typed
    column is refused naming its config key."""
    import pyarrow as pa

    names = schema.names
    cols = {
        "image": image or "image",
        "caption": caption or _first(names, CAPTION_COLUMNS),
        "prompt": prompt,
        "key": _first(names, KEY_COLUMNS),
        "meta": [c for c in content.PROVENANCE_FIELDS if c in names],
    }
    listed = ", ".join(names)
    for key, name in (
        ("image_column", cols["image"]),
        ("caption_column", cols["caption"]),
        ("prompt_column", cols["prompt"]),
    ):
        if key == "caption_column" and name is None:
            raise UserError(
                f"config key 'source.caption_column': {path} has none of the columns "
                f"{', '.join(CAPTION_COLUMNS)} (columns: {listed})"
            )
        if name is not None and name not in names:
            raise UserError(f"config key 'source.{key}': {path} has no column {name!r} (columns: {listed})")
    t = schema.field(cols["image"]).type
    binary = lambda x: pa.types.is_binary(x) or pa.types.is_large_binary(x)
    if not (binary(t) or (pa.types.is_struct(t) and t.get_field_index("bytes") >= 0 and binary(t.field("bytes").type))):
        raise UserError(
            f"config key 'source.image_column': column {cols['image']!r} of {path} is {t}, not image "
            "bytes or a {bytes, path} struct (parquet rows must carry the images: nothing is downloaded)"
        )
    return cols


def _schema(path: str):
    """A file's arrow schema, from its footer (or an Arrow file's header); a file that is neither is refused, naming
    it."""
    _pq()
    try:
        return open_table(path).schema_arrow
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise UserError(f"config key 'source.path': {path} is not a readable parquet file ({one_line(e)})") from None


def _unreadable_column(path: str, column: str, e: Exception) -> UserError:
    return UserError(
        f"config key 'source.path': column {column!r} of {path} cannot be read ({type(e).__name__}: {one_line(e)})"
    )


def _image_bytes(value: object) -> bytes:
    if isinstance(value, dict):  # HF datasets' Image feature: {"bytes": ..., "path": ...}
        data, path = value.get("bytes"), value.get("path")
    else:
        data, path = value, None
    if not data:
        raise SourceError("no image bytes" + (f" (path {path!r}; nothing is downloaded)" if path else ""))
    if not isinstance(data, bytes):
        raise SourceError(f"image is {type(data).__name__}, not bytes")
    content.check_image_size(len(data))
    return data


def _json_value(v: object) -> object:
    return v if v is None or isinstance(v, (str, int, float, bool)) else str(v)


class ParquetListing(Listing):
    def __init__(
        self,
        pattern: str,
        default_prompt: str,
        index_dir: Path,
        columns: dict,
        rank: int = 0,
        barrier: Callable[[], None] = lambda: None,
    ):
        saved = saved_dataset_files(Path(pattern)) if Path(pattern).is_dir() else None
        self.files, self.prompt = saved or shard_files(pattern, ".parquet"), default_prompt
        found = [resolve_columns(_schema(f), f, **columns) for f in self.files]
        self.cols = found[0]
        for f, c in zip(self.files, found):
            if c != self.cols:
                raise UserError(
                    f"config key 'source.path': {f} has other columns than {self.files[0]} ({c} vs {self.cols})"
                )
        summary_file = Path(index_dir) / "parquet.json"
        idents = [_identity(f) for f in self.files]
        recorded = (read_json(summary_file) or {}).get("identities")
        check_unchanged(recorded, idents, index_dir, "rows")
        fresh = recorded == idents
        if not fresh and rank == 0:
            Path(index_dir).mkdir(parents=True, exist_ok=True)
            self._write_summary(summary_file, idents)
        barrier()
        summary = read_json(summary_file)
        self.groups = summary["row_groups"]
        self.starts = [0] + np.cumsum([sum(g) for g in self.groups]).tolist()
        self.duplicates = {int(i): m for i, m in summary["duplicates"].items()}
        self._keys_cache: tuple | None = None
        self._stream: dict | None = None

    def _write_summary(self, summary_file: Path, idents: list) -> None:
        """The one scan (rank 0): row-group sizes from each footer, key hashes from the key column alone."""
        _pq()  # pyarrow installed, or one line saying so
        self.groups = []
        hashes: list[int] = []
        for j, f in enumerate(self.files):
            pf = open_table(f)
            self.groups.append([pf.metadata.row_group(g).num_rows for g in range(pf.metadata.num_row_groups)])
            if self.cols["key"] is None:
                hashes += [key_hash(self._fallback_key(j, r)) for r in range(pf.metadata.num_rows)]
                continue
            row = 0
            try:
                for batch in pf.iter_batches(batch_size=65536, columns=[self.cols["key"]]):
                    for value in batch.column(0).to_pylist():
                        hashes.append(key_hash(self._key(j, row, value)))
                        row += 1
            except (OSError, ValueError) as e:  # a corrupt page: ArrowIOError / ArrowInvalid
                raise _unreadable_column(f, self.cols["key"], e) from None
        self.starts = [0] + np.cumsum([sum(g) for g in self.groups]).tolist()
        self._keys_cache, self._stream = None, None
        dups = duplicates_from_hashes(
            np.arange(len(hashes), dtype=np.int64), np.array(hashes, dtype=np.int64), lambda i: self._raw(i, i + 1)[0]
        )
        cf.atomic_write_json(
            summary_file,
            {
                "identities": idents,
                "row_groups": self.groups,
                "duplicates": {str(i): m for i, m in sorted(dups.items())},
            },
        )

    def _fallback_key(self, j: int, row: int) -> str:
        return f"{Path(self.files[j]).stem}-{row:09d}"

    def _key(self, j: int, row: int, value: object) -> str:
        return safe_key(str(value) if value not in (None, "") else self._fallback_key(j, row))

    def __len__(self) -> int:
        return self.starts[-1]

    def _locate(self, j: int, row: int) -> tuple[int, int]:
        """(row group, row within it) of a file's row."""
        ends = np.cumsum(self.groups[j])
        g = int(np.searchsorted(ends, row, side="right"))
        return g, row - (int(ends[g - 1]) if g else 0)

    def _group_keys(self, j: int, g: int) -> list:
        if self._keys_cache is None or self._keys_cache[:2] != (j, g):
            try:
                pf = open_table(self.files[j])
                keys = pf.read_row_group(g, columns=[self.cols["key"]]).column(0).to_pylist()
            except (OSError, ValueError) as e:
                raise _unreadable_column(self.files[j], self.cols["key"], e) from None
            self._keys_cache = (j, g, keys)
        return self._keys_cache[2]

    def _raw(self, lo: int, hi: int) -> list[Entry]:
        out = []
        for i in range(lo, hi):
            j = int(np.searchsorted(self.starts, i, side="right")) - 1
            row = i - self.starts[j]
            value = None
            if self.cols["key"] is not None:
                g, r = self._locate(j, row)
                value = self._group_keys(j, g)[r]
            out.append(
                Entry(
                    key=self._key(j, row, value),
                    source=f"{Path(self.files[j]).name}:{row}",
                    prompt=self.prompt,
                    loc=(j, row),
                )
            )
        return out

    def _row(self, j: int, row: int) -> dict:
        """One row's columns, streaming the row group in batches of BATCH_ROWS (restarted only to go back)."""
        g, r = self._locate(j, row)
        s = self._stream
        if s is None or (s["j"], s["g"]) != (j, g) or r < s["start"]:
            names = [self.cols["image"], self.cols["caption"], *self.cols["meta"]]
            names += [self.cols["prompt"]] if self.cols["prompt"] else []
            batches = open_table(self.files[j]).iter_batches(
                batch_size=BATCH_ROWS, row_groups=[g], columns=list(dict.fromkeys(names))
            )
            s = self._stream = {"j": j, "g": g, "batches": batches, "start": 0, "rows": []}
        while r >= s["start"] + len(s["rows"]):
            s["start"] += len(s["rows"])
            s["rows"] = next(s["batches"]).to_pylist()
        return s["rows"][r - s["start"]]

    def _load(self, entry: Entry) -> Loaded:
        try:
            row = self._row(*entry.loc)
        except (ValueError, OSError, StopIteration) as e:  # ArrowInvalid is a ValueError, ArrowIOError an OSError
            self._stream = None
            raise SourceError(f"cannot read row: {type(e).__name__}: {one_line(e)}") from None
        prompt = row.get(self.cols["prompt"]) if self.cols["prompt"] else None
        meta = {c: _json_value(row[c]) for c in self.cols["meta"] if row[c] is not None}
        return Loaded(
            _image_bytes(row[self.cols["image"]]),
            row[self.cols["caption"]],
            entry.prompt if prompt is None else prompt,
            meta,
        )

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_keys_cache": None, "_stream": None}  # workers open their own readers
