"""The dataset and loaders over a cache: flipped samples read their flipped latents, each process gets its share of
a step's batch and of the held-out split (one latent shape per eval batch, each sample with a partner's world),
read-ahead stages each next shard once, and max_length's start line counts what it cuts. The start-of-run text passes
(train.loader.max_length's truncation report, train.loader.group_by_length's lengths) read every sample's text of a
cache held whole, and none of a large one (read a part at a time: theworld/cache_format/sample_index.py), whose
lengths come from its shard table and whose report reads a seeded draw of its training samples."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import base_args
from theworld import cache_format as cf
from theworld.cache_format import sample_index
from theworld.cache_format.storage import NoRoomAhead
from theworld.model.inputs import PARTNER
from train.data import loader
from train.data.order import flip_of


@pytest.fixture(scope="module")
def ctx_cfg(tmp_path_factory):
    """12 samples (shards of 4, 32 px, fake VAE, flipped latents kept), the run's config and its DataContext."""
    from transformers import AutoProcessor

    from tests._rooms_helpers import fake_vae_cache
    from tests.conftest import train_config
    from theworld.model import encoders
    from train.data import cache as data

    out = fake_vae_cache(tmp_path_factory.mktemp("loader") / "cache", "cache.flip=true", "cache.siglip=false")
    cfg = train_config(
        f"cache_dir={out}",
        "image.resolution=32",
        "model.dtype=float32",
        "train.eval.samples=4",
        "train.global_batch_size=4",
        "train.micro_batch_size=2",
        "train.loader.num_workers=0",
        "train.loader.flip=true",
    )
    reader, inputs = data.open_cache(cfg)
    processor = AutoProcessor.from_pretrained(encoders.resolve_gemma("tiny"))
    return loader.DataContext.build(cfg, reader, inputs, processor), cfg


def test_a_flipped_sample_reads_its_flipped_latent(ctx_cfg):
    ctx, cfg = ctx_cfg
    ds = ctx.dataset(cfg, ctx.train_indices, epoch=0)
    flips = [flip_of(cfg.seed, 0, int(i)) for i in ctx.train_indices]
    assert any(flips) and not all(flips)
    for pos, index in enumerate(ctx.train_indices):
        raw = ctx.reader.raw(int(index))
        want = raw[cf.LATENT_FLIP] if flips[pos] else raw[cf.LATENT]
        assert ds[pos][cf.LATENT] == want
    unflipped = ctx.dataset(cfg, ctx.train_indices, epoch=0, flip=False)
    assert all(unflipped[p][cf.LATENT] == ctx.reader.raw(int(i))[cf.LATENT] for p, i in enumerate(ctx.train_indices))


def test_each_process_gets_its_share_of_each_step_from_the_start_step(ctx_cfg):
    ctx, cfg = ctx_cfg
    assert len(ctx.train_indices) == 8 and len(ctx.eval_indices) == 4
    shares = [loader.build_train_loader(cfg, ctx, rank, 2, epoch=0).dataset.indices for rank in (0, 1)]
    assert all(len(s) == 4 for s in shares)  # 2 steps of 4: 2 samples per step on each of 2 processes
    assert sorted(np.concatenate(shares).tolist()) == sorted(ctx.train_indices.tolist())
    later = loader.build_train_loader(cfg, ctx, 0, 2, epoch=0, start=1)
    assert later.dataset.indices.tolist() == shares[0][2:].tolist() and len(list(later)) == 1
    assert len(list(loader.build_train_loader(cfg, ctx, 0, 1, epoch=0))) == 4  # micro-batches of 2


def test_a_windowed_loader_computes_its_share_of_the_windowed_order_alone(ctx_cfg, monkeypatch):
    """storage.shuffle_window on one cache of one shape: each process's share is order.rank_indices' over the
    training samples, from order.windowed_rank_indices (no array over every sample), on 1 and 2 processes and from
    a later step."""
    from train.data import order

    ctx, cfg = ctx_cfg
    monkeypatch.setattr(cfg.storage, "shuffle_window", 2)
    shards = ctx.reader.shards[ctx.train_indices]
    calls = []
    monkeypatch.setattr(
        loader, "windowed_rank_indices", lambda *a, **k: calls.append(a) or order.windowed_rank_indices(*a, **k)
    )
    for world, rank, start in ((1, 0, 0), (2, 0, 0), (2, 1, 0), (2, 1, 1)):
        got = loader.build_train_loader(cfg, ctx, rank, world, epoch=3, start=start).dataset.indices
        want = order.rank_indices(ctx.train_indices, cfg.seed, 3, 4, rank, world, start, shards=shards, window=2)
        assert got.tolist() == want.tolist()
    assert len(calls) == 4


def test_node_groups_give_each_process_its_part_of_each_batch_and_the_epoch_its_grouped_length(ctx_cfg, monkeypatch):
    """storage.node_groups 2: the loaders of 1 and 2 processes read order.windowed_rank_indices in two groups (the
    second process the second group's shards alone), and the run's steps per epoch are the groups' (check_sizes)."""
    from train.data import order

    ctx, cfg = ctx_cfg
    monkeypatch.setattr(cfg.storage, "shuffle_window", 2)
    monkeypatch.setattr(cfg.storage, "node_groups", 2)
    starts, held = ctx.reader.shard_starts, ctx.eval_indices
    one = loader.build_train_loader(cfg, ctx, 0, 1, epoch=1).dataset.indices
    assert one.tolist() == order.windowed_rank_indices(starts, held, cfg.seed, 1, 4, 0, 1, 0, 2, groups=2).tolist()
    halves = [loader.build_train_loader(cfg, ctx, r, 2, epoch=1).dataset.indices.reshape(-1, 2) for r in range(2)]
    assert np.concatenate(halves, axis=1).reshape(-1).tolist() == one.tolist()
    shards = [set(ctx.reader.shards[h.reshape(-1)].tolist()) for h in halves]
    assert not shards[0] & shards[1]
    steps = order.check_sizes(cfg, ctx.reader, ctx.train_indices, 2)
    assert steps == order.grouped_steps(starts, held, 4, 2) == len(one) // 4 > 0


def test_a_windowed_loader_of_several_shapes_or_grouped_by_length_walks_the_order_a_window_at_a_time(
    ctx_cfg, monkeypatch
):
    """storage.shuffle_window on one cache of two latent shapes, grouped by length or not, or of one shape grouped:
    each process's share is order.rank_indices', from order.bucketed_rank_indices (a window of shards at a time)."""
    import dataclasses

    from train.data import order

    ctx, cfg = ctx_cfg
    monkeypatch.setattr(cfg.storage, "shuffle_window", 2)
    monkeypatch.setattr(cfg.train, "global_batch_size", 2)
    calls = []
    monkeypatch.setattr(loader, "bucketed_rank_indices", lambda *a: calls.append(a) or order.bucketed_rank_indices(*a))
    n, train = len(ctx.reader), ctx.train_indices
    lengths = order.LengthGroups(np.arange(n) * 7 % 5, np.arange(n) % 2, 2)
    two = (np.arange(n) % 3 == 0).astype(np.int32)
    cases = ((two, None), (two, lengths), (order.bucket_ids(ctx.reader), lengths))
    for buckets, groups in cases:
        mixed = dataclasses.replace(ctx, buckets=buckets, groups=groups)
        for world, rank, start in ((1, 0, 0), (2, 1, 0), (2, 0, 1)):
            got = loader.build_train_loader(cfg, mixed, rank, world, epoch=1, start=start).dataset.indices
            shards = ctx.reader.shards[train]
            want = order.rank_indices(train, cfg.seed, 1, 2, rank, world, start, buckets[train], groups, shards, 2)
            assert got.tolist() == want.tolist() and len(want)
    assert len(calls) == 9


def test_the_eval_share_is_every_wth_position_with_each_samples_partner(ctx_cfg):
    ctx, cfg = ctx_cfg
    for rank in (0, 1):
        batches = list(loader.build_eval_loader(cfg, ctx, rank, 2).batch_sampler)
        assert sorted(p for b in batches for p in b) == list(range(rank, 4, 2))
    ds = ctx.dataset(cfg, ctx.eval_indices, 0, flip=False, partner=True)
    items = [ds[p] for p in range(len(ds))]
    assert all(PARTNER + cf.LATENT in it for it in items)
    assert any(bool(it["paired"]) for it in items)


def test_max_lengths_start_line_counts_the_cut_samples(ctx_cfg):
    from theworld.model.text import ChatFormatter

    ctx, _ = ctx_cfg
    report = loader.truncation_report(
        ChatFormatter(ctx.formatter.processor, max_length=12), ctx.reader, ctx.train_indices
    )
    assert report.startswith("train.loader.max_length 12: 0 conversation(s) shortened (0 turn(s) dropped")
    assert report.endswith("8 sample(s) with the first answer cut, of 8 training samples")
    lengths, images = loader.sample_lengths(ctx.formatter, ctx.reader)
    assert lengths.shape == images.shape == (12,) and (lengths > 12).all() and (images == 1).all()


class _Remote:
    """A reader of a remote cache as ReadAhead sees it: each shard's first sample, and the stage call. `shards`:
    each sample's shard, in cache order."""

    remote = object()

    def __init__(self, shards: list[int], full: set[int] = frozenset()):
        self.shard_starts = np.searchsorted(shards, np.arange(max(shards) + 2))
        self.full, self.staged = set(full), []

    def stage(self, shard: int, ahead: bool) -> None:
        if shard in self.full:
            self.full.discard(shard)  # room next time
            raise NoRoomAhead(shard)
        self.staged.append(shard)


def _read(ahead: loader.ReadAhead, positions) -> list[int]:
    for pos in positions:
        ahead(pos)
    ahead._pool.shutdown(wait=True)
    ahead._pool = None
    ahead._pid = 0  # the next call starts a new pool, keeping what was sent
    return ahead.reader.staged


def test_read_ahead_stages_the_next_shards_once_and_retries_one_that_found_no_room():
    reader = _Remote([0, 0, 1, 1, 2, 2, 3, 3])
    ahead = loader.ReadAhead(reader, np.arange(8), depth=2)
    assert _read(ahead, range(8)) == [1, 2, 3]  # shard 0 is read by the worker itself
    reader = _Remote([5, 5, 6, 6, 7, 7], full={7})
    ahead = loader.ReadAhead(reader, np.array([0, 1, 4, 5, 2, 3]), depth=1)  # shards 5, 5, 7, 7, 6, 6
    staged = _read(ahead, [0, 1, 2])  # 7 found no room when read ahead from shard 5's first sample
    assert 7 not in staged and 6 in staged
    assert loader.ReadAhead(_Remote([0, 1]), np.arange(2), depth=0).shards is None  # off
    local = _Remote([0, 1])
    local.remote = None
    assert loader.ReadAhead(local, np.arange(2), depth=2).shards is None


def _context(cache, tmp_path, monkeypatch, lazy: bool):
    from transformers import AutoProcessor

    from theworld.core.config import load_config
    from theworld.model.encoders import resolve_gemma
    from train.config import TrainConfig
    from train.data import cache as data
    from train.data import loader

    if lazy:
        monkeypatch.setattr(sample_index, "LAZY_BYTES", 0)
    sets = ["train.loader.group_by_length=true", "train.loader.max_length=40"]
    cfg = load_config(TrainConfig, None, [a for a in base_args(cache, tmp_path / "run") if a != "--set"] + sets)
    reader, plan = data.open_cache(cfg)
    reads = []
    raw = reader._raw
    monkeypatch.setattr(reader, "_raw", lambda i, m: reads.append(i) or raw(i, m))  # counts the tar reads
    monkeypatch.setattr(loader, "TEXT_SAMPLE", 10)
    ctx = loader.DataContext.build(cfg, reader, plan, AutoProcessor.from_pretrained(resolve_gemma("tiny")))
    ctx.check_first()  # as a loader does: the first sample's read (in the background) is over
    return reader, ctx, reads


def test_a_large_cache_groups_by_its_index_text_bytes_and_reports_truncation_from_a_draw(cache, tmp_path, monkeypatch):
    reader, ctx, reads = _context(cache, tmp_path, monkeypatch, lazy=True)
    assert reader.lazy and len(ctx.train_indices) == 80
    # 10 training samples read for the report, and the first sample's check: not one read per sample
    assert len(reads) == 11 and set(reads) <= set(ctx.train_indices.tolist())
    assert "of 10 training samples (a draw from the 80 of this cache" in ctx.truncation
    np.testing.assert_array_equal(ctx.groups.lengths, reader.text_bytes())
    assert ctx.groups.images.tolist() == [1] * len(reader)
    sizes = [sum(len(v) for k, v in raw.items() if k in ("txt", "json")) for raw in map(reader.raw, range(5))]
    assert ctx.groups.lengths[:5].tolist() == sizes  # what the caption and json members hold


def test_a_cache_held_whole_reads_every_text_as_before(cache, tmp_path, monkeypatch):
    reader, ctx, reads = _context(cache, tmp_path, monkeypatch, lazy=False)
    assert not reader.lazy and len(reads) >= 80 + len(reader)  # the report's pass and the lengths' pass
    assert ctx.truncation.endswith("of 80 training samples") and ctx.groups.images.max() >= 1


def test_the_truncation_reports_draw_from_a_billion_training_samples_holds_no_array_over_them():
    import tracemalloc

    from theworld.cache_format.held_out import Kept

    held = np.arange(0, 2_000_000_000, 7_812_500)  # 256 held out
    tracemalloc.start()
    drawn = loader.text_sample(Kept(2_000_000_000, held), seed=3)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 4 << 20, peak  # the permutation it replaced: 16 GB
    assert len(drawn) == loader.TEXT_SAMPLE == len(set(drawn.tolist())) and (np.diff(drawn) > 0).all()
    assert not np.isin(drawn, held).any()
    assert drawn.tolist() == loader.text_sample(Kept(2_000_000_000, held), seed=3).tolist()  # the seed's draw


def test_the_first_samples_text_is_read_in_the_background_and_its_damage_stops_the_loader_build(ctx_cfg, tmp_path):
    """DataContext.build reads the first training sample's text beside the rest of the start; its error (a flipped
    byte in its caption) is raised once, by the first loader's build, before any worker could fork."""
    import shutil

    from transformers import AutoProcessor

    from tests._precompute_helpers import flip_byte
    from theworld.core.errors import CacheDamaged
    from theworld.model import encoders

    ctx, cfg = ctx_cfg
    cache = tmp_path / "c"
    shutil.copytree(cfg.cache_dir, cache)
    first = int(ctx.train_indices[0])
    shard = int(ctx.reader.shards[first])
    key = flip_byte(cache, shard, first - int(ctx.reader.shard_starts[shard]), "txt")
    processor = AutoProcessor.from_pretrained(encoders.resolve_gemma("tiny"))
    damaged = loader.DataContext.build(cfg, cf.CacheReader(cache), ctx.inputs, processor)  # nothing raised yet
    with pytest.raises(CacheDamaged) as e:
        loader.build_train_loader(cfg, damaged, 0, 1, epoch=0)
    assert key in str(e.value) and "crc32" in str(e.value) and len(str(e.value).splitlines()) == 1
    damaged.check_first()  # raised once: nothing is left pending


def test_with_workers_the_first_batch_is_made_here_and_the_batches_are_those_without(ctx_cfg):
    """A training loader with workers makes its first batch in this process while they start on the rest: the same
    batches, in the same order, as the loader without workers; the later ones cross from a worker's shared memory."""
    import dataclasses

    ctx, cfg = ctx_cfg
    workers = dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, loader=dataclasses.replace(cfg.train.loader, num_workers=1))
    )
    for epoch in (0, 1):
        alone = list(loader.build_train_loader(cfg, ctx, 0, 1, epoch))
        made = loader.build_train_loader(workers, ctx, 0, 1, epoch)
        got = list(made)
        assert len(made) == len(got) == len(alone) >= 3
        for a, b in zip(alone, got):
            x, y = a.tensors("cpu"), b.tensors("cpu")  # (the buffer's alignment gaps hold no data)
            assert a.layout == b.layout and all(torch.equal(x[k], y[k]) for k in x)
        assert [b.buffer.is_shared() for b in got] == [False] + [True] * (len(got) - 1)


def test_a_loader_with_workers_raises_the_open_files_limit_its_batches_hold(ctx_cfg):
    """Each batch from a worker holds a file descriptor while it lives: a loader with workers raises the soft limit
    of open files (here lowered to 64) towards the hard one, so a caller keeping an epoch of batches is not cut off."""
    import dataclasses
    import resource

    ctx, cfg = ctx_cfg
    loader_cfg = dataclasses.replace(cfg.train.loader, num_workers=1)
    workers = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, loader=loader_cfg))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
    try:
        loader.build_train_loader(workers, ctx, 0, 1, 0)
        want = loader.DESCRIPTORS if hard == resource.RLIM_INFINITY else min(hard, loader.DESCRIPTORS)
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (want, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
