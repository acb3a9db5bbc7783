"""save_to_disk folders and Arrow files read through ParquetFile's interface; a folder that is not one is refused
in one line naming source.path."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from precompute.sources import arrow_files
from theworld.core.errors import UserError


def _table(lo: int, hi: int) -> pa.Table:
    return pa.table({"n": list(range(lo, hi)), "text": [f"t{i}" for i in range(lo, hi)]})


def _write_arrow(path, tables: list[pa.Table], stream: bool = True) -> None:
    with pa.OSFile(str(path), "wb") as sink:
        open_writer = pa.ipc.new_stream if stream else pa.ipc.new_file
        with open_writer(sink, tables[0].schema) as w:
            for t in tables:
                w.write_table(t)


def _saved(folder, names: list[str]):
    folder.mkdir(parents=True)
    (folder / arrow_files.STATE).write_text(json.dumps({"_data_files": [{"filename": n} for n in names]}))
    return folder


def test_a_save_to_disk_folder_lists_its_arrow_files_in_state_order_and_other_folders_none(tmp_path):
    folder = _saved(tmp_path / "ds", ["data-00001-of-00002.arrow", "data-00000-of-00002.arrow"])
    for n in ("data-00000-of-00002.arrow", "data-00001-of-00002.arrow"):
        _write_arrow(folder / n, [_table(0, 2)])
    assert arrow_files.saved_dataset_files(folder) == [
        str(folder / "data-00001-of-00002.arrow"),
        str(folder / "data-00000-of-00002.arrow"),
    ]
    assert arrow_files.saved_dataset_files(tmp_path) is None


def test_a_dataset_dict_a_damaged_state_and_a_missing_file_are_one_line_each(tmp_path):
    dd = tmp_path / "dd"
    _saved(dd / "train", [])
    _saved(dd / "test", [])
    (dd / arrow_files.DATASET_DICT).write_text("{}")
    with pytest.raises(UserError) as e:
        arrow_files.saved_dataset_files(dd)
    assert "DatasetDict (splits: test, train)" in str(e.value) and f"e.g. {dd / 'test'}" in str(e.value)
    bad = _saved(tmp_path / "bad", [])
    (bad / arrow_files.STATE).write_text('{"_data_files": [{"name": "x"}]}')
    with pytest.raises(UserError, match=r"'source.path': .*state.json is not a datasets state file \(KeyError\)"):
        arrow_files.saved_dataset_files(bad)
    gone = _saved(tmp_path / "gone", ["data.arrow"])
    with pytest.raises(UserError, match=r"lists .*data.arrow, which is missing"):
        arrow_files.saved_dataset_files(gone)


@pytest.mark.parametrize("stream", [True, False])
def test_an_arrow_file_reads_as_parquet_does_its_record_batches_being_row_groups(tmp_path, stream):
    path = tmp_path / "data.arrow"
    _write_arrow(path, [_table(0, 3), _table(3, 8)], stream=stream)
    f = arrow_files.open_table(str(path))
    assert isinstance(f, arrow_files.ArrowFile) and f.schema_arrow.names == ["n", "text"]
    assert f.metadata.num_row_groups == 2 and f.metadata.num_rows == 8 and f.metadata.row_group(1).num_rows == 5
    assert f.read_row_group(1, ["text"]).to_pydict() == {"text": ["t3", "t4", "t5", "t6", "t7"]}
    chunks = [b.to_pydict()["n"] for b in f.iter_batches(2, ["n"])]
    assert chunks == [[0, 1], [2], [3, 4], [5, 6], [7]]
    assert [b.to_pydict()["n"] for b in f.iter_batches(4, ["n"], row_groups=[1])] == [[3, 4, 5, 6], [7]]


def test_a_parquet_file_opens_as_parquet(tmp_path):
    pq.write_table(_table(0, 4), tmp_path / "a.parquet")
    f = arrow_files.open_table(str(tmp_path / "a.parquet"))
    assert isinstance(f, pq.ParquetFile) and f.metadata.num_rows == 4
