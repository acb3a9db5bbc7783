"""url + caption tables (DataComp's metadata: uid, url, text; LAION's: URL, TEXT), downloaded with img2dataset into a
staging folder, then read from the staged webdataset shards as the webdataset source reads its tars.

Tables: `source.path` names .parquet or .jsonl files (a file, a glob, a folder: its *.parquet, else its *.jsonl; "::"
between patterns). Columns: url (`source.url_column`, default the first of url, URL), caption
(`source.caption_column`, default the first of text, TEXT, caption), id (`source.id_column`, default the first of uid,
key, id, SAMPLE_ID; without one the key is "<file stem>-<row>"), through safe_key.

Staging (rank 0, before anything is listed): table j goes through `img2dataset.download` into `<staging>/table-<j>/`
(webdataset output: NNNNN.tar, NNNNN.parquet with every row's status and error_message, NNNNN_stats.json written last).
img2dataset's incremental mode redoes only shards without a stats file, and a table whose shards are all staged is
not handed to it at all, so a rerun downloads nothing that is staged. `source.num_samples` keeps the first N rows
(a row's usability is known only once it is downloaded): a table cut short is staged from a parquet copy of its rows.

Order: tables in path order, rows in table order (not in the order downloads finished), so the cache does not depend
on the network. A row img2dataset could not fetch or decode is an error entry whose reason is img2dataset's status and
error ("img2dataset failed_to_download: HTTP Error 404: Not Found"). The listing (row counts, duplicate-key errors)
is written once by rank 0 into `source-index/urls.json`; a rerun whose tables changed is refused.
"""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import numpy as np

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
from precompute.sources.webdataset import index_tar, load_sample, shard_files, tar_entries
from theworld import cache_format as cf
from theworld.cache_format import safe_key
from theworld.core import atomic, location
from theworld.core.errors import UserError, one_line, out_of_space
from theworld.core.paths import REGULAR, path_kind

URL_COLUMNS = ("url", "URL")
CAPTION_COLUMNS = ("text", "TEXT", "caption")
ID_COLUMNS = ("uid", "key", "id", "SAMPLE_ID")
INDEX_VERSION = 1
OOM_SHARD_COUNT = 5  # img2dataset's default: staged shard names are NNNNN (more digits past 99999)
RECORD = "urls-staging.json"  # in the staging folder: the tables and shard size it was staged with
WAIT_S = 5  # how often processes other than rank 0 look for the staged shards


def _first(names: list[str], wanted: tuple[str, ...]) -> str | None:
    return next((c for c in wanted if c in names), None)


def table_files(pattern: str) -> list[str]:
    """The tables `source.path` names: as a parquet source's files, a folder meaning its *.parquet, else its *.jsonl."""
    if "::" not in pattern and not any(c in pattern for c in "*?[{"):
        kind = path_kind(pattern)
        if kind is None:
            raise UserError(f"config key 'source.path': table not found: {pattern}")
        if kind not in (REGULAR, "a directory"):  # never opened: reading a FIFO waits forever
            raise UserError(f"config key 'source.path': {pattern} is {kind}, not a table file or a folder of them")
    try:
        files = shard_files(pattern, ".parquet")
    except UserError as first:
        try:
            files = shard_files(pattern, ".jsonl")
        except UserError:
            if "no .parquet files match" in str(first):
                raise UserError(f"config key 'source.path': no .parquet or .jsonl tables match {pattern!r}") from None
            raise first from None
    return files


def table_format(path: str) -> str:
    """img2dataset's input_format for a table file."""
    return "jsonl" if path.endswith((".jsonl", ".json")) else "parquet"


class Table:
    """One url table: its schema and row count (a parquet footer; a JSONL table is parsed whole, once)."""

    def __init__(self, path: str):
        import pyarrow.json as pajson
        import pyarrow.parquet as pq

        self.path, self.format, self._rows = path, table_format(path), None
        try:
            if self.format == "parquet":
                pf = pq.ParquetFile(path)
                self.schema, self.num_rows = pf.schema_arrow, pf.metadata.num_rows
            else:
                self._rows = pajson.read_json(path)
                self.schema, self.num_rows = self._rows.schema, self._rows.num_rows
        except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
            raise UserError(
                f"config key 'source.path': {path} is not a readable {self.format} table ({one_line(e, 300)})"
            ) from None

    def column(self, name: str):
        """A whole column as a pyarrow ChunkedArray (sliced per staged shard when listing)."""
        import pyarrow.parquet as pq

        try:
            if self._rows is not None:
                return self._rows.column(name)
            return pq.read_table(self.path, columns=[name]).column(0)
        except (OSError, ValueError) as e:
            raise UserError(
                f"config key 'source.path': column {name!r} of {self.path} cannot be read ({one_line(e, 300)})"
            ) from None

    def take(self, rows: list[int], columns: list[str]):
        """Some rows' `columns` as a pyarrow Table."""
        import pyarrow.parquet as pq

        table = self._rows if self._rows is not None else pq.read_table(self.path, columns=columns)
        return table.select(columns).take(rows)

    def head(self, n: int, columns: list[str], out: Path) -> None:
        """The first `n` rows' `columns` as a parquet file (a table cut by source.num_samples)."""
        import pyarrow.parquet as pq

        table = self._rows if self._rows is not None else pq.read_table(self.path, columns=columns)
        out.parent.mkdir(parents=True, exist_ok=True)
        with atomic.file(out) as tmp:
            pq.write_table(table.select(columns).slice(0, n), tmp)


def resolve_columns(table: Table, url: str | None, caption: str | None, id_: str | None) -> dict:
    """{url, caption, id} column names of a table (id None: keys from positions); a missing column is refused naming
    the columns the table has."""
    import pyarrow as pa

    names = table.schema.names
    listed = ", ".join(names) or "none"
    cols = {
        "url": url or _first(names, URL_COLUMNS),
        "caption": caption or _first(names, CAPTION_COLUMNS),
        "id": id_ or _first(names, ID_COLUMNS),
    }
    for what, wanted in (("url", URL_COLUMNS), ("caption", CAPTION_COLUMNS)):
        if cols[what] is None:
            raise UserError(
                f"config key 'source.{what}_column': {table.path} has no {what} column (none of "
                f"{', '.join(wanted)}; its columns: {listed}): set source.{what}_column"
            )
    for key, name in (("url_column", url), ("caption_column", caption), ("id_column", id_)):
        if name is not None and name not in names:
            raise UserError(f"config key 'source.{key}': {table.path} has no column {name!r} (its columns: {listed})")
    t = table.schema.field(cols["url"]).type
    if not (pa.types.is_string(t) or pa.types.is_large_string(t)):
        raise UserError(f"config key 'source.url_column': column {cols['url']!r} of {table.path} is {t}, not text")
    return cols


def _staged_name(shard: int) -> str:
    return f"{shard:0{OOM_SHARD_COUNT}d}"


def staged(folder: Path, rows: int, per_shard: int) -> bool:
    """Whether img2dataset finished every shard of a table of `rows` rows in `folder` (its stats file is last)."""
    return all((folder / f"{_staged_name(s)}_stats.json").is_file() for s in range(math.ceil(rows / per_shard)))


def _img2dataset():
    os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")  # albumentations asks PyPI for a newer version on import
    try:
        import img2dataset
    except ImportError:
        raise UserError(
            "source.type=urls needs img2dataset: `make install`, or pip install --no-deps img2dataset==1.47.0 and "
            "the requirements `python scripts/lock.py requirements img2dataset` prints"
        ) from None
    return img2dataset


def download(table: str, fmt: str, folder: Path, cols: dict, options) -> None:
    """img2dataset.download of one table into `folder`, incrementally (staged shards are skipped)."""
    img2dataset = _img2dataset()
    handler = signal.getsignal(signal.SIGINT)
    try:
        img2dataset.download(
            url_list=table,
            output_folder=str(folder),
            input_format=fmt,
            output_format="webdataset",
            url_col=cols["url"],
            caption_col=cols["caption"],
            incremental_mode="incremental",
            extract_exif=False,
            skip_reencode=True,  # an image already in encode_format keeps its bytes
            **asdict(options),
        )
    except SystemExit:  # img2dataset's Ctrl-C handler exits 0 after removing its temporary files
        raise KeyboardInterrupt from None
    finally:
        signal.signal(signal.SIGINT, handler)  # img2dataset.download installs its own


def refuse_local_urls(table: Table, column: str, rows: int) -> None:
    """A url table names images on the web: img2dataset would read a file:// URL from this machine's disk without a
    word (another machine's disk, in a job on several nodes), so one is refused before anything is downloaded."""
    import pyarrow.compute as pc

    urls = table.column(column).slice(0, rows)
    local = pc.match_substring_regex(urls, location.LOCAL_URL)
    if pc.any(local).as_py():
        row = pc.index(local, True).as_py()
        raise UserError(
            f"config key 'source.path': {table.path} row {row} has a local URL ({one_line(urls[row].as_py(), 200)}): "
            "a url table is downloaded from the web; put local images in a folder source (source.type: folder)"
        )


def _check_record(staging: Path, record: dict) -> None:
    """A staging folder is for one set of tables and one staged shard size: refuse to mix. More rows of them than
    were staged (a larger source.num_samples) get their last, short, staged shard downloaded again."""
    old = read_json(staging / RECORD)
    if old is None:
        try:
            staging.mkdir(parents=True, exist_ok=True)
            cf.atomic_write_json(staging / RECORD, record)
        except OSError as e:
            if out_of_space(e):
                raise
            raise UserError(
                f"config key 'source.staging_dir': cannot write {staging} ({e.strerror or one_line(e)}): set "
                "source.staging_dir to a folder this user can write"
            ) from None
        return
    if old.get("number_sample_per_shard") != record["number_sample_per_shard"]:
        raise UserError(
            f"config key 'source.img2dataset.number_sample_per_shard': {staging} was staged with "
            f"{old.get('number_sample_per_shard')} rows per shard, not {record['number_sample_per_shard']}: set it "
            "back, or use another source.staging_dir"
        )
    check_unchanged(old.get("tables"), record["tables"], staging, "rows")
    for j, (before, now) in enumerate(zip(old.get("tables") or [], record["tables"])):
        shard, cut = divmod(before[-1], record["number_sample_per_shard"])
        if now[-1] > before[-1] and cut:  # staged for fewer rows (source.num_samples): its last shard is short
            (staging / f"table-{j:05d}" / f"{_staged_name(shard)}_stats.json").unlink(missing_ok=True)
    cf.atomic_write_json(staging / RECORD, record)


class UrlsListing(Listing):
    """Entries of url tables, staged by img2dataset. Entries are built per staged shard: its keys from the table's id
    column, its statuses from img2dataset's parquet, its samples' spans from the tar's header listing (as the
    webdataset source lists a tar: `source-index/urls-<table>-<shard>.json`)."""

    def __init__(
        self,
        pattern: str,
        default_prompt: str,
        index_dir: Path,
        staging: Path,
        columns: dict,
        options,
        num_rows: int | None = None,
        rank: int = 0,
        barrier: Callable[[], None] = lambda: None,
    ):
        self.files, self.prompt, self.index_dir = table_files(pattern), default_prompt, Path(index_dir)
        self.staging, self.per_shard = Path(staging), options.number_sample_per_shard
        tables = [Table(f) for f in self.files]
        found = [resolve_columns(t, **columns) for t in tables]
        self.cols = found[0]
        for t, c in zip(tables, found):
            if c != self.cols:
                raise UserError(f"config key 'source.path': {t.path} has other columns than {self.files[0]}")
        self.rows = _cut([t.num_rows for t in tables], num_rows)
        idents = [file_identity(f) + [INDEX_VERSION, n] for f, n in zip(self.files, self.rows)]
        summary_file = self.index_dir / "urls.json"
        recorded = (read_json(summary_file) or {}).get("identities")
        check_unchanged(recorded, idents, self.index_dir, "rows")
        if rank == 0:
            _check_record(self.staging, {"tables": idents, "number_sample_per_shard": self.per_shard})
            for j, t in enumerate(tables):
                self._stage(j, t, options)
        else:  # a download outlasts any collective's timeout: wait on the files (the launcher ends us if rank 0 fails)
            while not all(staged(self.folder(j), n, self.per_shard) for j, n in enumerate(self.rows) if n):
                time.sleep(WAIT_S)
        barrier()
        self._tables = {j: t for j, t in enumerate(tables) if t.format == "jsonl"}  # parsed already
        self._ids: dict[int, object] = {}
        self._cache: dict[tuple[int, int], list[Entry]] = {}
        self.starts = [0] + np.cumsum(self.rows).tolist()
        if recorded != idents and rank == 0:
            self.index_dir.mkdir(parents=True, exist_ok=True)
            self._write_summary(summary_file, idents)
        barrier()
        self.duplicates = {int(i): m for i, m in read_json(summary_file)["duplicates"].items()}
        self._cache, self._ids, self._tables = {}, {}, {}

    def folder(self, j: int) -> Path:
        return self.staging / f"table-{j:05d}"

    def _stage(self, j: int, table: Table, options) -> None:
        """Download table j's rows (the first `self.rows[j]`) unless every staged shard of it is there."""
        folder, rows = self.folder(j), self.rows[j]
        if not rows or staged(folder, rows, self.per_shard):
            return
        source, fmt = table.path, table.format
        if rows < table.num_rows:  # cut by source.num_samples: img2dataset reads whole tables
            source, fmt = str(self.staging / f"table-{j:05d}-head.parquet"), "parquet"
            wanted = [c for c in dict.fromkeys((self.cols["url"], self.cols["caption"])) if c]
            table.head(rows, wanted, Path(source))
        refuse_local_urls(table, self.cols["url"], rows)
        download(source, fmt, folder, self.cols, options)
        shards = range(math.ceil(rows / self.per_shard))
        missing = [s for s in shards if not (folder / f"{_staged_name(s)}_stats.json").exists()]
        if missing:
            raise UserError(
                f"img2dataset did not finish staged shard {_staged_name(missing[0])} of {table.path} (in {folder}"
                + (f", and {len(missing) - 1} more" if len(missing) > 1 else "")
                + "): its log above says why; rerun the same command to retry it (staged shards are kept)"
            )

    def _write_summary(self, summary_file: Path, idents: list) -> None:
        """The one scan (rank 0): key hashes of every row, the duplicate-key errors from them."""
        hashes = []
        for j, rows in enumerate(self.rows):
            ids = self._id_column(j)
            values = ids.slice(0, rows).to_pylist() if ids is not None else [None] * rows
            hashes += [key_hash(self._key(j, r, v)) for r, v in enumerate(values)]
        dups = duplicates_from_hashes(
            np.arange(len(hashes), dtype=np.int64), np.array(hashes, dtype=np.int64), lambda i: self._raw(i, i + 1)[0]
        )
        cf.atomic_write_json(
            summary_file, {"identities": idents, "duplicates": {str(i): m for i, m in sorted(dups.items())}}
        )

    def _id_column(self, j: int):
        if j not in self._ids:
            if len(self._ids) >= 2:
                self._ids.pop(next(iter(self._ids)))
            table = self._tables.get(j) or Table(self.files[j])
            self._ids[j] = table.column(self.cols["id"]) if self.cols["id"] else None
        return self._ids[j]

    def _key(self, j: int, row: int, value: object = None) -> str:
        if value is None and (ids := self._id_column(j)) is not None:
            value = ids[row].as_py()
        return safe_key(str(value) if value not in (None, "") else f"{Path(self.files[j]).stem}-{row:09d}")

    def __len__(self) -> int:
        return self.starts[-1]

    def _shard(self, j: int, s: int) -> list[Entry]:
        """Entries of staged shard s of table j, in row order."""
        if (j, s) in self._cache:
            return self._cache[(j, s)]
        import pyarrow.parquet as pq

        compute_key = _img2dataset().downloader.compute_key  # the key img2dataset gives row i of shard s

        folder, name = self.folder(j), _staged_name(s)
        recorded = pq.read_table(folder / f"{name}.parquet", columns=["key", "status", "error_message", "url"])
        statuses = {r["key"]: r for r in recorded.to_pylist()}
        tar = str(folder / f"{name}.tar")
        samples = {e.key: e for e in tar_entries(tar, index_tar(tar, self.index_dir / f"urls-{j:05d}-{name}.json"), "")}
        lo = s * self.per_shard
        oom = math.ceil(math.log10(self.per_shard))
        out = []
        for i in range(min(self.per_shard, self.rows[j] - lo)):
            row = lo + i
            e = Entry(key=self._key(j, row), source=f"{Path(self.files[j]).name}:{row}", prompt=self.prompt)
            staged_key = compute_key(i, s, oom, OOM_SHARD_COUNT)
            status = statuses.get(staged_key)
            sample = samples.get(staged_key)
            if status is None:
                e.error = "img2dataset recorded nothing for this row (its log says why)"
            elif status["status"] != "success":
                message = one_line(status["error_message"] or "no message", 300)
                e.error = f"img2dataset {status['status']}: {message} (url {one_line(status['url'], 300)})"
            elif sample is None or sample.error is not None:
                e.error = "staged sample missing from " + tar + (f" ({sample.error})" if sample else "")
            else:
                e.loc, e.extra = sample.loc, sample.extra
            out.append(e)
        if len(self._cache) >= 2:  # consecutive cache shards of one process fall in the same staged shard
            self._cache.pop(next(iter(self._cache)))
        self._cache[(j, s)] = out
        return out

    def _raw(self, lo: int, hi: int) -> list[Entry]:
        out: list[Entry] = []
        while lo < hi:
            j = int(np.searchsorted(self.starts, lo, side="right")) - 1
            row = lo - self.starts[j]
            s = row // self.per_shard
            take = self._shard(j, s)[row - s * self.per_shard : hi - self.starts[j] - s * self.per_shard]
            out += [Entry(**vars(e)) for e in take]  # copies: duplicate marking must not touch the cached list
            lo += len(take)
        return out

    def _load(self, entry: Entry) -> Loaded:
        image, caption, prompt, meta = load_sample(entry)  # meta: img2dataset's json (its "key" is a position)
        meta = {"url": meta["url"]} if "url" in meta else {}
        return Loaded(image, caption, prompt, {**meta, "uid": entry.key} if self.cols["id"] else meta)

    def failure_hint(self) -> str:
        return f"img2dataset's shards and their per-row status are in {self.staging}"

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_cache": {}, "_ids": {}, "_tables": {}}  # workers read their own


def _cut(rows: list[int], n: int | None) -> list[int]:
    """Rows used of each table: all, or the first `n` rows over the tables in order."""
    if not n:
        return rows
    out = []
    for r in rows:
        out.append(min(r, n))
        n -= out[-1]
    return out


def plan_sample(source, work: Path, k: int) -> tuple[UrlsListing, dict]:
    """For --plan: up to `k` rows spread evenly over the rows a run would use, downloaded into `work` as a run would
    download them. Returns their listing and {rows: rows planned for (source.num_samples, beyond the table's rows:
    extrapolated), table_rows, staging_bytes: what img2dataset staged for the sampled rows}."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = table_files(source.path)
    tables = [Table(f) for f in files]
    cols = [resolve_columns(t, source.url_column, source.caption_column, source.id_column) for t in tables][0]
    total = sum(t.num_rows for t in tables)
    if not total:
        raise UserError(f"config key 'source.path': no rows in {source.path}")
    rows = source.num_samples or total
    used = min(rows, total)
    picks = sorted({i * used // min(used, k) for i in range(min(used, k))}) if used else []
    starts = [0] + np.cumsum([t.num_rows for t in tables]).tolist()
    wanted = [c for c in dict.fromkeys((cols["url"], cols["caption"], cols["id"])) if c]
    parts = []
    for j, t in enumerate(tables):
        local = [p - starts[j] for p in picks if starts[j] <= p < starts[j + 1]]
        if local:
            parts.append(t.take(local, wanted))
    sample = work / "plan-sample.parquet"
    work.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.concat_tables(parts, promote_options="permissive") if parts else pa.table({}), sample)
    listing = UrlsListing(
        str(sample),
        source.prompt,
        work / "index",
        work / "staging",
        {"url": cols["url"], "caption": cols["caption"], "id_": cols["id"]},
        source.img2dataset,
    )
    staged_bytes = sum(f.stat().st_size for f in (work / "staging").rglob("*") if f.is_file())
    return listing, {"rows": rows, "table_rows": total, "staging_bytes": staged_bytes}
