"""The dataset and the DataLoaders: tokenisation (a batch at a time), image decoding and the Gemma image processor
run inside DataLoader workers; the main process receives collated batches packed into one buffer (`Batch`)."""

from __future__ import annotations

import contextlib
import os
import resource
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from theworld import cache_format as cf
from theworld.cache_format.held_out import Kept
from theworld.cache_format.storage import NoRoomAhead
from theworld.core import log
from theworld.model.images import decode, load_for_vae, siglip_pixels
from theworld.model.inputs import PARTNER
from theworld.model.rollout import cache_condition, cache_seed, questions_tensor, sample_inputs
from theworld.model.text import ChatFormatter
from train.data.batches import Collate, Packing, encode_texts
from train.data.cache import InputSources, mixture_draw, split_data
from train.data.flip import swap_left_right
from train.data.mixture import Draw, MixedReader, named, partner_groups
from train.data.order import (
    LengthGroups,
    bucket_ids,
    bucketed_rank_indices,
    eval_partners,
    flip_of,
    rank_indices,
    seed_of,
    several_shapes,
    shard_bytes,
    shards_of,
    windowed_rank_indices,
)
from train.preempt import ignore_in_workers

_log = log.get(__name__)

# ----------------------------------------------------------------------------------------------------------------------
# Dataset and collation (run in workers)


class ReadAhead:
    """Downloads the next `depth` shards of a remote cache in a dataset's order into the node's shard cache while the
    worker decodes the current one: one download at a time per worker process (its range requests several at once),
    so the bytes in flight stay within workers x storage.PARTS_IN_FLIGHT x storage.PART_BYTES. A shard is used only
    once its sha256 is checked (storage.RemoteCache.stage); a failed read-ahead is left to the read that needs it.
    Read-ahead stays within the shard cache's budget: a shard that finds no room without evicting one read ahead and
    not read yet (storage.NoRoomAhead) is tried again at the next shard."""

    SCAN = 1 << 14  # positions looked ahead for the next shards

    def __init__(self, reader, indices: np.ndarray, depth: int):
        self.reader, self.depth = reader, depth
        self.shards = None
        if depth and getattr(reader, "remote", None) is not None:
            self.shards = shards_of(reader, indices)
        self._pid, self._pool, self._sent, self._last = 0, None, set(), -1

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_pid": 0, "_pool": None, "_sent": set()}

    def __call__(self, pos: int) -> None:
        if self.shards is None or int(self.shards[pos]) == self._last:
            return
        if self._pid != os.getpid():  # a forked worker: its own thread
            self._pid, self._pool, self._sent = os.getpid(), ThreadPoolExecutor(1), set()
        self._last = int(self.shards[pos])
        self._sent.add(self._last)
        ahead = []
        for s in self.shards[pos + 1 : pos + 1 + self.SCAN].tolist():
            if s not in self._sent and s not in ahead:
                ahead.append(s)
                if len(ahead) == self.depth:
                    break
        for s in ahead:
            self._sent.add(s)
            self._pool.submit(self._stage, s)

    def first(self, positions: np.ndarray, most: int) -> list[int]:
        """What `stage_first` downloads before the workers start, at most `most` shards: the distinct shards of
        `positions` (the workers' first batches), then those of the dataset's order up to the 1 + depth a worker's
        first read and its read-ahead ask for (found staged, they need no S3 client of the worker's own)."""
        if self.shards is None:
            return []
        out = _distinct(self.shards[np.asarray(positions, dtype=np.int64)])
        out += [s for s in _distinct(self.shards[: self.SCAN])[: 1 + self.depth] if s not in out]
        return out[:most]

    def _stage(self, shard: int) -> None:
        try:
            self.reader.stage(shard, ahead=True)
        except NoRoomAhead:  # tried again at the next shard, once reading has made room (or read when it comes)
            self._sent.discard(shard)
        except Exception as e:  # noqa: BLE001 - the read of that shard retries it and reports
            _log.debug(f"read-ahead of shard {shard}: {type(e).__name__}: {e}")


def _distinct(a: np.ndarray) -> list[int]:
    """The distinct values of `a` in the order they first occur."""
    _, first = np.unique(a, return_index=True)
    return a[np.sort(first)].tolist()


class CacheDataset(Dataset):
    """Position i -> one model-ready sample (token ids, labels, latents or image, SigLIP features or pixels)."""

    def __init__(
        self,
        reader: cf.CacheReader,
        indices: np.ndarray,
        formatter: ChatFormatter,
        inputs: InputSources,
        resolution: int,
        resize: str,
        image_processor=None,
        seed: int = 0,
        epoch: int = 0,
        flip: bool | None = None,
        partner: bool = False,
        rollouts: bool = False,
        prefetch: int = 0,
    ):
        """`rollouts`: the model rolls out live (world.num_world_steps > 0 without cached latents): each sample
        carries its rollout seed (`rollout_seed`). `prefetch`: shards read ahead of a remote cache (ReadAhead)."""
        self.reader, self.indices, self.formatter, self.inputs = reader, indices, formatter, inputs
        self.read_ahead = ReadAhead(reader, indices, prefetch)
        self.rollouts = rollouts
        self.resolution, self.resize, self.image_processor = resolution, resize, image_processor
        self.seed, self.epoch = seed, epoch
        self.flip = inputs.flip if flip is None else flip
        # eval: each item also carries its partner's world (eval_partners) for the shuffled-world loss; a rule over
        # the whole split, so the figure does not depend on the process count
        self.partners = eval_partners(partner_groups(reader, indices)) if partner else None

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, pos: int) -> dict:
        return self.item(pos)

    def item(self, pos: int, read_ahead: bool = True) -> dict:
        """The sample at `pos`; `read_ahead`: the next shards of the order downloaded meanwhile (ReadAhead)."""
        index = int(self.indices[pos])
        raw = self.reader.raw(index)  # first: a cold shard's download does not share the network with read-ahead
        if read_ahead:
            self.read_ahead(pos)
        s = self.reader.decode(index, raw, tensors=False)
        flipped = self.flip and flip_of(self.seed, self.epoch, index)
        turns = tuple((swap_left_right(u), swap_left_right(m)) if flipped else (u, m) for u, m in s.turns)
        # text is tokenised and cached tensors are decoded a batch at a time, by Collate
        item: dict = {"text": turns, "origin": (self.reader, index)}
        if self.inputs.cached_latents:
            item[cf.LATENT] = raw[cf.LATENT_FLIP if flipped else cf.LATENT]
        else:
            pixels, _ = load_for_vae(s.image, self.resolution, self.resize)
            item["images"] = pixels.flip(-1).contiguous() if flipped else pixels
            if self.rollouts:
                item.update(rollout_item(self.reader, index, s))
        if self.partners is not None:
            mate = int(self.partners[pos])
            item.update(self._world(mate))
            item["paired"] = torch.tensor(mate != pos)
        if self.inputs.cached_siglip:
            item[cf.SIGLIP] = raw[cf.SIGLIP]
        else:
            img = decode(s.image)
            if flipped:
                from PIL import ImageOps

                img = ImageOps.mirror(img)
            item["pixel_values"] = siglip_pixels(self.image_processor, img)
        return item

    def _world(self, pos: int) -> dict:
        """The unflipped world input of the sample at `pos`, under PARTNER names."""
        index = int(self.indices[pos])
        if self.inputs.cached_latents:  # (its origin names the right sample if its bytes turn out damaged)
            return {PARTNER + cf.LATENT: self.reader.raw(index)[cf.LATENT], PARTNER + "origin": (self.reader, index)}
        s = self.reader.decode(index, self.reader.raw(index), tensors=False)
        item = {PARTNER + "images": load_for_vae(s.image, self.resolution, self.resize)[0]}
        if self.rollouts:
            item.update({PARTNER + k: v for k, v in rollout_item(self.reader, index, s).items()})
        return item


def rollout_item(reader: cf.CacheReader | MixedReader, index: int, sample) -> dict:
    """What sample `index`'s live rollout needs: its seed from its cache's seed (`rollout.cache_seed`) and its key
    (and question), the rule the precompute that wrote (or would write) its rollouts used, so a live rollout in
    training equals the cached one; with the cache's condition question, the question itself (as bytes)."""
    if isinstance(reader, MixedReader):  # each cache of a mixture has its own seed
        reader, index = reader.locate(index)
    (seed,), questions = sample_inputs(cache_condition(reader.manifest), cache_seed(reader.manifest), [sample])
    item = {"rollout_seeds": torch.tensor(seed)}
    if questions is not None:
        item["rollout_questions"] = questions_tensor(questions)[0]
    return item


@dataclass
class DataContext:
    """Everything a loader needs besides (rank, world_size, epoch, start): built once per run."""

    reader: cf.CacheReader
    inputs: InputSources
    formatter: ChatFormatter
    image_processor: object
    train_indices: np.ndarray | Kept  # held_out.split's: no array over every sample
    eval_indices: np.ndarray
    buckets: np.ndarray  # (len(reader),) each sample's bucket (latent shape)
    draw: Draw | None = None  # a mixture's per-epoch draw from its caches
    truncation: str = ""  # with train.loader.max_length: how many training samples it shortens (start line)
    groups: LengthGroups | None = None  # train.loader.group_by_length: each sample's length and images
    first: Future | None = None  # the first training sample's text, read in the background (`check_first`)

    @classmethod
    def build(
        cls,
        cfg,
        reader: cf.CacheReader,
        inputs: InputSources,
        processor,
        split_: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> DataContext:
        """`split_`: split_data(cfg, reader) when the caller has it already."""
        train, held = split_ if split_ is not None else split_data(cfg, reader)
        # a cache in a bucket reads it as a byte range: that round trip passes beside the rest of the start
        first = ThreadPoolExecutor(1, "first-text")
        read = first.submit(reader.text, int(train[0]))
        first.shutdown(wait=False)
        formatter = ChatFormatter(processor, max_length=cfg.train.loader.max_length or None)
        large = getattr(reader, "lazy", False)  # a cache read a part at a time: no pass over every sample's text
        truncation = ""
        if formatter.max_length:
            drawn = text_sample(train, cfg.seed) if large else train
            truncation = truncation_report(formatter, reader, drawn, of=len(train) if large else None)
        loader = cfg.train.loader
        groups = None
        if loader.group_by_length:
            lengths = index_lengths(reader) if large else sample_lengths(formatter, reader)
            groups = LengthGroups(*lengths, loader.group_window)
        return cls(
            reader,
            inputs,
            formatter,
            processor.image_processor,
            train,
            held,
            bucket_ids(reader),
            mixture_draw(cfg, reader, train),
            truncation,
            groups,
            read,
        )

    def check_first(self) -> None:
        """The first training sample's prompt within train.loader.max_length: an error before any worker forks (the
        loaders call it). Waits for the background read of its text, whose error it raises."""
        if self.first is not None:
            first, self.first = self.first, None
            encode_texts(self.formatter, [first.result().turns])

    def epoch_samples(self, seed: int, epoch: int) -> np.ndarray:
        """The training samples epoch `epoch` orders: all of them, or a mixture's draw."""
        return np.asarray(self.train_indices) if self.draw is None else self.draw.epoch(seed, epoch)

    def describe_mixture(self, cfg) -> str:
        if self.draw is not None:
            return self.draw.describe(self.reader, [w for _, w in cfg.caches()])
        if not isinstance(self.reader, MixedReader):
            return ""
        held = self.reader.cache_of[self.eval_indices]
        parts = [f"{named(r)} {len(r) - int(np.sum(held == c))} samples" for c, r in enumerate(self.reader.readers)]
        return "mixture per epoch (weight samples): every training sample once; " + "; ".join(parts)

    def describe_buckets(self) -> str:
        """'' for one latent shape, else each shape (h x w) with its training samples."""
        if not several_shapes(self.buckets):
            return ""
        shapes, counts = np.unique(self.reader.latent_hw[self.epoch_samples(0, 0)], axis=0, return_counts=True)
        if len(shapes) < 2:
            return ""
        return "latent shapes (train samples): " + ", ".join(f"{h}x{w} ({n})" for (h, w), n in zip(shapes, counts))

    def dataset(
        self, cfg, indices: np.ndarray, epoch: int, flip: bool | None = None, partner: bool = False
    ) -> CacheDataset:
        return CacheDataset(
            self.reader,
            indices,
            self.formatter,
            self.inputs,
            cfg.image.resolution,
            cfg.image.resize,
            self.image_processor,
            cfg.seed,
            epoch,
            flip,
            partner,
            rollouts=cfg.world.num_world_steps > 0 and not self.inputs.cached_latents,
            prefetch=cfg.storage.prefetch_shards,
        )


TEXT_SAMPLE = 1024  # training samples a large cache's truncation report reads: ~20 s of requests at 20 ms each


def text_sample(train: np.ndarray, seed: int) -> np.ndarray:
    """TEXT_SAMPLE of the training samples, drawn by the run seed, in cache order."""
    if len(train) <= TEXT_SAMPLE:
        return train
    rng = np.random.default_rng(seed_of("text-sample", seed))  # draws without a permutation of every sample
    return train[np.sort(rng.choice(len(train), TEXT_SAMPLE, replace=False))]


def index_lengths(reader: cf.CacheReader) -> tuple[np.ndarray, np.ndarray]:
    """What group_by_length sorts a large cache by, read from its shard table rather than its tars: each sample's
    caption and json bytes (a stand-in for its token length: the same order up to the tokenizer's bytes per token)
    and one image a sample (what every precomputed sample has)."""
    lengths = reader.text_bytes()  # uint16, and the images a broadcast: 2 bytes a sample in all
    return lengths, np.broadcast_to(np.uint8(1), lengths.shape)


def truncation_report(
    formatter: ChatFormatter, reader: cf.CacheReader, indices: np.ndarray, chunk: int = 1024, of: int | None = None
) -> str:
    """The start line on what train.loader.max_length does to the samples at `indices`: conversations that lose whole
    turns from their end, and samples whose (first) answer is cut. Reads and tokenises every sample's text once.
    `of`: `indices` are a draw from this many training samples (a large cache), which the line says."""
    shortened = dropped_turns = cut = 0
    for lo in range(0, len(indices), chunk):
        convs = [reader.text(int(i)).turns for i in indices[lo : lo + chunk]]
        for c in (c for c in convs if len(c) > 1):
            kept = formatter.encode_turns(c)[1]
            shortened += kept < len(c)
            dropped_turns += len(c) - kept
        # a first turn over max_length, alone or all that is left of a conversation: its answer is cut
        firsts = formatter.conversation_ids([c[0] for c in convs])
        cut += sum(len(ids) > formatter.max_length for ids in firsts)
    return (
        f"train.loader.max_length {formatter.max_length}: {shortened} conversation(s) shortened ({dropped_turns} "
        f"turn(s) dropped from their ends), {cut} sample(s) with the first answer cut, of {len(indices)} training "
        "samples"
        + (f" (a draw from the {of} of this cache, which is too large to read every text at start)" if of else "")
    )


def sample_lengths(
    formatter: ChatFormatter, reader: cf.CacheReader, chunk: int = 1024
) -> tuple[np.ndarray, np.ndarray]:
    """Every sample's token length as the formatter encodes it (train.loader.max_length applied) and its number of
    images: (N,) int64 arrays over the reader's indices. Reads and tokenises every sample's text once."""
    boi = formatter.tokenizer.convert_tokens_to_ids(formatter.tokenizer.boi_token)
    lengths, images = np.zeros(len(reader), dtype=np.int64), np.zeros(len(reader), dtype=np.int64)
    for lo in range(0, len(reader), chunk):
        hi = min(lo + chunk, len(reader))
        encoded = encode_texts(formatter, [reader.text(i).turns for i in range(lo, hi)])
        lengths[lo:hi] = [len(e.input_ids) for e in encoded]
        images[lo:hi] = [e.input_ids.count(boi) for e in encoded]
    return lengths, images


def _worker_init(_: int) -> None:
    # workers decode and tokenise; intra-op or tokenizer threads would only fight the training step
    torch.set_num_threads(1)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    ignore_in_workers()


STAGE_AT_ONCE = 8  # shards stage_first downloads at once (each holds storage.PARTS_IN_FLIGHT parts in memory)


def stage_first(read_ahead: ReadAhead, here: int, positions: np.ndarray, workers: int) -> None:
    """The shards of the first batches (`positions`: this process's first `here`, then the workers' first ones)
    downloaded from this process, STAGE_AT_ONCE at a time, before the workers fork: this process's first batch and a
    worker's then read staged shards (their sha256 checked here), the worker's without waiting for its own S3 client.
    Every shard of this process's first batch (a windowed order spreads a batch over up to storage.shuffle_window
    shards), then at most 1 + storage.prefetch_shards per worker (what its read-ahead would ask for), all at once, or
    after this process's where the shard cache cannot hold them all; a failure is left to the read that needs the
    shard, which retries it and reports."""
    if not len(positions) or read_ahead.shards is None:
        return
    mine = len(_distinct(read_ahead.shards[positions[:here]]))
    shards = read_ahead.first(positions, mine + workers * (1 + read_ahead.depth))
    # where the shard cache cannot hold them all, this process's shards before the workers': a worker's staged first
    # would leave one of these to be read outside the budget's care for what is read ahead, evicting a worker's
    fits = shard_bytes(read_ahead.reader, shards) <= read_ahead.reader.remote.settings.budget
    for group in [shards] if fits else [shards[:mine], shards[mine:]]:
        if group:
            with ThreadPoolExecutor(min(len(group), STAGE_AT_ONCE)) as pool:
                list(pool.map(read_ahead._stage, group))  # no download's file is open when the workers fork


class TrainLoader:
    """A training loader with workers: its first batch made in this process, which would only wait for it, while the
    workers start (fork, import state, first reads) on the batches after it. The batches are those of one
    DataLoader over every position, in the same order."""

    def __init__(self, rest: DataLoader, size: int):
        """`rest`: the workers' loader over the positions after the first `size`."""
        self.rest, self.size = rest, size

    def __len__(self) -> int:
        return (self.size > 0) + len(self.rest)

    def __iter__(self) -> Iterator:
        rest = iter(self.rest)  # the workers fork now, before this process reads anything more
        if self.size:
            # its shards are staged (stage_first): no read-ahead threads of this process left running into a fork
            dataset = self.rest.dataset
            batch = self.rest.collate_fn([dataset.item(pos, read_ahead=False) for pos in range(self.size)])
            # nor its shards' descriptors, which would keep evicted shards' space and pass to the next workers
            dataset.reader.close()
            yield batch
        yield from rest


def _loader(cfg, ctx: DataContext, dataset, stage: int = 0, here: int = 0, **kw) -> DataLoader:
    """`stage`: the positions whose shards are downloaded before the workers fork (a training loader's first
    batches, `here` of them this process's; an eval loader, built at the start and used later, leaves its shards to
    its workers)."""
    workers = cfg.train.loader.num_workers
    # Batches cross from the workers by file descriptor, torch's default: a batch is one shared buffer (Batch), so
    # that is one request to its worker per batch. Sharing by name instead needs torch's shared-memory manager, a
    # process that loads libtorch (0.14 s) before the first batch.
    if workers:
        _more_descriptors()
    if workers and stage:
        stage_first(dataset.read_ahead, here, np.arange(min(len(dataset), stage)), workers)
    ctx.check_first()  # after the first shards' downloads, which its read passes beside; before any worker forks
    packing = (
        Packing(cfg.train.loader.pack_length, cfg.world.pool, 1 + cfg.world.num_world_steps)
        if cfg.train.loader.packing
        else None
    )
    return DataLoader(
        dataset,
        num_workers=workers,
        pin_memory=torch.cuda.is_available(),
        collate_fn=Collate(ctx.formatter, packing),
        prefetch_factor=4 if workers else None,
        worker_init_fn=_worker_init if workers else None,
        **kw,
    )


DESCRIPTORS = 1 << 20  # the most open files a loader asks the system for


def _more_descriptors() -> None:
    """A batch from a worker holds a file descriptor for as long as it lives, so a caller that keeps many (a list of
    an epoch's batches) would meet the usual soft limit of 1024 open files: it is raised towards the hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = DESCRIPTORS if hard == resource.RLIM_INFINITY else min(hard, DESCRIPTORS)
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(ValueError, OSError):  # a system that refuses keeps its limit
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def _rank_indices(cfg, ctx: DataContext, rank: int, world_size: int, epoch: int, start: int) -> np.ndarray:
    """order.rank_indices of this run's samples. The windowed order of one cache gives the same indices without an
    array over every sample: of one latent shape at this process's positions alone (order.windowed_rank_indices),
    of several or grouped by length walked a window of shards at a time (order.bucketed_rank_indices)."""
    window, args = cfg.storage.shuffle_window, (cfg.seed, epoch, cfg.train.global_batch_size, rank, world_size, start)
    whole = len(ctx.train_indices) + len(ctx.eval_indices) == len(ctx.reader)  # every sample trains but the held-out
    if window and ctx.draw is None and whole:
        starts, held = ctx.reader.shard_starts, ctx.eval_indices
        if ctx.groups is None and not several_shapes(ctx.buckets):  # node groups take this path (check_sizes)
            return windowed_rank_indices(starts, held, *args, window, groups=cfg.storage.node_groups)
        return bucketed_rank_indices(starts, held, ctx.buckets, *args, window, ctx.groups)
    samples = ctx.epoch_samples(cfg.seed, epoch)
    shards = shards_of(ctx.reader, samples) if window else None
    return rank_indices(samples, *args, ctx.buckets[samples], ctx.groups, shards=shards, window=window)


def build_train_loader(
    cfg, ctx: DataContext, rank: int, world_size: int, epoch: int, start: int = 0
) -> DataLoader | TrainLoader:
    """Micro-batches of this process for `epoch` from global batch `start` on: accumulation_steps of them per step."""
    dataset = ctx.dataset(cfg, _rank_indices(cfg, ctx, rank, world_size, epoch, start), epoch)
    size, workers = cfg.train.micro_batch_size, cfg.train.loader.num_workers
    if not workers:
        return _loader(cfg, ctx, dataset, batch_size=size, shuffle=False)
    first = min(size, len(dataset))
    rest = _loader(cfg, ctx, dataset, (1 + workers) * size, first, batch_size=size, sampler=range(first, len(dataset)))
    return TrainLoader(rest, first)


def build_eval_loader(cfg, ctx: DataContext, rank: int, world_size: int) -> DataLoader:
    """This process's share (positions rank, rank + W, ... of the held-out split) in batches of one latent shape,
    unflipped, each sample with the world of its partner (`eval_partners`) for the shuffled-world loss."""
    positions = np.arange(rank, len(ctx.eval_indices), world_size)
    size = cfg.train.eval.batch_size or cfg.train.micro_batch_size
    of = ctx.buckets[ctx.eval_indices[positions]]
    batches = []
    for k in np.unique(of):
        mine = positions[of == k].tolist()
        batches += [mine[i : i + size] for i in range(0, len(mine), size)]
    return _loader(cfg, ctx, ctx.dataset(cfg, ctx.eval_indices, 0, flip=False, partner=True), batch_sampler=batches)
