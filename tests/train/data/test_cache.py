"""train/data/cache.py: the datasets a run reads (flip augmentation of latents and captions, held-out items carrying
their partner's world)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from contextlib import closing
from pathlib import Path

import pytest
import torch

from tests._precompute_helpers import flip_byte, rewrite_manifest, sidecar_json, strip_checksums
from tests.conftest import ROOT, base_args, only_line
from tests.theworld.cache_format.conftest import as_format_3
from theworld import cache_format as cf
from theworld.core.errors import CacheDamaged, UserError


def test_flipped_samples_get_the_flipped_latents_and_swapped_text(cache, tmp_path):
    """A batch mixing flipped and unflipped samples: each row holds the cache's latents for its own flip decision."""
    from theworld.core.config import load_config
    from train import components
    from train.config import TrainConfig
    from train.data import batches, flip, loader, order
    from train.data import cache as data

    cfg = load_config(
        TrainConfig,
        None,
        [a for a in base_args(cache, tmp_path / "run") if a != "--set"]
        + ["train.loader.flip=true", "train.micro_batch_size=16"],
    )
    reader, plan = data.open_cache(cfg)
    c = components.build(cfg, components.make_accelerator(cfg), 1)
    ctx = loader.DataContext.build(cfg, reader, plan, c.processor)
    ds = ctx.dataset(cfg, ctx.train_indices[:16], epoch=3)
    batch = batches.Collate(ctx.formatter)([ds[i] for i in range(16)]).to("cpu")
    flips = [order.flip_of(cfg.seed, 3, i) for i in ds.indices]
    assert any(flips) and not all(flips)
    for row, (index, flipped) in enumerate(zip(ds.indices, flips)):
        s = reader[index]
        mean, logvar = (s.flip_mean, s.flip_logvar) if flipped else (s.mean, s.logvar)
        assert torch.equal(batch.latent_mean[row], mean) and torch.equal(batch.latent_logvar[row], logvar)
        caption = flip.swap_left_right(s.caption) if flipped else s.caption
        prompt = flip.swap_left_right(s.prompt) if flipped else s.prompt
        expected = ctx.formatter.encode(prompt, caption).input_ids
        assert batch.input_ids[row, : len(expected)].tolist() == expected


def test_eval_items_carry_the_world_of_the_next_held_out_sample(cache):
    import torch

    from theworld import cache_format as cf
    from theworld.cache_format import held_out
    from theworld.core.config import load_config
    from train.config import TrainConfig
    from train.data import batches, loader
    from train.data import cache as data

    cfg = load_config(
        TrainConfig,
        None,
        [
            f"cache_dir={cache}",
            "model.dtype=float32",
            "train.eval.samples=5",
            "train.micro_batch_size=2",
            "train.global_batch_size=16",
        ],
    )
    reader, plan = data.open_cache(cfg)
    _, held = held_out.split(reader, 5)

    class Fmt:  # the dataset only keeps it for Collate
        pass

    pixels = lambda images, return_tensors: {"pixel_values": torch.zeros(1, 3, 4, 4)}
    ds = loader.CacheDataset(reader, held, Fmt(), plan, 64, "crop", pixels, flip=False, partner=True)
    for pos in range(5):
        item = ds[pos]
        nxt = held[(pos + 1) % 5]
        assert item[batches.PARTNER + cf.LATENT] == reader.raw(nxt)[cf.LATENT] != item[cf.LATENT]


@pytest.mark.parametrize(
    "damage,words",
    [
        ("truncate", ["shard-000001.tar", "bytes on disk", "delete"]),
        ("delete", ["shard-000001.tar", "missing", "delete"]),
        ("swap_with_sidecar", ["shard-000001.tar", "what manifest.json lists for shard-000000.tar", "copied over it"]),
        ("swap_pairs", ["shard-000000.tar", "shard-000001.tar holds this shard's: the two were swapped"]),
        ("edit_sidecar", ["shard-000001.tar", "(count 1 vs ", "sidecar vs manifest", "delete"]),
        ("manifest_lists_fewer", ["shard-000002.tar", "manifest.json lists 2 shards", "rerun the precompute"]),
        ("duplicate_keys", ["occurs twice", "shard-000000.tar", "shard-000001.tar"]),
        ("offset_outside", ["outside the tar", "shard-000002.tar"]),
    ],
)
def test_start_of_run_checks_catch_damage_without_reading_data(small_cache, damage, words):
    tar1 = cf.tar_path(small_cache, 1)
    if damage not in ("truncate", "delete"):  # sidecars and the manifest's shard list: what a format-3 cache reads
        as_format_3(small_cache)
    manifest = json.loads((small_cache / cf.MANIFEST).read_text())
    if damage == "truncate":
        tar1.write_bytes(tar1.read_bytes()[:3000])
    elif damage == "delete":
        tar1.unlink()
    elif damage == "swap_with_sidecar":  # shard 1 replaced by a copy of shard 0, sidecar and all
        shutil.copy(cf.tar_path(small_cache, 0), tar1)
        shutil.copy(cf.sidecar_path(small_cache, 0), cf.sidecar_path(small_cache, 1))
    elif damage == "swap_pairs":  # shards 0 and 1 trade places, each with its own sidecar
        for suffix in (cf.tar_path, cf.sidecar_path):
            a, b = suffix(small_cache, 0), suffix(small_cache, 1)
            a.rename(a.with_name("x"))
            b.rename(a)
            a.with_name("x").rename(b)
    elif damage == "edit_sidecar":
        side = sidecar_json(small_cache, 1)
        side["count"] = 1
        cf.atomic_write_json(cf.sidecar_path(small_cache, 1), side)
    elif damage == "manifest_lists_fewer":
        manifest["shards"] = manifest["shards"][:2]
        manifest["num_samples"] = sum(s["num_samples"] for s in manifest["shards"])
        cf.atomic_write_json(small_cache / cf.MANIFEST, manifest)
    elif damage == "duplicate_keys":  # the copy and a manifest rewritten from the sidecars: only the keys tell
        shutil.copy(cf.tar_path(small_cache, 0), tar1)
        shutil.copy(cf.sidecar_path(small_cache, 0), cf.sidecar_path(small_cache, 1))
        manifest["shards"][1] = {**manifest["shards"][0], "path": "shards/shard-000001.tar"}
        cf.atomic_write_json(small_cache / cf.MANIFEST, manifest)
    elif damage == "offset_outside":
        side = sidecar_json(small_cache, 2)
        side["samples"][-1]["members"][cf.LATENT][0] = side["bytes"]
        cf.atomic_write_json(cf.sidecar_path(small_cache, 2), side)
    with pytest.raises(CacheDamaged) as e, closing(cf.CacheReader(small_cache)) as reader:
        reader.check_consistency()
    assert all(w in str(e.value) for w in words), str(e.value)


TRAIN_CACHE = ["source.num_samples=48", "shard_size=16", "batch_size=16", "num_workers=0", "cache.siglip=false"]


@pytest.fixture(scope="module")
def train_cache(tmp_path_factory):
    from precompute.config import load as load_pre
    from precompute.pipeline import run

    out = tmp_path_factory.mktemp("integrity") / "cache"
    run(
        load_pre(
            str(ROOT / "configs" / "precompute.yaml"),
            [f"output_dir={out}", *TRAIN_CACHE],
        )
    )
    return out


def _train_args(cache: Path, out: Path) -> list[str]:
    return base_args(cache, out, steps=2, **{"train.loader.num_workers": 1, "train.eval.captions": 0})  # none checked


def _train(cache: Path, out: Path) -> subprocess.CompletedProcess:
    """A run that must stop: as a process, for its exit code and a teardown that aborts nothing ("terminate")."""
    from tests.conftest import ENV

    return subprocess.run(
        [sys.executable, "-m", "train.loop", *_train_args(cache, out)],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _stderr_line(res: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert res.returncode == 2 and len(lines) == 1, res.stderr[-3000:]
    assert "Traceback" not in res.stderr and "terminate" not in res.stderr, res.stderr[-3000:]
    return lines[0]


@pytest.mark.slow
def test_damaged_latents_stop_training_with_one_line_and_the_documented_repair_rebuilds_that_shard(
    train_cache, tmp_path, capsys
):
    from precompute import cosmos_latents
    from train import loop as train_loop

    cache = tmp_path / "cache"
    shutil.copytree(train_cache, cache)
    keys = [s["key"] for i in range(3) for s in sidecar_json(cache, i)["samples"]]
    damaged = [flip_byte(cache, 1, j, cf.LATENT, at=300) for j in range(16)]  # whichever the first batch reads
    line = _stderr_line(_train(cache, tmp_path / "run"))
    assert "shard-000001.tar" in line and any(k in line for k in damaged) and "crc32" in line, line
    repair = f"delete {cf.sidecar_path(cache, 1)}"
    assert repair in line
    cf.sidecar_path(cache, 1).unlink()  # the repair the line names
    pre = [a for kv in [f"output_dir={cache}", *TRAIN_CACHE] for a in ("--set", kv)]
    assert cosmos_latents.main(["--config", str(ROOT / "configs" / "precompute.yaml"), *pre]) == 0
    assert "this run encoded 16 images" in capsys.readouterr().out  # that shard alone
    assert cf.tar_path(cache, 1).read_bytes() == cf.tar_path(train_cache, 1).read_bytes()
    assert [s["key"] for i in range(3) for s in sidecar_json(cache, i)["samples"]] == keys
    assert train_loop.main(_train_args(cache, tmp_path / "run")) == 0


@pytest.mark.slow
def test_an_old_cache_trains_with_a_note_and_its_undecodable_bytes_are_one_line(train_cache, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(train_cache, cache)
    strip_checksums(cache)
    for j in range(16):  # a latent's safetensors header broken: only decoding shows it
        flip_byte(cache, 0, j, cf.LATENT, at=10)
    res = _train(cache, tmp_path / "run")
    line = _stderr_line(res)
    assert "shard-000000.tar" in line and "does not decode" in line, line
    assert "no per-member checksums" in res.stderr


def test_a_cache_file_changed_before_the_run_is_refused_before_any_model_loads(train_cache, tmp_path, capsys):
    from tests.conftest import base_args
    from train.loop import main

    cache = tmp_path / "cache"
    shutil.copytree(train_cache, cache)
    tar = cf.tar_path(cache, 2)
    tar.write_bytes(tar.read_bytes()[:-1024])
    assert main(base_args(cache, tmp_path / "run")) == 2
    only_line(capsys, "shard-000002.tar", "delete")
    (cache / cf.MANIFEST).write_text("[]")
    assert main(base_args(cache, tmp_path / "run")) == 2
    only_line(capsys, "manifest.json")


def _old_shard(cache: Path, shard: int, sample: int, caption: str | None = None, prompt: str | None = None) -> str:
    """Rewrite a shard as precompute did before it refused control strings: sample `sample` gets `caption` and/or
    `prompt`, and the sidecar records no text rule. Returns the sample's key."""
    reader = cf.CacheReader(cache)
    samples = [(reader.key(i), reader.raw(i)) for i in reader.samples_in([shard]).tolist()]
    reader.close()
    members = samples[sample][1]
    if caption is not None:
        members[cf.CAPTION] = caption.encode()
    if prompt is not None:
        members[cf.META] = json.dumps({**json.loads(members[cf.META]), "prompt": prompt}).encode()
    cf.write_shard(cache, shard, samples)
    rewrite_manifest(cache)
    return samples[sample][0]


def test_an_old_cache_with_a_control_string_caption_is_refused_before_any_model_loads(
    small_cache, tmp_path, capsys, monkeypatch
):
    from tests.conftest import base_args
    from theworld.model.control_text import TEXT_RULE
    from train.data import cache as data
    from train.loop import main

    assert {sidecar_json(small_cache, i)["text_rule"] for i in range(3)} == {TEXT_RULE}  # precompute applied the rule
    key = _old_shard(small_cache, 1, 2, caption="a red ball <end_of_turn> on grass")
    assert "text_rule" not in sidecar_json(small_cache, 1)
    reads = []
    raw = cf.CacheReader._raw  # what every read of a sample's bytes goes through (raw, text)
    monkeypatch.setattr(cf.CacheReader, "_raw", lambda self, i, members: (reads.append(i), raw(self, i, members))[1])
    monkeypatch.setattr("theworld.model.TheWorld.__init__", lambda *a, **k: pytest.fail("a model was built"))
    assert main(base_args(small_cache, tmp_path / "run", **{"train.eval.samples": 2})) == 2
    only_line(
        capsys,
        "1 sample(s)",
        "shard-000001.tar",
        key,
        "caption holds the Gemma control string '<end_of_turn>'",
        f"delete {cf.sidecar_path(small_cache, 1).name}",
    )
    assert sorted(reads) == cf.CacheReader(small_cache).samples_in([1]).tolist()  # only the unmarked shard is read
    # the prompt (in the json member) follows the same rule; a clean unmarked shard passes
    _old_shard(small_cache, 1, 2, caption="a red ball on grass")
    data.check_texts(cf.CacheReader(small_cache))
    _old_shard(small_cache, 0, 1, prompt="What is this? <start_of_image>")
    with pytest.raises(UserError, match=r"shard-000000.tar.*prompt holds the Gemma control string '<start_of_image>'"):
        data.check_texts(cf.CacheReader(small_cache))
