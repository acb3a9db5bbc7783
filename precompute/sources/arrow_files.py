"""The table files a parquet source reads: parquet files, or the Arrow files of a Hugging Face `datasets` folder
written with `save_to_disk` (`state.json` lists them in order; each is an Arrow IPC stream).

`open_table(path)` gives what the parquet listing uses of `pyarrow.parquet.ParquetFile` (metadata row groups,
`iter_batches`, `read_row_group`, `schema_arrow`) for either kind; an Arrow file is memory-mapped and its record
batches are its row groups.
"""

from __future__ import annotations

import json
from pathlib import Path

from theworld.core.errors import UserError

STATE = "state.json"  # a datasets.Dataset.save_to_disk folder
DATASET_DICT = "dataset_dict.json"  # a datasets.DatasetDict.save_to_disk folder: one such folder per split


def saved_dataset_files(folder: Path) -> list[str] | None:
    """The Arrow files of a `save_to_disk` folder in order, or None when `folder` is not one. A DatasetDict's folder
    is refused naming its splits (each split is a source of its own)."""
    if (folder / DATASET_DICT).is_file() and not (folder / STATE).is_file():
        splits = sorted(p.name for p in folder.iterdir() if (p / STATE).is_file())
        raise UserError(
            f"config key 'source.path': {folder} holds a datasets DatasetDict (splits: "
            f"{', '.join(splits) or 'none'}); set source.path to one split's folder, e.g. "
            f"{folder / (splits[0] if splits else 'train')}"
        )
    if not (folder / STATE).is_file():
        return None
    try:
        state = json.loads((folder / STATE).read_bytes())
        names = [f["filename"] for f in state["_data_files"]]
    except (OSError, ValueError, RecursionError, KeyError, TypeError) as e:
        raise UserError(
            f"config key 'source.path': {folder / STATE} is not a datasets state file ({type(e).__name__})"
        ) from None
    files = [folder / n for n in names]
    if missing := [str(f) for f in files if not f.is_file()]:
        raise UserError(f"config key 'source.path': {folder / STATE} lists {missing[0]}, which is missing")
    return [str(f) for f in files]


class _Metadata:
    def __init__(self, batches: list):
        self._batches = batches
        self.num_row_groups = len(batches)
        self.num_rows = sum(b.num_rows for b in batches)

    def row_group(self, g: int):
        return self._batches[g]


class ArrowFile:
    """An Arrow IPC file (stream or file format), memory-mapped, read through ParquetFile's interface."""

    def __init__(self, path: str):
        import pyarrow as pa

        source = pa.memory_map(str(path))
        try:
            table = pa.ipc.open_stream(source).read_all()
        except pa.ArrowInvalid:
            source.seek(0)
            table = pa.ipc.open_file(source).read_all()
        self.schema_arrow = table.schema
        self._batches = table.to_batches()
        self.metadata = _Metadata(self._batches)

    def read_row_group(self, g: int, columns: list[str]):
        import pyarrow as pa

        return pa.Table.from_batches([self._batches[g].select(columns)])

    def iter_batches(self, batch_size: int, columns: list[str], row_groups: list[int] | None = None):
        for g in range(len(self._batches)) if row_groups is None else row_groups:
            yield from self.read_row_group(g, columns).to_batches(max_chunksize=batch_size)


def open_table(path: str):
    """A parquet file as `pyarrow.parquet.ParquetFile`, an Arrow file (`.arrow`) as `ArrowFile`."""
    if str(path).endswith(".arrow"):
        return ArrowFile(path)
    import pyarrow.parquet as pq

    return pq.ParquetFile(path)
