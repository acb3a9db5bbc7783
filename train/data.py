"""Data: the cache, its fingerprint check, the held-out split, per-epoch order, per-process slices, DataLoaders.

Everything that decides which sample goes where is a pure function of (seed, epoch, step), so a run's data is the same
whatever the number of processes, and resuming at step s reads exactly the batches an uninterrupted run reads there:

- eval split: the `train.eval_samples` samples with the smallest sha256(key) are held out (independent of shard layout);
- epoch order: a permutation of the training samples seeded from (seed, epoch), walked in order, each sample going to
  its latent shape's (bucket's) list; each time a list reaches G samples they become the next global batch, and what is
  left in the lists at the end is dropped. With one shape (a square cache) global batch b is order[b*G:(b+1)*G].
  Step s is global batch s % steps_per_epoch of epoch s // steps_per_epoch;
- process r of W takes the r-th contiguous slice (G/W samples) of each global batch, in micro-batches of M, so every
  micro-batch holds one latent shape.

Sample indices live in numpy arrays (8 bytes a sample), shared by forked loader workers without copying.

Tokenisation (a batch at a time), image decoding and the Gemma image processor run inside DataLoader workers; the main
process receives collated batches packed into one buffer (`Batch`).
"""
from __future__ import annotations

import hashlib
import math
import os
import re
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from theworld import cache_format as cf
from theworld.errors import UserError
from theworld.images import decode, load_for_vae, siglip_pixels
from theworld.text import IGNORE, ChatFormatter, PromptTooLong, collate_text
from train.preempt import ignore_in_workers


def _seed(*parts) -> int:
    return int.from_bytes(hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest(), "little") >> 1


# ----------------------------------------------------------------------------------------------------------------------
# What each sample needs


@dataclass(frozen=True)
class InputPlan:
    cached_latents: bool  # frozen VAE: latents from the cache; else live encoding of the stored image
    cached_siglip: bool  # frozen vision tower and SigLIP cached: features from the cache; else live pixels
    flip: bool
    members: tuple[str, ...]  # what the reader reads

    @property
    def needs_image(self) -> bool:
        return not (self.cached_latents and self.cached_siglip)


def plan_inputs(cfg, reader: cf.CacheReader) -> InputPlan:
    """Decide cached vs live inputs from the freeze flags and what the cache holds; refuse impossible combinations."""
    present = set(reader.member_names())
    has_image = any(ext in present for ext in cf.IMAGE_EXTS)
    cached_latents = cfg.freeze.vae
    cached_siglip = cfg.freeze.vision and cfg.train.cached_siglip and cf.SIGLIP in present
    flip = cfg.train.flip
    if cached_latents and cfg.world.latent == "sample" and cf.latents_stored(reader.manifest) == "mean":
        raise UserError(f"config key 'world.latent': 'sample' needs the posterior's logvar, but cache "
                        f"{reader.cache_dir} stores the mean only (cache.latents: mean); use world.latent: mean, or "
                        "a cache built with cache.latents: posterior")
    if flip and cached_latents and cf.LATENT_FLIP not in present:
        raise UserError(f"config key 'train.flip': cache {reader.cache_dir} has no flipped latents "
                        "(build it with cache.flip: true, or set train.flip: false)")
    if flip and cached_siglip:
        raise UserError("config key 'train.flip': cached SigLIP features are unflipped; set "
                        "train.cached_siglip: false to compute image tokens live, or train.flip: false")
    plan_members = {cf.LATENT} if cached_latents else set()
    if flip and cached_latents:
        plan_members.add(cf.LATENT_FLIP)
    if cached_siglip:
        plan_members.add(cf.SIGLIP)
    plan = InputPlan(cached_latents, cached_siglip, flip, ())
    if plan.needs_image:
        if not has_image:
            what = "freeze.vae: false (live VAE encoding)" if not cached_latents else "live SigLIP pixels"
            raise UserError(f"cache {reader.cache_dir} keeps no images, which {what} needs (build it with cache.images: true)")
        plan_members.update(cf.IMAGE_EXTS)
    return InputPlan(cached_latents, cached_siglip, flip, tuple(sorted(plan_members)))


# ----------------------------------------------------------------------------------------------------------------------
# The cache and its fingerprint


def open_cache(cfg) -> tuple[cf.CacheReader, InputPlan]:
    """Open the cache and check the fingerprint fields that need no model (before any model is loaded)."""
    reader = cf.CacheReader(cfg.cache_dir)
    reader.check_consistency()  # sizes and keys only; every member's crc32 is checked as it is read
    plan = plan_inputs(cfg, reader)
    fields = ["format_version", "image"] + (["vae"] if plan.cached_latents else [])
    cf.check_fingerprint(reader.manifest.get("fingerprint") or {}, cf.fingerprint_for(cfg.model, cfg.image),
                         cfg.cache_dir, fields=fields, partial=True)
    reader.members = plan.members
    return reader, plan


def verify_fingerprint(cfg, model, processor, reader: cf.CacheReader, plan: InputPlan) -> None:
    """Full check against the loaded models (config digests and weight hashes): format_version, image, and vae when
    cached latents are used, siglip when cached SigLIP features are used."""
    expected = cf.fingerprint_for(cfg.model, cfg.image, siglip=plan.cached_siglip, vae=model.world_encoder.vae,
                                  gemma=model.gemma, processor=processor)
    fields = ["format_version", "image"] + (["vae"] if plan.cached_latents else []) + \
        (["siglip"] if plan.cached_siglip else [])
    cf.check_fingerprint(reader.manifest.get("fingerprint") or {}, expected, cfg.cache_dir, fields=fields)


# ----------------------------------------------------------------------------------------------------------------------
# Split and order


def split(reader: cf.CacheReader, eval_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, eval indices): the eval_samples keys with the smallest sha256 are held out. Train indices in
    cache order, eval indices in key order."""
    n = len(reader)
    _check_held_out(eval_samples, n)
    ranked = sorted(range(n), key=lambda i: hashlib.sha256(reader.key(i).encode()).digest())
    held = np.array(sorted(ranked[:eval_samples], key=reader.key), dtype=np.int64)
    keep = np.ones(n, dtype=bool)
    keep[held] = False
    return np.flatnonzero(keep).astype(np.int64), held


def _check_held_out(eval_samples: int, num_samples: int) -> None:
    if eval_samples >= num_samples:
        raise UserError(f"config key 'train.eval_samples': {eval_samples} leaves nothing to train on "
                        f"({num_samples} samples)")


def bucket_ids(reader: cf.CacheReader) -> np.ndarray:
    """(N,) int32: each sample's bucket, numbered in (h, w) order of the cache's latent shapes."""
    hw = reader.latent_hw
    if not len(hw) or (hw == hw[0]).all():  # one shape (every square cache): no sort over the whole index
        return np.zeros(len(hw), dtype=np.int32)
    return np.unique(hw, axis=0, return_inverse=True)[1].reshape(-1).astype(np.int32)


def _permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    return torch.randperm(n, generator=torch.Generator().manual_seed(_seed("order", seed, epoch))).numpy()


def epoch_order(train_indices: np.ndarray, seed: int, epoch: int) -> np.ndarray:
    return np.asarray(train_indices, dtype=np.int64)[_permutation(len(train_indices), seed, epoch)]


def epoch_batches(train_indices: np.ndarray, seed: int, epoch: int, global_batch: int,
                  buckets: np.ndarray | None = None) -> np.ndarray:
    """(steps_per_epoch, G) global batches of `epoch`, each of one bucket (`buckets[i]` is train_indices[i]'s).

    The epoch's permutation is walked in order and each sample appended to its bucket's list; whenever a list holds G
    samples they form the next batch. So batches are ordered by where their last sample falls in the permutation (each
    bucket's batches spread over the epoch), a bucket's leftover (< G samples) is dropped for this epoch, and with one
    bucket batch b is order[b*G:(b+1)*G].
    """
    perm = _permutation(len(train_indices), seed, epoch)
    order = np.asarray(train_indices, dtype=np.int64)[perm]
    of = np.zeros(len(order), dtype=np.int32) if buckets is None else np.asarray(buckets)[perm]
    rows, ends = [np.zeros((0, global_batch), dtype=np.int64)], [np.zeros(0, dtype=np.int64)]
    for k in np.unique(of):
        pos = np.flatnonzero(of == k)
        full = len(pos) // global_batch * global_batch
        rows.append(order[pos[:full]].reshape(-1, global_batch))
        ends.append(pos[global_batch - 1:full:global_batch])
    return np.concatenate(rows)[np.argsort(np.concatenate(ends), kind="stable")]


def check_sizes(cfg, reader: cf.CacheReader, train_indices: np.ndarray, world_size: int) -> int:
    """Steps per epoch from the cache's index alone (before any model loads), or a one-line error naming the key."""
    n_eval = cfg.train.eval_samples
    _check_held_out(n_eval, len(reader))
    if n_eval == 1 or 0 < n_eval < world_size:  # each process takes a share; a shuffled world is another sample's
        raise UserError(f"config key 'train.eval_samples': {n_eval} is too few for {world_size} process(es) (the "
                        f"shuffled-world loss takes each held-out sample's world from another one): use 0 (no eval) "
                        f"or at least {max(2, world_size)}")
    return steps_per_epoch(np.bincount(bucket_ids(reader)[train_indices]), cfg.train.global_batch_size)


def steps_per_epoch(bucket_sizes: np.ndarray | int, global_batch: int) -> int:
    """Whole global batches per epoch from the training samples of each bucket (an int: one bucket)."""
    sizes = np.atleast_1d(bucket_sizes)
    steps = int((sizes // global_batch).sum())
    if not steps:
        where = f"the {int(sizes.sum())} training samples" if len(sizes) == 1 else \
            f"the training samples of every latent shape (largest: {int(sizes.max())})"
        raise UserError(f"config key 'train.global_batch_size': {global_batch} is more than {where}")
    return steps


def rank_offset(global_batch: int, rank: int, world_size: int) -> int:
    """Where process `rank`'s contiguous slice of a global batch starts."""
    return rank * (global_batch // world_size)


def rank_indices(train_indices: np.ndarray, seed: int, epoch: int, global_batch: int, rank: int, world_size: int,
                 start_batch: int = 0, buckets: np.ndarray | None = None) -> np.ndarray:
    """This process's samples for global batches [start_batch, end of epoch) of `epoch`, in consumption order."""
    batches = epoch_batches(train_indices, seed, epoch, global_batch, buckets)
    lo = rank_offset(global_batch, rank, world_size)
    return batches[start_batch:, lo:lo + global_batch // world_size].reshape(-1)


def flip_of(seed: int, epoch: int, index: int) -> bool:
    return _seed("flip", seed, epoch, index) & 1 == 1


# Flip augmentation's text rule (docs/training.md, "Flip"): `left`/`right` (and `leftmost`/`rightmost`) are swapped,
# case kept, only where they name a side of the picture.
_SWAP = {"left": "right", "right": "left", "leftmost": "rightmost", "rightmost": "leftmost"}
SIDE_AFTER = frozenset("of side sides half halves hand hands corner corners edge edges part parts portion portions "
                       "quadrant quadrants third thirds column columns border margin wing".split())
SIDE_BEFORE = frozenset("to on at from toward towards top bottom upper lower far center centre middle facing faces "
                        "face looking looks pointing points turned turning turn turns leaning leans moving moves "
                        "heading heads".split())
ARTICLES = frozenset("the its their his her a".split())
PREPOSITIONS = frozenset("to on at from toward towards in into onto near by off".split())
LINKS = frozenset(("and", "or", "to"))  # "left and right", "from right to left": both words swap
_WORD = re.compile(r"[A-Za-z']+")


def swap_left_right(text: str) -> str:
    """The caption of the mirrored picture: see the rule above and in docs/training.md."""
    words = list(_WORD.finditer(text))
    low = [m.group().lower() for m in words]

    def joined(i: int, j: int) -> bool:  # words i < j with nothing but spaces or hyphens between them
        return 0 <= i and j < len(words) and not text[words[i].end():words[j].start()].strip(" -\t")

    swap = set()
    for i, w in enumerate(low):
        if w in ("leftmost", "rightmost"):
            swap.add(i)
        elif w in ("left", "right"):
            before = low[i - 1] if joined(i - 1, i) else ""
            article_after_preposition = before in ARTICLES and joined(i - 2, i - 1) and low[i - 2] in PREPOSITIONS
            after = low[i + 1] if joined(i, i + 1) else ""
            if after in SIDE_AFTER or before in SIDE_BEFORE or article_after_preposition:
                swap.add(i)
    for i in sorted(swap):  # a swapped word's partner across and/or/to
        for j in (i - 2, i + 2):
            lo, hi = min(i, j), max(i, j)
            if 0 <= lo and hi < len(low) and low[j] in _SWAP and low[lo + 1] in LINKS and joined(lo, lo + 1) \
                    and joined(lo + 1, hi):
                swap.add(j)
    out, end = [], 0
    for i in sorted(swap):
        m = words[i]
        word = _SWAP[low[i]]
        if m.group().isupper():
            word = word.upper()
        elif m.group()[0].isupper():
            word = word.capitalize()
        out += [text[end:m.start()], word]
        end = m.end()
    return "".join(out) + text[end:]


# ----------------------------------------------------------------------------------------------------------------------
# Dataset and collation (run in workers)


class CacheDataset(Dataset):
    """Position i -> one model-ready sample (token ids, labels, latents or image, SigLIP features or pixels)."""

    def __init__(self, reader: cf.CacheReader, indices: np.ndarray, formatter: ChatFormatter, plan: InputPlan,
                 resolution: int, resize: str, image_processor=None, seed: int = 0, epoch: int = 0,
                 flip: bool | None = None, partner: bool = False):
        self.reader, self.indices, self.formatter, self.plan = reader, indices, formatter, plan
        self.resolution, self.resize, self.image_processor = resolution, resize, image_processor
        self.seed, self.epoch = seed, epoch
        self.flip = plan.flip if flip is None else flip
        # eval: each item also carries its partner's world (eval_partners) for the shuffled-world loss; a rule over
        # the whole split, so the figure does not depend on the process count
        self.partners = eval_partners(reader.latent_hw[indices]) if partner else None

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, pos: int) -> dict:
        index = int(self.indices[pos])
        raw = self.reader.raw(index)
        s = self.reader.decode(index, raw, tensors=False)
        flipped = self.flip and flip_of(self.seed, self.epoch, index)
        prompt, caption = s.prompt, s.caption
        if flipped:
            prompt, caption = swap_left_right(prompt), swap_left_right(caption)
        # text is tokenised and cached tensors are decoded a batch at a time, by Collate
        item: dict = {"text": (prompt, caption), "origin": (self.reader, index)}
        if self.plan.cached_latents:
            item[cf.LATENT] = raw[cf.LATENT_FLIP if flipped else cf.LATENT]
        else:
            pixels, _ = load_for_vae(s.image, self.resolution, self.resize)
            item["images"] = pixels.flip(-1).contiguous() if flipped else pixels
        if self.partners is not None:
            mate = int(self.partners[pos])
            item.update(self._world(mate))
            item["paired"] = torch.tensor(mate != pos)
        if self.plan.cached_siglip:
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
        if self.plan.cached_latents:  # (its origin names the right sample if its bytes turn out damaged)
            return {PARTNER + cf.LATENT: self.reader.raw(index)[cf.LATENT], PARTNER + "origin": (self.reader, index)}
        image = self.reader.decode(index, self.reader.raw(index), tensors=False).image
        return {PARTNER + "images": load_for_vae(image, self.resolution, self.resize)[0]}


PARTNER = "partner:"  # prefix of an eval item's (and batch's) partner-world keys


def eval_partners(latent_hw: np.ndarray) -> np.ndarray:
    """For held-out samples in key order with latent shapes (n, 2): each one's partner, the next sample of the same
    shape (cyclically), whose world it takes for the shuffled-world loss; itself when it is its shape's only one."""
    partners = np.arange(len(latent_hw))
    shapes = np.unique(latent_hw, axis=0, return_inverse=True)[1].reshape(-1) if len(latent_hw) else partners
    for k in np.unique(shapes):
        pos = np.flatnonzero(shapes == k)
        partners[pos] = np.roll(pos, -1)
    return partners


class Batch:
    """A collated micro-batch packed into one flat byte buffer.

    A tensor a loader worker returns crosses to the main process as a shared-memory block of its own: created in the
    worker, opened by name in the main process (each a round trip to torch's shared-memory manager), then pinned and
    copied to the GPU on its own. One block per batch, allocated shared in the worker so that sending it copies
    nothing, keeps that cost per batch rather than per tensor (docs/performance.md). `to(device)` gives the named
    tensors back as views of the copied buffer.
    """

    ALIGN = 64  # bytes: every tensor starts on a boundary its dtype (and vector loads) can view

    def __init__(self, tensors: dict[str, torch.Tensor], num_tokens: int):
        self.num_tokens = num_tokens
        self.size = len(tensors["input_ids"])  # samples
        self.layout: list[tuple[str, torch.dtype, int, tuple[int, ...]]] = []  # name, dtype, byte offset, shape
        nbytes = 0
        for name, t in tensors.items():
            self.layout.append((name, t.dtype, nbytes, tuple(t.shape)))
            nbytes += -(-t.numel() * t.element_size() // self.ALIGN) * self.ALIGN
        self.buffer = _byte_buffer(nbytes)
        for (name, dtype, offset, shape), t in zip(self.layout, tensors.values()):
            self._view(self.buffer, dtype, offset, shape).copy_(t)

    @staticmethod
    def _view(buffer: torch.Tensor, dtype: torch.dtype, offset: int, shape: tuple[int, ...]) -> torch.Tensor:
        return buffer[offset:offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)

    def pin_memory(self) -> "Batch":  # called by DataLoader(pin_memory=True)'s pinning thread
        self.buffer = self.buffer.pin_memory()
        return self

    def to(self, device: torch.device | str) -> dict[str, torch.Tensor]:
        buffer = self.buffer.to(device, non_blocking=True)
        return {name: self._view(buffer, dtype, offset, shape) for name, dtype, offset, shape in self.layout}


def _byte_buffer(nbytes: int) -> torch.Tensor:
    if torch.utils.data.get_worker_info() is None:
        return torch.empty(nbytes, dtype=torch.uint8)
    # in a loader worker: allocate in shared memory now, as torch's default_collate does, rather than have pickling
    # copy the batch into a new shared block when it is sent
    new_shared = getattr(torch.UntypedStorage, "_new_shared", None)  # private: keep working if it goes
    if new_shared is None:
        return torch.empty(nbytes, dtype=torch.uint8).share_memory_()
    return torch.empty(0, dtype=torch.uint8).set_(new_shared(nbytes))


class Collate:
    """List of samples -> one packed Batch: tokenised and padded text, the cached tensors decoded together, stacked
    pixels, the answer-token count."""

    # cache member -> {tensor name in the member: batch key}
    CACHED = {cf.LATENT: {"mean": "latent_mean", "logvar": "latent_logvar"}, cf.SIGLIP: {"features": "siglip"}}
    OPTIONAL = {"logvar"}  # a mean-only cache (cache.latents: mean)

    def __init__(self, formatter: ChatFormatter):
        self.formatter = formatter

    def __call__(self, items: list[dict]) -> Batch:
        batch = collate_text(_encode(self.formatter, [it["text"] for it in items]), self.formatter.pad_id)
        for k in items[0]:
            prefix, member = (PARTNER, k.removeprefix(PARTNER)) if k.startswith(PARTNER) else ("", k)
            if member in self.CACHED:
                stacked = _load_stacked(k, items, tuple(self.CACHED[member]), self.OPTIONAL)
                if missing := self.CACHED[member].keys() - stacked.keys() - self.OPTIONAL:
                    raise ValueError(f"cache member {member} holds no tensor {', '.join(sorted(missing))}")
                batch.update({prefix + key: stacked[name] for name, key in self.CACHED[member].items()
                              if name in stacked})
            elif k not in ("text", "origin", PARTNER + "origin"):
                batch[k] = torch.stack([it[k] for it in items])
        return Batch(batch, num_tokens=int((batch["labels"][:, 1:] != IGNORE).sum()))


def _load_stacked(member: str, items: list[dict], names, optional=frozenset()) -> dict[str, torch.Tensor]:
    """cf.load_stacked; bytes that do not decode to the tensors `names` (those in `optional` may be absent; a cache
    written before member checksums) raise CacheDamaged naming the sample."""
    try:
        return cf.load_stacked([it[member] for it in items])
    except BaseException as e:
        if not isinstance(e, Exception) and type(e).__name__ != "PanicException":  # safetensors' Rust panics
            raise
        origin = PARTNER + "origin" if member.startswith(PARTNER) else "origin"
        signatures = []
        for it in items:  # find the sample at fault, for the error line
            reader, index = it[origin]
            try:
                t = cf.st_load(it[member])
                if odd := [n for n in names if n not in t and n not in optional] + [n for n in t if n not in names]:
                    raise KeyError(odd[0])
                signatures.append(tuple(sorted((n, tuple(v.shape), v.dtype) for n, v in t.items())))
            except BaseException as inner:  # noqa: BLE001 - KeyError for a missing tensor, or a decode failure
                if not isinstance(inner, Exception) and type(inner).__name__ != "PanicException":
                    raise
                raise reader.damaged(index, f"member {member} does not decode to tensors {', '.join(names)} "
                                            f"({type(inner).__name__})") from None
        common = Counter(signatures).most_common(1)[0][0]
        odd = next((it[origin] for it, sig in zip(items, signatures) if sig != common), None)
        if odd is None:
            raise
        raise odd[0].damaged(odd[1], f"member {member} holds tensors unlike the batch's others") from None


# batch keys that carry a sample's world (eval's shuffled-world loss swaps them for their PARTNER versions)
WORLD_KEYS = (*Collate.CACHED[cf.LATENT].values(), "images")


def _encode(formatter: ChatFormatter, pairs: list[tuple[str, str]]) -> list:
    try:
        return formatter.encode_many(pairs)
    except PromptTooLong as e:  # in a loader worker too: cli_entry prints the error's own line
        raise UserError(f"config key 'train.max_length': {e}") from None


@dataclass
class DataContext:
    """Everything a loader needs besides (rank, world_size, epoch, start): built once per run."""

    reader: cf.CacheReader
    plan: InputPlan
    formatter: ChatFormatter
    image_processor: object
    train_indices: np.ndarray
    eval_indices: np.ndarray
    buckets: np.ndarray  # (len(reader),) each sample's bucket (latent shape)

    @classmethod
    def build(cls, cfg, reader: cf.CacheReader, plan: InputPlan, processor,
              split_: tuple[np.ndarray, np.ndarray] | None = None) -> "DataContext":
        """`split_`: split(reader, cfg.train.eval_samples) when the caller has it already."""
        train, held = split_ if split_ is not None else split(reader, cfg.train.eval_samples)
        formatter = ChatFormatter(processor, max_length=cfg.train.max_length or None)
        first = reader.sample(train[0], tensors=False)
        _encode(formatter, [(first.prompt, first.caption)])  # a prompt over max_length: an error before any worker
        return cls(reader, plan, formatter, processor.image_processor, train, held, bucket_ids(reader))

    def describe_buckets(self) -> str:
        """'' for one latent shape, else each shape (h x w) with its training samples."""
        shapes, counts = np.unique(self.reader.latent_hw[self.train_indices], axis=0, return_counts=True)
        if len(shapes) < 2:
            return ""
        return "latent shapes (train samples): " + ", ".join(f"{h}x{w} ({n})" for (h, w), n in zip(shapes, counts))

    def dataset(self, cfg, indices: np.ndarray, epoch: int, flip: bool | None = None,
                partner: bool = False) -> CacheDataset:
        return CacheDataset(self.reader, indices, self.formatter, self.plan, cfg.image.resolution, cfg.image.resize,
                            self.image_processor, cfg.seed, epoch, flip, partner)


def _worker_init(_: int) -> None:
    # workers decode and tokenise; intra-op or tokenizer threads would only fight the training step
    torch.set_num_threads(1)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    ignore_in_workers()


def _loader(cfg, ctx: DataContext, dataset, **kw) -> DataLoader:
    workers = cfg.train.num_workers
    if workers:
        # The main process then maps a batch's shared memory by name. The default strategy (file descriptors) asks
        # the worker process for each descriptor over a socket when the batch is received: a round trip that waits
        # for the worker to be scheduled, on the training step's time (docs/performance.md).
        torch.multiprocessing.set_sharing_strategy("file_system")
    return DataLoader(dataset, num_workers=workers, pin_memory=torch.cuda.is_available(),
                      collate_fn=Collate(ctx.formatter), prefetch_factor=4 if workers else None,
                      worker_init_fn=_worker_init if workers else None, **kw)


def build_train_loader(cfg, ctx: DataContext, rank: int, world_size: int, epoch: int, start: int = 0) -> DataLoader:
    """Micro-batches of this process for `epoch` from global batch `start` on: accumulation_steps of them per step."""
    idx = rank_indices(ctx.train_indices, cfg.seed, epoch, cfg.train.global_batch_size, rank, world_size, start,
                       ctx.buckets[ctx.train_indices])
    return _loader(cfg, ctx, ctx.dataset(cfg, idx, epoch), batch_size=cfg.train.micro_batch_size, shuffle=False)


def build_eval_loader(cfg, ctx: DataContext, rank: int, world_size: int) -> DataLoader:
    """This process's share (positions rank, rank + W, ... of the held-out split) in batches of one latent shape, unflipped,
    each sample with the world of its partner (`eval_partners`) for the shuffled-world loss."""
    positions = np.arange(rank, len(ctx.eval_indices), world_size)
    size = cfg.train.eval_batch_size or cfg.train.micro_batch_size
    of = ctx.buckets[ctx.eval_indices[positions]]
    batches = []
    for k in np.unique(of):
        mine = positions[of == k].tolist()
        batches += [mine[i:i + size] for i in range(0, len(mine), size)]
    return _loader(cfg, ctx, ctx.dataset(cfg, ctx.eval_indices, 0, flip=False, partner=True), batch_sampler=batches)
