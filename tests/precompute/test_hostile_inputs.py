"""Round-3 hostile cases on the precompute / cache / inspect / inference-input side (issue 27)."""

from __future__ import annotations

import json

import pytest

from precompute.sources.listing import Truncated
from precompute.sources.synthetic import SyntheticListing


def test_num_samples_cut_meets_the_barrier_on_every_rank_even_when_the_record_exists(tmp_path):
    """Rank 1 starting after rank 0 wrote num_samples.json used to skip the barrier, so it ran one collective ahead
    (into shard writing before rank 0 had made errors/)."""
    calls = {0: 0, 1: 0}

    def barrier_for(rank):
        def barrier():
            calls[rank] += 1

        return barrier

    inner = SyntheticListing(0, 10, 16)
    first = Truncated(inner, 4, tmp_path, rank=0, barrier=barrier_for(0))
    late = Truncated(inner, 4, tmp_path, rank=1, barrier=barrier_for(1))
    assert (tmp_path / Truncated.RECORD).is_file()
    assert calls == {0: 1, 1: 1}
    assert len(first) == len(late) == 4
    rerun = Truncated(inner, 4, tmp_path, rank=0, barrier=barrier_for(0))  # a rerun reads the record, still meets it
    assert len(rerun) == 4 and calls[0] == 2


class _OneProcess:  # what run_lock.hold reads of an Accelerator or PartialState
    is_main_process, num_processes = True, 1


def test_a_failed_run_leaves_no_folder_holding_only_its_lock(tmp_path):
    from theworld.core import run_lock

    out = tmp_path / "new" / "run"
    with pytest.raises(RuntimeError, match="refused"):
        with run_lock.hold(out, _OneProcess()):
            (out / "sub").mkdir()
            raise RuntimeError("refused")
    assert not (tmp_path / "new").exists()  # the folders the run created go with their lock
    with pytest.raises(RuntimeError, match="crashed"):
        with run_lock.hold(out, _OneProcess()):
            (out / "sub").mkdir()
            (out / "sub" / "written").write_text("work")
            raise RuntimeError("crashed")
    assert (out / "sub" / "written").read_text() == "work"  # what a run wrote is never deleted
    kept = tmp_path / "kept"
    kept.mkdir()
    with pytest.raises(RuntimeError):
        with run_lock.hold(kept, _OneProcess()):
            raise RuntimeError("refused")
    assert kept.is_dir() and not any(kept.iterdir())  # a folder that was there stays, without the lock file


def test_a_refused_precompute_into_a_new_folder_leaves_nothing(tmp_path, capsys, fake_vae):
    from precompute import cosmos_latents
    from tests._precompute_helpers import cli_args

    (tmp_path / "empty").mkdir()
    out = tmp_path / "out" / "cache"
    rc = cosmos_latents.main(cli_args(out, "source.type=folder", f"source.path={tmp_path / 'empty'}"))
    assert rc == 2 and "no samples found" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_shipped_demo_size_belongs_to_the_synthetic_source_only():
    from precompute.config import load
    from tests.conftest import ROOT

    shipped = ROOT / "configs" / "precompute.yaml"
    assert load(str(shipped)).source.num_samples == 4096  # the demo is unchanged
    other = load(str(shipped), ["source.type=parquet", "source.path=x.parquet"])
    assert other.source.num_samples is None  # every row, as the docs say, not the demo's 4096


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


def test_one_line_joins_a_librarys_lines():
    from theworld.core.errors import one_line

    assert (
        one_line("Couldn't deserialize thrift\nDeserializing page header failed.\n")
        == "Couldn't deserialize thrift / Deserializing page header failed."
    )


def _plan(capsys, *overrides: str) -> tuple[int, list[str]]:
    from precompute import cosmos_latents
    from tests.conftest import ROOT

    args = ["--config", str(ROOT / "configs" / "precompute.yaml"), "--plan"]
    rc = cosmos_latents.main(args + [a for o in overrides for a in ("--set", o)])
    return rc, capsys.readouterr()


@pytest.mark.parametrize("key", ["model.gemma", "model.vae"])
@pytest.mark.parametrize("text", ["not json{", "{}", "[1, 2]"])
def test_plan_with_a_broken_model_config_is_one_line(tmp_path, capsys, key, text):
    (tmp_path / "config.json").write_text(text)
    rc, out = _plan(capsys, f"{key}={tmp_path}", "source.num_samples=4", f"output_dir={tmp_path / 'c'}")
    if key == "model.vae" and text == "{}":  # diffusers' defaults fill an empty VAE config: the plan goes on
        assert rc == 0 and "latent" in out.out
        return
    assert rc == 2 and out.err.count("\n") == 1 and out.err.startswith(f"error: {key}: cannot load"), out.err


@pytest.mark.parametrize(
    "key,config,words",
    [
        ("model.vae", {"z_dim": "16"}, "no usable z_dim (got '16')"),
        ("model.vae", {"z_dim": -5}, "no usable z_dim (got -5)"),
        ("model.vae", {"z_dim": None}, "no usable z_dim (got None)"),
        ("model.vae", {"z_dim": 10**12}, "its latent would hold 64,000,000,000,000 values per sample"),
        ("model.gemma", {"mm_tokens_per_image": 0, "text_config": {"hidden_size": 8}}, "no usable mm_tokens"),
        ("model.gemma", {"mm_tokens_per_image": 10**5, "text_config": {"hidden_size": 10**5}}, "SigLIP features"),
    ],
)
def test_plan_with_unusable_sizes_in_a_model_config_is_one_line(tmp_path, capsys, key, config, words):
    (tmp_path / "config.json").write_text(json.dumps(config))
    rc, out = _plan(capsys, f"{key}={tmp_path}", "source.num_samples=4", f"output_dir={tmp_path / 'c'}")
    assert rc == 2 and out.err.count("\n") == 1 and out.err.startswith(f"error: {key}: ") and words in out.err, out.err


def test_plan_at_absurd_sizes_answers_in_integers_or_refuses(tmp_path, capsys):
    rc, out = _plan(capsys, "source.num_samples=9223372036854775807", "shard_size=1", "source.type=synthetic")
    assert rc == 0 and "entries: 9223372036854775807 in 9223372036854775807 shards of 1" in out.out
    rc, out = _plan(capsys, "image.resolution=16384")
    assert rc == 2 and "'image.resolution'" in out.err and "at most 9456" in out.err


def test_plan_says_why_no_sampled_entry_is_usable(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    for name, data in (("a.png", b"not a png"), ("b.png", b""), ("c.png", b"")):
        (src / name).write_bytes(data)
        (src / name).with_suffix(".txt").write_text("caption")
    rc, out = _plan(capsys, "source.type=folder", f"source.path={src}", "source.num_samples=null")
    assert rc == 2 and "none of the 3 sampled entries of the source is usable: " in out.err
    assert "empty file x2" in out.err and "unreadable image" in out.err, out.err


def test_llava_images_found_nowhere_say_where_they_were_looked_for_and_which_image_root_finds_them(
    tmp_path, capsys, fake_vae
):
    import json

    from precompute import cosmos_latents
    from tests._precompute_helpers import cli_args, gradient, jpeg_bytes

    root = tmp_path / "LLaVA-Pretrain"
    (root / "images" / "00000").mkdir(parents=True)
    items = []
    for i in range(3):
        (root / "images" / "00000" / f"{i:09d}.jpg").write_bytes(jpeg_bytes(gradient(30, 24)))
        items.append(
            {
                "id": f"{i:09d}",
                "image": f"00000/{i:09d}.jpg",
                "conversations": [
                    {"from": "human", "value": "<image>\nDescribe."},
                    {"from": "gpt", "value": f"caption {i}"},
                ],
            }
        )
    (root / "blip_laion_cc_sbu_558k.json").write_text(json.dumps(items))
    src = f"source.path={root / 'blip_laion_cc_sbu_558k.json'}"
    assert cosmos_latents.main(cli_args(tmp_path / "c", "source.type=llava", src, n=3)) == 2
    err = capsys.readouterr().err
    assert "all 3 inputs failed" in err and f"'00000/000000000.jpg' are looked for under {root};" in err
    assert f"set source.image_root={root / 'images'}" in err, err
    assert (
        cosmos_latents.main(cli_args(tmp_path / "c2", "source.type=llava", src, f"source.image_root={root}", n=3)) == 2
    )
    assert f"set source.image_root={root / 'images'}" in capsys.readouterr().err  # also from a wrong image_root


def test_describe_says_what_an_image_path_is_and_never_opens_a_fifo(tmp_path, capsys):
    import os

    from theworld import describe

    (tmp_path / "folder").mkdir()
    os.mkfifo(tmp_path / "fifo")
    for name, words in (
        ("folder", "a directory, not an image file"),
        ("fifo", "a FIFO, not an image file"),
        ("none.png", "no such file"),
    ):
        assert describe.main(["--model", str(tmp_path), "--image", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert err == f"error: --image {tmp_path / name}: {words}\n", err
    assert (
        describe.main(["--model", str(tmp_path), "--image", str(tmp_path / "none.png"), "--prompt", "x" * 70000]) == 2
    )
    assert "--prompt too long: 70000 characters" in capsys.readouterr().err


@pytest.mark.parametrize(
    "config,words",
    [
        (b"model: {gemma: tiny}\nx: \xff\xfe\n", "is not UTF-8 text (byte 0xff"),
        (b"[" * 5000 + b"]" * 5000, "nested too deeply"),
        (b"a: [1\n", "is not valid YAML"),
    ],
)
def test_a_model_folders_broken_config_yaml_is_one_line_in_describe_and_evaluate(tmp_path, capsys, config, words):
    from theworld import describe, evaluate
    from theworld.embedded import synthetic
    from theworld.model import stage_layout as checkpoint_layout

    folder = tmp_path / "final"
    folder.mkdir()
    (folder / checkpoint_layout.WEIGHTS).write_bytes(b"")
    (folder / checkpoint_layout.CONFIG).write_bytes(config)
    synthetic.scene(0, 0)[0].save(tmp_path / "a.png")
    (tmp_path / "items.jsonl").write_text('{"image": "a.png", "question": "q", "choices": ["a", "b"], "answer": 0}\n')
    for run in (
        lambda: describe.main(["--model", str(folder), "--image", str(tmp_path / "a.png")]),
        lambda: evaluate.main(["--model", str(folder), "--data", str(tmp_path / "items.jsonl")]),
    ):
        rc, err = run(), capsys.readouterr().err.splitlines()
        assert rc == 2 and err[-1].startswith(f"error: {folder / checkpoint_layout.CONFIG}") and words in err[-1], err


@pytest.fixture(scope="module")
def bucketed():
    from theworld.model.config import ImageConfig, ModelConfig, WorldConfig
    from theworld.model.world import TheWorld

    image = ImageConfig(resolution=96, resize="bucket")
    model, processor = TheWorld.from_config(ModelConfig(dtype="float32"), WorldConfig(), image=image)
    return model.eval(), processor, image


def _scenes_of_two_aspect_ratios(root) -> list:
    from theworld.embedded import synthetic

    paths = []
    for i, size in enumerate([(128, 64), (64, 128)]):
        img = synthetic.scene(3, i, size=64)[0].resize(size)
        paths.append(root / f"{i}.png")
        img.save(paths[-1])
    return paths


def test_a_bucketed_model_describes_images_of_any_aspect_ratio_as_it_would_one_by_one(tmp_path, bucketed):
    from theworld.model import images

    model, _, image = bucketed
    paths = _scenes_of_two_aspect_ratios(tmp_path)
    assert len({images.input_size(p, image.resolution, image.resize) for p in paths}) == 2
    together = model.generate(paths, "describe", max_new_tokens=2)
    assert together == [model.generate([p], "describe", max_new_tokens=2)[0] for p in paths]
    shuffled = model.generate(paths, "describe", max_new_tokens=2, world_images=paths[::-1])  # each the other's world
    assert shuffled[0] == model.generate(paths[:1], "describe", max_new_tokens=2, world_images=paths[1:])[0]


def test_a_bucketed_model_scores_items_of_any_aspect_ratio_batched_as_one_by_one(tmp_path, bucketed):
    from theworld.infer import benchmark_items
    from theworld.infer.scoring import Scorer

    model, processor, image = bucketed
    paths = _scenes_of_two_aspect_ratios(tmp_path)
    items = [benchmark_items.Item(f"item {i}", [p], "which?", ["red", "green"], i) for i, p in enumerate(paths)]
    scorer = Scorer(model, processor, image, items)
    batched = scorer.score([0, 1])
    alone = [scorer.score([i])[0] for i in range(2)]
    for together, one in zip(batched, alone):
        assert set(together) == {"model", "shuffled_world"}, together
        for cond in together:
            assert together[cond] == pytest.approx(one[cond], abs=1e-4)
    assert batched[0]["model"] != batched[0]["shuffled_world"]  # the partner's world: another picture, another shape


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


def test_decode_sheet_labels_draw_non_latin_captions_and_name_what_no_font_has(capsys):
    import torch

    from precompute import fonts, inspect

    pair = (torch.zeros(3, 32, 32, dtype=torch.uint8), torch.zeros(3, 32, 32, dtype=torch.uint8))
    labels = ["key-0\nкрасный квадрат", "key-1\n\ue000 private"]  # U+E000: private use, in no font's tables
    sheet = inspect._sheet([pair, pair], labels, "header")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "1 character(s) of the captions ('\\ue000')" in err, err
    font, lacks = fonts.for_text(labels)
    assert lacks == {"\ue000"}  # the Cyrillic is drawn: the chosen font has its glyphs
    assert fonts.missing(font, set("красный")) == set()
    assert sheet.size[0] > 0


def test_caption_task_jsonl_keeps_a_raw_line_separator_and_refuses_a_fifo(tmp_path):
    import json
    import os

    from theworld.core.errors import UserError
    from theworld.embedded import synthetic
    from theworld.infer import captions

    synthetic.scene(0, 0)[0].save(tmp_path / "a.png")
    line = json.dumps({"image": "a.png", "captions": ["one\u2028two"]}, ensure_ascii=False)
    (tmp_path / "caps.jsonl").write_text(line + "\n" + line + "\n")
    assert len(captions.read(tmp_path / "caps.jsonl")) == 2
    os.mkfifo(tmp_path / "fifo.jsonl")
    with pytest.raises(UserError, match="fifo.jsonl: a FIFO, not a data file"):
        captions.read(tmp_path / "fifo.jsonl")
