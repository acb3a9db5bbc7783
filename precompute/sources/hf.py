"""A Hugging Face Hub dataset id as a source (`source.name: user/dataset`, `source.split`), read through
`datasets.load_dataset` (offline, from the local datasets cache, when HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set).

The rows are then read as a parquet source reads its files (`source.image_column`, `source.caption_column`,
`source.prompt_column`, keys from the key / uid / id column, else "<file stem>-<row>"):
- `streaming: false`: the Arrow files `load_dataset` left in the datasets cache, memory-mapped, in their order (a
  split that selects part of them, e.g. `train[:1000]`, is written once as parquet into the cache's source-index).
- `streaming: true`: the rows of `load_dataset(..., streaming=True)` in its order (the first `source.num_samples` rows
  only, when set: nothing past them is downloaded), written once by rank 0 as parquet parts into the cache's
  source-index folder; a rerun reads those.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from precompute.sources.listing import read_json
from precompute.sources.parquet import ParquetListing
from theworld import cache_format as cf
from theworld.core import atomic
from theworld.core.errors import UserError, one_line

PART_ROWS = 10000  # rows per parquet part of a streamed split


def _load(name: str, split: str, streaming: bool):
    try:
        import datasets
    except ImportError:
        raise UserError("source.type=hf needs datasets: pip install datasets") from None
    try:
        return datasets.load_dataset(name, split=split, streaming=streaming)
    except (ConnectionError, FileNotFoundError, ValueError, KeyError) as e:  # offline and not cached, no such split
        raise UserError(
            f"config key 'source.name': cannot load dataset {name!r} split {split!r} through datasets "
            f"({type(e).__name__}: {one_line(e, 300)})"
        ) from None


def _arrow_files(ds) -> list[str] | None:
    """The cache files holding exactly the split's rows in order, or None (a selection or an in-memory table)."""
    files = [c["filename"] for c in ds.cache_files]
    if not files:
        return None
    import pyarrow as pa

    rows = 0
    for f in files:
        with pa.memory_map(f) as source:
            try:
                rows += pa.ipc.open_stream(source).read_all().num_rows
            except pa.ArrowInvalid:
                source.seek(0)
                rows += pa.ipc.open_file(source).read_all().num_rows
    return files if rows == len(ds) else None


def _stream(name: str, split: str, n: int | None, folder: Path) -> None:
    """Rank 0: the streamed split (its first n rows) as parquet parts in `folder`, `done.json` last."""
    import pyarrow.parquet as pq

    ds = _load(name, split, streaming=True)
    ds = ds.take(n) if n else ds
    ds = ds.decode(False)  # Image columns stay {bytes, path}, as in a parquet file
    folder.mkdir(parents=True, exist_ok=True)
    part = 0
    try:
        for table in ds.with_format("arrow").iter(batch_size=PART_ROWS):
            with atomic.file(folder / f"part-{part:06d}.parquet") as tmp:
                pq.write_table(table, tmp)
            part += 1
    except (ConnectionError, OSError, ValueError) as e:
        raise UserError(
            f"config key 'source.name': streaming {name!r} split {split!r} failed after {part * PART_ROWS} rows "
            f"({type(e).__name__}: {one_line(e, 300)}); rerun to start it again"
        ) from None
    if not part:
        raise UserError(f"config key 'source.name': dataset {name!r} split {split!r} has no rows")
    cf.atomic_write_json(folder / "done.json", {"name": name, "split": split, "num_samples": n, "parts": part})


def hf_listing(
    name: str,
    split: str,
    streaming: bool,
    num_samples: int | None,
    default_prompt: str,
    index_dir: Path,
    columns: dict,
    rank: int = 0,
    barrier: Callable[[], None] = lambda: None,
) -> ParquetListing:
    """The split's rows as a parquet listing (files resolved by rank 0, then shared through `index_dir`)."""
    index_dir = Path(index_dir)
    record = index_dir / "hf.json"
    if rank == 0:
        if streaming:
            folder = index_dir / "hf-stream"
            done = read_json(folder / "done.json")
            if done != {"name": name, "split": split, "num_samples": num_samples, "parts": (done or {}).get("parts")}:
                _stream(name, split, num_samples, folder)
            parts = read_json(folder / "done.json")["parts"]
            files = [str(folder / f"part-{p:06d}.parquet") for p in range(parts)]
        else:
            ds = _load(name, split, streaming=False)
            files = _arrow_files(ds)
            if files is None:
                out = index_dir / "hf-split.parquet"
                if not out.is_file():
                    index_dir.mkdir(parents=True, exist_ok=True)
                    with atomic.file(out) as tmp:
                        ds.to_parquet(str(tmp))
                files = [str(out)]
        index_dir.mkdir(parents=True, exist_ok=True)
        cf.atomic_write_json(record, {"files": files})
    barrier()
    files = read_json(record)["files"]
    return ParquetListing("::".join(files), default_prompt, index_dir, columns, rank, barrier)
