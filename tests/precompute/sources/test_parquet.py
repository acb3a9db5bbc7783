"""precompute/sources/parquet.py: parquet tables (HF datasets' image struct, DataComp, chosen columns, a file changed
since the cache was started, a file that is not parquet). Moved from tests/test_sources.py."""

from __future__ import annotations

import json
import os

import pytest

from precompute import cosmos_latents, pipeline, sources
from tests._precompute_helpers import cli_args, gradient, jpeg_bytes, make_cfg, read_cache_plain
from tests._source_helpers import hf_parquet
from theworld import cache_format as cf
from theworld.core.errors import UserError


def test_parquet_hf_datasets_image_struct(tmp_path, fake_vae, monkeypatch):
    from precompute.sources import parquet

    monkeypatch.setattr(parquet, "BATCH_ROWS", 2)  # rows stream in batches of 2 inside row groups of 3
    (tmp_path / "data").mkdir()
    rows = [
        {"image": {"bytes": jpeg_bytes(gradient(30 + i, 24)), "path": f"img{i}.jpg"}, "text": f"text {i}"}
        for i in range(7)
    ]
    rows[4]["image"] = {"bytes": None, "path": "http://x/4.jpg"}
    rows[5]["text"] = "  "
    hf_parquet(tmp_path / "data" / "train-00000-of-00002.parquet", rows[:5], 3)
    hf_parquet(tmp_path / "data" / "train-00001-of-00002.parquet", rows[5:], 3)
    out = tmp_path / "c"
    result = pipeline.run(
        make_cfg(out, "source.type=parquet", f"source.path={tmp_path}/data", "num_workers=1", shard=3)
    )  # a worker process: the listing crosses a process boundary
    samples = read_cache_plain(out)
    stem = "train-00000-of-00002"
    assert list(samples) == [f"{stem}-{i:09d}" for i in range(4)] + ["train-00001-of-00002-000000001"]
    assert [m["txt"] for m in samples.values()] == [b"text 0", b"text 1", b"text 2", b"text 3", b"text 6"]
    assert json.loads(samples[f"{stem}-000000002"]["json"])["prompt"] == "Describe the image."
    reasons = {e["source"]: e["reason"] for e in cf.read_errors(out)}
    assert reasons == {
        f"{stem}.parquet:4": "no image bytes (path 'http://x/4.jpg'; nothing is downloaded)",
        "train-00001-of-00002.parquet:0": "empty caption",
    }
    assert result["num_errors"] == 2
    # the listing is kept: a rerun reads no key column again and gives the same shards
    index = (out / "source-index" / "parquet.json").stat().st_mtime_ns
    again = pipeline.run(make_cfg(out, "source.type=parquet", f"source.path={tmp_path}/data", shard=3))
    assert (out / "source-index" / "parquet.json").stat().st_mtime_ns == index
    assert again["shard_index"] == result["shard_index"]


def test_parquet_file_changed_since_the_cache_was_started_is_refused(tmp_path, fake_vae, capsys):
    """As a changed folder is: a file whose size or modification time differs, or one added or removed, is named;
    the shards already written stay."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "data").mkdir()
    rows = lambda lo, hi: pa.table(
        {
            "image": pa.array([jpeg_bytes(gradient(20 + i, 20)) for i in range(lo, hi)]),
            "caption": [f"c {i}" for i in range(lo, hi)],
        }
    )
    pq.write_table(rows(0, 4), tmp_path / "data" / "a.parquet")
    pq.write_table(rows(4, 6), tmp_path / "data" / "b.parquet")
    out = tmp_path / "c"
    args = cli_args(out, "source.type=parquet", f"source.path={tmp_path}/data", shard=2)
    assert cosmos_latents.main(args) == 0
    written = {p.name: p.read_bytes() for p in (out / "shards").iterdir()}
    cf.tar_path(out, 1).unlink()  # interrupted: shard 1 is to be redone
    capsys.readouterr()
    pq.write_table(rows(10, 14), tmp_path / "data" / "a.parquet")  # same row count, other rows
    os.utime(tmp_path / "data" / "a.parquet", ns=(1, 1))
    assert cosmos_latents.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "a.parquet changed" in err and "another output_dir" in err
    assert not cf.tar_path(out, 1).exists()
    assert all((out / "shards" / n).read_bytes() == b for n, b in written.items() if n != cf.tar_path(out, 1).name)
    pq.write_table(rows(0, 4), tmp_path / "data" / "a.parquet")
    (tmp_path / "data" / "b.parquet").unlink()
    assert cosmos_latents.main(args) == 2
    assert "b.parquet was removed" in capsys.readouterr().err


def test_parquet_datacomp(tmp_path, fake_vae, capsys):
    """DataComp: the metadata parquet (uid, url, text, ...) carries no images and is refused with one line; the
    img2dataset parquet of it (key, uid, url, caption, status, jpg) is read with source.image_column=jpg."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    meta = {
        "uid": [f"{i:032x}" for i in range(3)],
        "url": [f"http://x/{i}" for i in range(3)],
        "text": ["a", "b", "c"],
        "original_width": [640] * 3,
        "original_height": [480] * 3,
        "clip_b32_similarity_score": [0.3] * 3,
        "face_bboxes": [[[0.1, 0.1, 0.2, 0.2]], [], []],
        "sha256": ["0" * 64] * 3,
    }
    pq.write_table(pa.table(meta), tmp_path / "metadata.parquet")
    assert (
        cosmos_latents.main(cli_args(tmp_path / "m", "source.type=parquet", f"source.path={tmp_path}/metadata.parquet"))
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "source.image_column" in err and "uid, url, text" in err
    (tmp_path / "dl").mkdir()
    table = pa.table(
        {
            "key": [f"{i:09d}" for i in range(4)],
            "uid": [f"{i:032x}" for i in range(4)],
            "url": [f"http://x/{i}" for i in range(4)],
            "caption": ["a", "b", "c", "d"],
            "status": ["success", "success", "failed_to_download", "success"],
            "error_message": [None, None, "timeout", None],
            "jpg": pa.array(
                [jpeg_bytes(gradient(30, 24)), jpeg_bytes(gradient(31, 24)), None, jpeg_bytes(gradient(32, 24))],
                pa.binary(),
            ),
        }
    )
    pq.write_table(table, tmp_path / "dl" / "00000.parquet")
    out = tmp_path / "c"
    pipeline.run(
        make_cfg(out, "source.type=parquet", f"source.path={tmp_path}/dl/*.parquet", "source.image_column=jpg")
    )
    samples = read_cache_plain(out)
    assert list(samples) == ["000000000", "000000001", "000000003"]
    assert json.loads(samples["000000003"]["json"])["url"] == "http://x/3"
    assert json.loads(samples["000000003"]["json"])["uid"] == f"{3:032x}" and samples["000000003"]["txt"] == b"d"
    assert [e["reason"] for e in cf.read_errors(out)] == ["no image bytes"]


def test_parquet_columns_and_prompt_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    img = jpeg_bytes(gradient(20, 20))
    pq.write_table(
        pa.table(
            {
                "id": [7, 8, 7],
                "image": pa.array([img] * 3, pa.binary()),
                "caption": ["x", "y", "z"],
                "question": ["Q?", None, "R?"],
            }
        ),
        tmp_path / "a.parquet",
    )
    listing = sources.open_listing(
        "parquet",
        str(tmp_path / "a.parquet"),
        None,
        0,
        "Default?",
        index_dir=tmp_path / "idx",
        columns={"image": None, "caption": None, "prompt": "question"},
    )
    entries = listing.entries(0, 3)
    assert [(e.key, e.error) for e in entries] == [
        ("7", None),
        ("8", None),
        ("7", "duplicate key: '7' (first used by a.parquet:0)"),
    ]
    assert [listing.load(e).prompt for e in entries[:2]] == ["Q?", "Default?"]
    with pytest.raises(UserError, match="source.caption_column.*no column 'nope'"):
        sources.open_listing(
            "parquet",
            str(tmp_path / "a.parquet"),
            None,
            0,
            "p",
            index_dir=tmp_path / "i2",
            columns={"image": None, "caption": "nope", "prompt": None},
        )


def test_a_file_that_is_not_parquet_is_refused_naming_it(tmp_path, fake_vae, capsys):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.parquet").write_bytes(b"PAR1 not really")
    assert cosmos_latents.main(cli_args(tmp_path / "c", "source.type=parquet", f"source.path={tmp_path}/d")) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"{tmp_path}/d/a.parquet is not a readable parquet file" in err


def _parquet_with_corrupt_key_column(path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests._precompute_helpers import gradient, png_bytes

    n, img = 20, png_bytes(gradient(16, 16))
    pq.write_table(
        pa.table({"key": [f"k{i:03d}" for i in range(n)], "image": [img] * n, "caption": [f"c{i}" for i in range(n)]}),
        path,
        compression="none",
    )
    page = pq.ParquetFile(path).metadata.row_group(0).column(0).data_page_offset
    data = bytearray(path.read_bytes())
    data[page : page + 12] = bytes(b ^ 0xFF for b in data[page : page + 12])  # the key column's page header
    path.write_bytes(bytes(data))


def test_a_corrupt_parquet_key_column_is_one_line_naming_file_and_column(tmp_path, capsys, fake_vae):
    from precompute import cosmos_latents
    from tests._precompute_helpers import cli_args

    bad = tmp_path / "bad.parquet"
    _parquet_with_corrupt_key_column(bad)
    assert cosmos_latents.main(cli_args(tmp_path / "out", "source.type=parquet", f"source.path={bad}")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"column 'key' of {bad} cannot be read" in err, err


def test_a_datasets_save_to_disk_folder_is_a_parquet_source(tmp_path, capsys, fake_vae):
    """Written by the real `datasets` package: Arrow stream files listed in state.json, in order."""
    import datasets

    from precompute import cosmos_latents
    from tests._precompute_helpers import cli_args, gradient, png_bytes, read_cache_plain

    n = 12
    rows = {
        "image": [{"bytes": png_bytes(gradient(20 + i, 16)), "path": None} for i in range(n)],
        "caption": [f"scene {i} ." for i in range(n)],
        "uid": [f"u{i:02d}" for i in range(n)],
    }
    ds = datasets.Dataset.from_dict(rows).cast_column("image", datasets.Image())
    ds.save_to_disk(str(tmp_path / "ds"), num_shards=3)
    assert len(list((tmp_path / "ds").glob("*.arrow"))) == 3
    out = tmp_path / "c"
    assert cosmos_latents.main(cli_args(out, "source.type=parquet", f"source.path={tmp_path / 'ds'}", n=n)) == 0
    samples = read_cache_plain(out)
    assert list(samples) == rows["uid"]
    assert [s["txt"].decode() for s in samples.values()] == rows["caption"]
    assert [s["image"] for s in samples.values()] == [r["bytes"] for r in rows["image"]]
    datasets.DatasetDict({"train": ds, "validation": ds}).save_to_disk(str(tmp_path / "dd"))
    assert cosmos_latents.main(cli_args(tmp_path / "c2", "source.type=parquet", f"source.path={tmp_path / 'dd'}")) == 2
    assert (
        f"holds a datasets DatasetDict (splits: train, validation); set source.path to one split's folder, e.g. "
        f"{tmp_path / 'dd' / 'train'}" in capsys.readouterr().err
    )
