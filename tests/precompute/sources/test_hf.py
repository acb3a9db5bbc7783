"""source.type=hf: a Hub dataset id read through the real `datasets.load_dataset`, offline from a datasets cache that
the test fills the way `datasets` itself lays out a dataset it has loaded from the Hub (HF_HUB_OFFLINE=1 is set for
every test by conftest.py)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from precompute import cosmos_latents, pipeline
from tests._precompute_helpers import gradient, make_cfg, png_bytes, read_cache_plain
from theworld import cache_format as cf
from theworld.core.errors import UserError

datasets = pytest.importorskip("datasets")

CAPTIONS = ["a red one", "a green one", "   ", "a blue one", "a last one"]  # row 2: blank, an error entry


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """A datasets cache holding `someone/tiny-scenes` (split train) as `load_dataset` leaves a Hub dataset: the
    parquet builder's Arrow output under <cache>/someone___tiny-scenes/default/0.0.0/<hash>/tiny-scenes-train.arrow,
    which `load_dataset("someone/tiny-scenes")` finds offline (datasets' CachedDatasetModuleFactory)."""
    cache = tmp_path / "hf-datasets"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    features = datasets.Features(
        {"id": datasets.Value("string"), "image": datasets.Image(), "text": datasets.Value("string")}
    )
    rows = {
        "id": [f"s{i}" for i in range(5)],
        "image": [{"bytes": png_bytes(gradient(32 + 4 * i, 32)), "path": None} for i in range(5)],
        "text": CAPTIONS,
    }
    datasets.Dataset.from_dict(rows, features=features).to_parquet(str(tmp_path / "train.parquet"))
    built = datasets.load_dataset(
        "parquet", data_files={"train": str(tmp_path / "train.parquet")}, cache_dir=str(cache)
    )
    src = Path(built["train"].cache_files[0]["filename"]).parent
    dst = cache / "someone___tiny-scenes" / "default" / src.parent.name / src.name
    dst.parent.mkdir(parents=True)
    shutil.move(src, dst)
    for f in dst.iterdir():
        if f.name.startswith("parquet-"):
            os.replace(f, dst / f.name.replace("parquet-", "tiny-scenes-", 1))
    shutil.rmtree(cache / "parquet")
    return cache


def test_a_hub_dataset_id_is_read_through_datasets_offline(hub_cache, tmp_path, fake_vae):
    out = tmp_path / "cache"
    cfg = make_cfg(out, "source.type=hf", "source.name=someone/tiny-scenes", "source.num_samples=null", shard=2)
    result = pipeline.run(cfg)
    assert result["num_samples"] == 4 and result["num_errors"] == 1
    cache = read_cache_plain(out)
    assert list(cache) == ["s0", "s1", "s3", "s4"]
    assert cache["s3"]["txt"] == b"a blue one"
    assert cache["s3"][cf.IMAGE] == png_bytes(gradient(44, 32))
    assert [e["key"] for e in cf.read_errors(out)] == ["s2"]


def test_a_split_that_selects_rows_is_read_as_selected(hub_cache, tmp_path, fake_vae):
    out = tmp_path / "cache"
    cfg = make_cfg(out, "source.type=hf", "source.name=someone/tiny-scenes", "source.split=train[1:4]", shard=2)
    result = pipeline.run(cfg)
    assert list(read_cache_plain(out)) == ["s1", "s3"] and result["num_errors"] == 1


def test_streaming_reads_only_the_first_rows(hub_cache, tmp_path, fake_vae):
    out = tmp_path / "cache"
    cfg = make_cfg(out, "source.type=hf", "source.name=someone/tiny-scenes", "source.streaming=true", n=2, shard=2)
    result = pipeline.run(cfg)
    assert list(read_cache_plain(out)) == ["s0", "s1"] and result["num_errors"] == 0
    parts = sorted(p.name for p in (out / cf.INDEX_DIR / "hf-stream").glob("part-*.parquet"))
    assert parts == ["part-000000.parquet"]
    import pyarrow.parquet as pq

    assert pq.read_table(out / cf.INDEX_DIR / "hf-stream" / parts[0]).num_rows == 2  # nothing past the first 2 rows


def test_a_dataset_id_not_in_the_cache_is_one_line(hub_cache, tmp_path, capsys):
    argv = ["--set", f"output_dir={tmp_path / 'c'}", "--set", "source.type=hf", "--set", "source.name=someone/absent"]
    assert cosmos_latents.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "source.name" in err and "someone/absent" in err, err


def test_hf_needs_a_name_and_no_path(tmp_path):
    with pytest.raises(UserError, match="source.name.*none is set"):
        make_cfg(tmp_path / "c", "source.type=hf").validate_paths()
    with pytest.raises(UserError, match="not source.path"):
        make_cfg(tmp_path / "c", "source.type=hf", "source.name=a/b", f"source.path={tmp_path}").validate_paths()
    with pytest.raises(UserError, match="source.split.*only used by source.type=hf"):
        make_cfg(tmp_path / "c", "source.split=train")


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["source.split=validation"], ["source.name", "someone/tiny-scenes", "validation"]),
        (["source.image_column=picture"], ["source.image_column", "'picture'", "id, image, text"]),
    ],
)
def test_a_split_or_column_the_dataset_lacks_is_one_line(hub_cache, tmp_path, overrides, words, capsys):
    argv = ["--set", f"output_dir={tmp_path / 'c'}", "--set", "source.type=hf"]
    for o in ["source.name=someone/tiny-scenes", *overrides]:
        argv += ["--set", o]
    assert cosmos_latents.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for w in words:
        assert w in err, err
