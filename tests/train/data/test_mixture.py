"""Weighted mixtures of caches (`data: [{cache, weight}]`): the per-epoch draw (deterministic, by weight, repeats and
subsamples), refusals, and training on a mixture (start line, exact resume, 1 process == 2 processes)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import ROOT, base_args, one_error_line, run2, train_inproc
from theworld.core.config import load_config
from theworld.core.errors import UserError
from train.config import TrainConfig
from train.data.mixture import Draw, largest_remainder
from train.data.order import epoch_batches


def fake_mixture(sizes: list[int]) -> tuple[SimpleNamespace, np.ndarray]:
    """What Draw.build reads of a MixedReader (cache_of, readers), and every sample as a training sample."""
    cache_of = np.repeat(np.arange(len(sizes)), sizes).astype(np.int32)
    return SimpleNamespace(cache_of=cache_of, readers=[None] * len(sizes)), np.arange(len(cache_of))


def test_largest_remainder_is_proportional_and_adds_up():
    assert largest_remainder(np.array([3.0, 1.0]), 80).tolist() == [60, 20]
    assert largest_remainder(np.array([1.0, 1.0, 1.0]), 10).tolist() == [4, 3, 3]
    assert largest_remainder(np.array([5, 3]), 0).tolist() == [0, 0]


def test_the_draw_follows_the_weights_repeats_a_small_cache_and_subsamples_a_large_one():
    reader, train = fake_mixture([30, 50])  # cache 0: samples 0-29, cache 1: 30-79
    draw = Draw.build(reader, train, [3.0, 1.0], np.zeros(80, dtype=np.int32))
    assert draw.cache_quotas.tolist() == [60, 20]
    for epoch in range(3):
        got = draw.epoch(7, epoch)
        assert len(got) == 80 and np.array_equal(got, draw.epoch(7, epoch))  # deterministic
        counts = np.bincount(got, minlength=80)
        assert (counts[:30] == 2).all()  # 60 of 30: each sample twice
        assert counts[30:].sum() == 20 and counts[30:].max() == 1  # 20 of 50, no sample twice
    assert not np.array_equal(draw.epoch(7, 0), draw.epoch(7, 1))
    assert not np.array_equal(draw.epoch(7, 0), draw.epoch(8, 0))
    # over many epochs the subsample reaches every sample of the large cache
    seen = np.unique(np.concatenate([draw.epoch(7, e) for e in range(20)]))
    assert np.array_equal(seen, np.arange(80))


def test_the_draw_keeps_each_caches_shapes_in_proportion_and_the_same_every_epoch():
    reader, train = fake_mixture([40, 40])
    buckets = np.array([0] * 30 + [1] * 10 + [0] * 20 + [1] * 20, dtype=np.int32)
    draw = Draw.build(reader, train, [1.0, 3.0], buckets)
    assert draw.cache_quotas.tolist() == [20, 60]
    assert draw.bucket_sizes(buckets).tolist() == [15 + 30, 5 + 30]
    for epoch in range(3):
        samples = draw.epoch(0, epoch)
        assert np.bincount(buckets[samples]).tolist() == [45, 35]
        batches = epoch_batches(samples, 0, epoch, 8, buckets[samples])
        assert len(batches) == 45 // 8 + 35 // 8 and all(len(set(buckets[b])) == 1 for b in batches)


def test_the_mixtures_batches_mix_the_caches_by_weight_within_sampling_error():
    """Global batches of 16 drawn 3:1 from two caches: each cache's fraction of the samples over the first batches
    of an epoch is near its share (binomial sampling error), and a process's slice does not change it."""
    from train.data.order import rank_indices

    reader, train = fake_mixture([400, 400])
    draw = Draw.build(reader, train, [3.0, 1.0], np.zeros(800, dtype=np.int32))
    samples = draw.epoch(0, 0)
    first = rank_indices(samples, 0, 0, 16, 0, 1)[:320]  # 20 global batches
    share = float(np.mean(reader.cache_of[first] == 0))
    assert abs(share - 0.75) < 4 * np.sqrt(0.75 * 0.25 / 320)
    two = np.concatenate([rank_indices(samples, 0, 0, 16, r, 2).reshape(-1, 8) for r in range(2)], axis=1)
    assert np.array_equal(two.reshape(-1), rank_indices(samples, 0, 0, 16, 0, 1))


# ----------------------------------------------------------------------------------------------------------------------
# Config refusals


@pytest.mark.parametrize(
    "sets,words",
    [
        (["cache_dir=a", "data=[{cache: b}]"], ["'cache_dir' and 'data' are both set"]),
        (["data=[{cache: b, weight: 0}]"], ["data[].weight", "must be positive"]),
        (["data=[{cache: b}, {cache: b, weight: 2}]"], ["listed twice"]),
        (["data=[{cache: b, weights: 2}]"], ["unknown config key 'data[0].weights'"]),
        (["data=[{cache: b, weight: sample}]"], ["data[].weight", "must be positive, or 'samples'", "'sample'"]),
        (["data=[{cache: b, weight: samples}, {cache: c, weight: 2}]"], ["to every cache or to none", "cache c"]),
        (
            ["data=[{cache: b, weight: 1}, {cache: c}]", "storage.shuffle_window=2", "storage.node_groups=2"],
            ["storage.node_groups", "a 'data' mixture by weight", "give every cache weight samples"],
        ),
    ],
)
def test_bad_data_entries_are_refused_naming_the_key(sets, words):
    with pytest.raises(UserError) as e:
        load_config(TrainConfig, None, sets)
    assert all(w in str(e.value) for w in words), str(e.value)


# ----------------------------------------------------------------------------------------------------------------------
# A dataset in parts: every weight `samples`


class _Part:
    """What MixedReader reads of a CacheReader, at any size: its shards' first samples and one latent shape (a lazily
    read cache's broadcast); `stage` records what it is asked to download."""

    remote, cache_dir, manifest = "bucket", "part", {}

    def __init__(self, shards: int, per_shard: int, side: int = 8):
        self.shard_starts = np.arange(shards + 1, dtype=np.int64) * per_shard
        self.latent_hw = np.broadcast_to(np.array([[side, side]], dtype=np.int32), (shards * per_shard, 2))
        self.staged: list[tuple[int, bool]] = []

    def __len__(self) -> int:
        return int(self.shard_starts[-1])

    def stage(self, shard: int, ahead: bool = False) -> None:
        self.staged.append((shard, ahead))


def test_parts_of_datacomp_size_read_as_one_hold_no_array_over_every_sample():
    """Eight parts of 171M samples (DataComp-1B's plan): the mixture's reader, its one-shape buckets and a
    process's share of a windowed epoch hold arrays over the shards and the share, not over the 1.4B samples; its
    shards are numbered across the parts, and staging one stages that part's own shard."""
    from train.data.mixture import MixedReader
    from train.data.order import bucket_ids, several_shapes, windowed_rank_indices

    parts = [_Part(167_000, 1024) for _ in range(8)]
    reader = MixedReader(parts)
    n = 8 * 167_000 * 1024
    assert len(reader) == n and len(reader.shard_starts) == 8 * 167_000 + 1
    held = sum(a.nbytes for a in vars(reader).values() if isinstance(a, np.ndarray))
    assert held < 8 * 167_000 * 8 * 2  # two arrays over the shards
    assert not several_shapes(bucket_ids(reader)) and reader.latent_hw.shape == (n, 2)
    assert reader.cache_of[[0, 171_007_999, 171_008_000, n - 1]].tolist() == [0, 0, 1, 7]
    assert reader.cache_of[171_008_000 * 3] == 3
    reader.stage(167_000 * 2 + 5, ahead=True)
    assert parts[2].staged == [(5, True)] and not parts[0].staged
    last = (n - 2) // 512  # the epoch's global batches (two samples held out)
    mine = windowed_rank_indices(reader.shard_starts, np.array([3, n - 1]), 0, 0, 512, 5, 64, last - 10, 64)
    assert len(mine) == 80 and ((mine >= 0) & (mine < n) & (mine != 3) & (mine != n - 1)).all()


def test_a_mixtures_shards_bytes_are_found_in_their_own_caches():
    """order.shard_bytes (what stage_first weighs against the shard cache): shards numbered across the caches."""
    from train.data.mixture import MixedReader
    from train.data.order import shard_bytes

    parts = [_Part(2, 3), _Part(0, 3), _Part(3, 3)]
    for part, sizes in zip(parts, ([10, 20], [], [300, 400, 500])):
        part.shard_table = SimpleNamespace(bytes=np.array(sizes, dtype=np.int64))
    reader = MixedReader(parts)
    assert shard_bytes(reader, [0, 1, 2, 3, 4]) == 10 + 20 + 300 + 400 + 500
    assert shard_bytes(reader, [4, 1]) == 520 and shard_bytes(reader, []) == 0
    assert shard_bytes(parts[2], [2, 0]) == 800  # one cache: its own numbers


def test_a_mixtures_text_bytes_index_like_their_concatenation_without_a_copy():
    """What group_by_length sorts a lazily read mixture by: the parts' own arrays (a view of each node's shard table),
    indexed across them."""
    from train.data.mixture import MixedReader

    class Texts(_Part):
        def __init__(self, text_bytes: np.ndarray):
            super().__init__(len(text_bytes), 1)
            self.own = text_bytes

        def text_bytes(self) -> np.ndarray:
            return self.own

    rng = np.random.default_rng(0)
    own = [rng.integers(0, 60_000, n).astype(np.uint16) for n in (5, 0, 7, 3)]
    reader = MixedReader([Texts(a) for a in own])
    lengths, joined = reader.text_bytes(), np.concatenate(own)
    at = rng.integers(0, 15, 40)
    assert lengths[at].tolist() == joined[at].tolist() and lengths[at].dtype == np.uint16
    assert lengths[7] == joined[7] and lengths.shape == (15,) and len(lengths) == 15
    assert all(a is b for a, b in zip(lengths.arrays, own))  # held, not copied


def test_parts_of_other_latent_shapes_read_as_one_keep_each_samples_shape():
    from train.data.mixture import MixedReader
    from train.data.order import bucket_ids

    reader = MixedReader([_Part(2, 3), _Part(0, 3, side=4), _Part(1, 3, side=16)])
    assert reader.latent_hw[:, 0].tolist() == [8] * 6 + [16] * 3
    assert bucket_ids(reader).tolist() == [0] * 6 + [1] * 3
    assert MixedReader([_Part(2, 3), _Part(0, 3, side=4)]).latent_hw.strides[0] == 0  # an empty part has no shape


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """A dataset precomputed in two parts, in shards of 4 samples."""
    root = tmp_path_factory.mktemp("parts")
    return _cache(root, "p0", 24, "seed=1", "shard_size=4"), _cache(root, "p1", 20, "seed=2", "shard_size=4")


def test_parts_read_as_one_give_every_training_sample_once_in_one_caches_windowed_order(parts):
    """Weight `samples` on every part: no draw; the held-out split is one cache's; each epoch is every training
    sample once (none held out), in the windowed order's definition over the parts' shards one after another, the
    same on 1 and 2 processes."""
    from train.data.cache import mixture_draw, open_cache, split_data
    from train.data.loader import _rank_indices
    from train.data.order import bucket_ids, rank_indices, shards_of

    data = ", ".join(f"{{cache: {p}, weight: samples}}" for p in parts)
    cfg = load_config(
        TrainConfig,
        None,
        [f"data=[{data}]", "storage.shuffle_window=2", "train.global_batch_size=4", "train.eval.samples=4"]
        + ["image.resolution=32", "model.dtype=float32"],
    )
    reader, _ = open_cache(cfg)
    train, held = split_data(cfg, reader)
    assert mixture_draw(cfg, reader, train) is None and len(train) == 40 and len(held) == 4
    # held out of the dataset as one cache of its 44 samples would be: the 4 keys of smallest sha256 among all
    keys = sorted((reader.key(i) for i in range(len(reader))), key=lambda k: hashlib.sha256(k.encode()).digest())
    assert sorted(reader.key(int(i)) for i in held) == sorted(keys[:4])
    ctx = SimpleNamespace(reader=reader, train_indices=train, eval_indices=held, draw=None, groups=None)
    ctx.buckets = bucket_ids(reader)
    for epoch in range(2):
        one = _rank_indices(cfg, ctx, 0, 1, epoch, 0)
        assert sorted(one.tolist()) == np.asarray(train).tolist()  # each training sample once, no held-out one
        every = np.asarray(train)
        want = rank_indices(every, cfg.seed, epoch, 4, 0, 1, shards=shards_of(reader, every), window=2)
        assert np.array_equal(one, want)
        two = [_rank_indices(cfg, ctx, r, 2, epoch, 0).reshape(-1, 2) for r in range(2)]
        assert np.array_equal(np.concatenate(two, axis=1).reshape(-1), one)
        assert np.array_equal(_rank_indices(cfg, ctx, 0, 1, epoch, 3), one[12:])  # resumed at batch 3


def test_parts_read_lazily_as_one_group_by_length_on_their_own_text_bytes(parts, monkeypatch):
    """group_by_length on parts read a part at a time: the lengths are each part's shard-table text_bytes, indexed
    across the parts without a copy, and an epoch still gives every training sample once."""
    from transformers import AutoProcessor

    from theworld.cache_format import sample_index
    from theworld.model.encoders import resolve_gemma
    from train.data.cache import open_cache
    from train.data.loader import DataContext, _rank_indices
    from train.data.mixture import Concatenated

    monkeypatch.setattr(sample_index, "LAZY_BYTES", 0)
    data = ", ".join(f"{{cache: {p}, weight: samples}}" for p in parts)
    sets = [f"data=[{data}]", "storage.shuffle_window=2", "train.global_batch_size=4", "train.eval.samples=4"]
    sets += ["image.resolution=32", "model.dtype=float32", "model.gemma=tiny", "train.loader.group_by_length=true"]
    cfg = load_config(TrainConfig, None, sets)
    reader, inputs = open_cache(cfg)
    assert reader.lazy
    ctx = DataContext.build(cfg, reader, inputs, AutoProcessor.from_pretrained(resolve_gemma("tiny")))
    ctx.check_first()
    lengths = ctx.groups.lengths
    assert isinstance(lengths, Concatenated)
    joined = np.concatenate([r.text_bytes() for r in reader.readers])
    assert lengths[np.arange(len(reader))].tolist() == joined.tolist() and joined.min() > 0
    one = _rank_indices(cfg, ctx, 0, 1, 0, 0)
    assert sorted(one.tolist()) == np.asarray(ctx.train_indices).tolist()


# ----------------------------------------------------------------------------------------------------------------------
# Training on a mixture


def _cache(root: Path, name: str, n: int, *extra: str) -> Path:
    from precompute.config import load as load_pre
    from precompute.pipeline import run

    out = root / name
    run(
        load_pre(
            str(ROOT / "configs" / "precompute.yaml"),
            [
                f"output_dir={out}",
                f"source.num_samples={n}",
                f"shard_size={n}",
                "batch_size=16",
                "num_workers=0",
                "cache.siglip=false",
                "image.resolution=32",
                *extra,
            ],
        )
    )
    return out


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    return _cache(root, "a", 24, "seed=1"), _cache(root, "b", 40, "seed=2")


def mix_args(caches, out: Path, steps: int, **extra) -> list[str]:
    a, b = caches
    sets = {
        "data": f"[{{cache: {a}, weight: 3}}, {{cache: {b}, weight: 1}}]",
        "output_dir": out,
        "model.dtype": "float32",
        "image.resolution": 32,
        "train.max_steps": steps,
        "train.global_batch_size": 8,
        "train.micro_batch_size": 4,
        "train.eval.samples": 4,
        "train.loader.num_workers": 0,
        "trackers": "[]",
        "train.logging.every": 1,
        "train.checkpoint.every": 100,
        "train.eval.every": 0,
        "train.lr_schedule.warmup_steps": 1,
        **extra,
    }
    return [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "final" / "trainable.safetensors"))


def test_a_mixture_trains_prints_its_shares_and_resumes_exactly(caches, tmp_path, capsys):
    from train.loop import main

    assert main(mix_args(caches, tmp_path / "whole", 4)) == 0
    printed = capsys.readouterr()
    # 20 + 36 training samples (4 held out from each), 56 per epoch: 42 from a (3/4), 14 from b
    line = next(x for x in (printed.out + printed.err).splitlines() if x.startswith("mixture per epoch"))
    assert f"{caches[0]} 20 samples, share 75.0%, 2.10 epochs" in line
    assert f"{caches[1]} 36 samples, share 25.0%, 0.39 epochs" in line
    assert "7 steps/epoch" in printed.out + printed.err
    assert main(mix_args(caches, tmp_path / "parts", 2, **{"train.checkpoint.every": 2})) == 0
    assert main(mix_args(caches, tmp_path / "parts", 4, **{"train.checkpoint.every": 2})) == 0
    whole, parts = _weights(tmp_path / "whole"), _weights(tmp_path / "parts")
    assert whole.keys() == parts.keys() and all(torch.equal(whole[k], parts[k]) for k in whole)


def _parts_args(parts, out: Path, steps: int, **extra) -> list[str]:
    data = ", ".join(f"{{cache: {p}, weight: samples}}" for p in parts)
    grouped = {"storage.shuffle_window": 2, "storage.node_groups": 2, **extra}
    return mix_args(parts, out, steps, **{"data": f"[{data}]", **grouped})


def test_parts_read_as_one_train_in_node_groups_say_so_and_resume_exactly(parts, tmp_path, capsys):
    """40 training samples (4 held out of the two parts together) in 11 shards, in node groups of the parts' shards
    together; step 5 is in the second epoch (the resumed run's first steps have the whole run's learning rates:
    warm-up ends at step 2 whatever train.max_steps)."""
    from train.loop import main

    assert main(_parts_args(parts, tmp_path / "whole", 5)) == 0
    printed = capsys.readouterr()
    out = printed.out + printed.err
    line = next(x for x in out.splitlines() if x.startswith("mixture per epoch"))
    assert line == (
        f"mixture per epoch (weight samples): every training sample once; {parts[0]} 21 samples; {parts[1]} 19 samples"
    )
    # each group's 4 samples of a batch from its own 5 or 6 shards: the 5 smallest hold 16 to 19 training samples
    assert "40 train / 4 eval samples, 4 steps/epoch" in out
    assert main(_parts_args(parts, tmp_path / "parts", 2, **{"train.checkpoint.every": 2})) == 0
    assert main(_parts_args(parts, tmp_path / "parts", 5, **{"train.checkpoint.every": 2})) == 0
    whole, resumed = _weights(tmp_path / "whole"), _weights(tmp_path / "parts")
    assert whole.keys() == resumed.keys() and all(torch.equal(whole[k], resumed[k]) for k in whole)


def test_of_a_mixtures_caches_opened_at_once_the_first_that_fails_is_named(caches, tmp_path, capsys):
    from train.loop import main

    data = f"[{{cache: {caches[0]}}}, {{cache: {tmp_path / 'none1'}}}, {{cache: {tmp_path / 'none2'}}}]"
    assert main(mix_args(caches, tmp_path / "run", 1, data=data)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(tmp_path / "none1") in err[0] and "none2" not in err[0], err


def test_caches_of_different_world_layouts_or_inputs_are_refused_naming_both(caches, tmp_path, capsys):
    from train.loop import main

    for name, setting, words in (
        ("mean", "cache.latents=mean", "cache.latents posterior vs mean"),
        ("large", "image.resolution=64", "image.resolution 32 vs 64"),
        ("siglip", "cache.siglip=true", "give different inputs"),
    ):
        other = _cache(tmp_path, name, 12, setting)
        capsys.readouterr()
        assert main(mix_args((caches[0], other), tmp_path / "run", 1)) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and str(caches[0]) in err[0] and str(other) in err[0] and words in err[0], err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_mixture_on_two_processes_equals_one(caches, tmp_path):
    from train.loop import main

    assert main(mix_args(caches, tmp_path / "one", 3)) == 0
    two = run2(mix_args(caches, tmp_path / "two", 3))
    assert two.returncode == 0, two.stderr[-3000:]
    w1, w2 = _weights(tmp_path / "one"), _weights(tmp_path / "two")
    for k in [k for k in w1 if not k.endswith("k_proj.bias")]:  # see test_train's 1 vs 2 processes
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-5, atol=1e-5)
    assert _losses(tmp_path / "one") == pytest.approx(_losses(tmp_path / "two"), rel=1e-5)


def _losses(run: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]


@pytest.mark.slow
def test_parts_read_as_one_in_node_groups_on_two_processes_equal_one(parts, tmp_path):
    """Across an epoch's end (4 steps an epoch)."""
    from train.loop import main

    assert main(_parts_args(parts, tmp_path / "one", 5)) == 0
    two = run2(_parts_args(parts, tmp_path / "two", 5))
    assert two.returncode == 0, two.stderr[-3000:]
    assert _losses(tmp_path / "one") == pytest.approx(_losses(tmp_path / "two"), rel=1e-5)


def _without(args: list[str], key: str) -> list[str]:
    """base_args' --set pairs but the one of `key`."""
    pairs = [(f, v) for f, v in zip(args[::2], args[1::2]) if not v.startswith(key + "=")]
    return [x for pair in pairs for x in pair]


def test_a_weight_that_rounds_a_caches_quota_to_zero_is_one_line(trained_run, tmp_path, capsys):
    other = tmp_path / "copy"
    shutil.copytree(trained_run["cache"], other)
    data = f"[{{cache: {trained_run['cache']}, weight: 1}}, {{cache: {other}, weight: 1000}}]"
    args = _without(base_args(trained_run["cache"], tmp_path / "out", steps=1), "cache_dir")
    assert train_inproc(args + ["--set", f"data={data}"]) == 2
    one_error_line(capsys, "config key 'data'", str(trained_run["cache"]), "none of the", "weight of at least")
