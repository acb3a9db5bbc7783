"""Data: the input sources (cached vs live inputs), the cache and its fingerprint, the dataset and the DataLoaders.

Which sample goes where (split, epoch order, per-process slices, flip seeds) is `train.order`; collation into one
packed buffer is `train.batches`. Tokenisation (a batch at a time), image decoding and the Gemma image processor run
inside DataLoader workers; the main process receives collated batches packed into one buffer (`Batch`).
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from theworld import cache_format as cf
from theworld.cache_format.fingerprint import rollout_keys
from theworld.cache_format.held_out import split
from theworld.cache_format.layout import world_steps
from theworld.config import trains
from theworld.control_text import TEXT_RULE, control_problem
from theworld.errors import CacheDamaged, CacheMismatch, UserError
from theworld.images import decode, load_for_vae, siglip_pixels
from theworld.inputs import PARTNER
from theworld.rollout import cache_seed, sample_seed
from theworld.text import DEFAULT_PROMPT, ChatFormatter
from train.batches import Collate, encode_texts
from train.mixture import Draw, MixedReader, partner_groups
from train.order import bucket_ids, eval_partners, flip_of, rank_indices
from train.preempt import ignore_in_workers

# ----------------------------------------------------------------------------------------------------------------------
# What each sample needs


@dataclass(frozen=True)
class InputSources:
    cached_latents: bool  # frozen VAE: latents from the cache; else live encoding of the stored image
    cached_siglip: bool  # frozen vision tower and SigLIP cached: features from the cache; else live pixels
    flip: bool
    members: tuple[str, ...]  # what the reader reads

    @property
    def needs_image(self) -> bool:
        return not (self.cached_latents and self.cached_siglip)


def input_sources(cfg, reader: cf.CacheReader) -> InputSources:
    """Decide cached vs live inputs from the freeze flags and what the cache holds; refuse impossible combinations."""
    present = set(reader.member_names())
    has_image = cf.IMAGE in present
    cached_latents = cfg.freeze.vae
    cached_siglip = (
        not trains(cfg.freeze, cfg.lora, "vision") and cfg.train.loader.cached_siglip and cf.SIGLIP in present
    )
    flip = cfg.train.loader.flip
    if cached_latents and cfg.world.latent == "sample" and cf.latents_stored(reader.manifest) == "mean":
        raise UserError(
            f"config key 'world.latent': 'sample' needs the posterior's logvar, but cache "
            f"{reader.cache_dir} stores the mean only (cache.latents: mean); use world.latent: mean, or "
            "a cache built with cache.latents: posterior"
        )
    if flip and cached_latents and cf.LATENT_FLIP not in present:
        raise UserError(
            f"config key 'train.loader.flip': cache {reader.cache_dir} has no flipped latents "
            "(build it with cache.flip: true, or set train.loader.flip: false)"
        )
    if flip and cached_siglip:
        raise UserError(
            "config key 'train.loader.flip': cached SigLIP features are unflipped; set "
            "train.loader.cached_siglip: false to compute image tokens live, or train.loader.flip: false"
        )
    wanted = {cf.LATENT} if cached_latents else set()
    if flip and cached_latents:
        wanted.add(cf.LATENT_FLIP)
    if cached_siglip:
        wanted.add(cf.SIGLIP)
    inputs = InputSources(cached_latents, cached_siglip, flip, ())
    if inputs.needs_image:
        if not has_image:
            what = "freeze.vae: false (live VAE encoding)" if not cached_latents else "live SigLIP pixels"
            raise UserError(
                f"cache {reader.cache_dir} keeps no images, which {what} needs (build it with cache.images: true)"
            )
        wanted.add(cf.IMAGE)
    return InputSources(cached_latents, cached_siglip, flip, tuple(sorted(wanted)))


# ----------------------------------------------------------------------------------------------------------------------
# The cache and its fingerprint


def open_cache(cfg) -> tuple[cf.CacheReader | MixedReader, InputSources]:
    """Open the cache (or each cache of a `data` mixture, read as one MixedReader) and check the fingerprint fields
    that need no model (before any model is loaded)."""
    readers, found = [], []
    for cache_dir, _ in cfg.caches():
        reader = cf.CacheReader(cache_dir, settings=cf.Settings.of(cfg))
        reader.check_consistency()  # sizes and keys only; every member's crc32 is checked as it is read
        if readers:
            check_same_layout(readers[0], reader)
        check_texts(reader)
        inputs = input_sources(cfg, reader)
        world_steps_note(cfg, reader, inputs)  # a cache with fewer world steps than the model uses: refused here
        check_rollout_settings(cfg, reader)
        if found and inputs != found[0]:
            raise UserError(
                f"config key 'data': caches {readers[0].cache_dir} and {reader.cache_dir} give different "
                f"inputs ({_inputs_text(found[0])} vs {_inputs_text(inputs)}): build them with the same cache "
                "options (cache.siglip, cache.flip, cache.images)"
            )
        fields = ["format_version", "image"] + (["vae"] if inputs.cached_latents else [])
        cf.check_fingerprint(
            reader.manifest.get("fingerprint") or {},
            cf.fingerprint_for(cfg.model, cfg.image),
            cache_dir,
            fields=fields,
            partial=True,
        )
        reader.members = inputs.members
        readers.append(reader), found.append(inputs)
    return (readers[0] if len(readers) == 1 else MixedReader(readers)), found[0]


def _inputs_text(inputs: InputSources) -> str:
    return "members " + ", ".join(inputs.members)


def world_steps_note(cfg, reader: cf.CacheReader | MixedReader, inputs: InputSources) -> str:
    """Cached latents hold the observed frame and `contents.world_steps` predicted ones: refuse a cache with fewer
    than world.num_world_steps; one with more is used through its first ones, which the returned start line says
    ('' otherwise). Live latents (an unfrozen VAE) do not read the cache's."""
    if not inputs.cached_latents:
        return ""
    have, want = world_steps(reader.manifest), cfg.world.num_world_steps
    frames = {s["shape"][1] for s in reader.manifest.get("latent_shapes") or [] if len(s.get("shape") or ()) == 4}
    if frames - {1 + have}:  # the manifest's own shapes (from the shards' sidecars) disagree with its world steps
        raise CacheDamaged(
            f"cache {reader.cache_dir}: its manifest says contents.world_steps {have} (latents of {1 + have} "
            f"frame(s)), but its samples' latents have {', '.join(map(str, sorted(frames)))} frame(s); "
            f"{cf.REBUILD_MANIFEST}"
        )
    if have == want:
        return ""
    if have < want:
        raise UserError(
            f"config key 'world.num_world_steps': the model uses {want} predicted frame(s) per sample, but cache "
            f"{reader.cache_dir} holds {have} (its contents.world_steps): build a cache with "
            f"world.num_world_steps: {want} (python -m precompute.cosmos_latents --set world.num_world_steps={want}), "
            f"or train with world.num_world_steps <= {have}"
        )
    return (
        f"note: cache {reader.cache_dir} holds {have} predicted frame(s) per sample after the observed one; "
        f"training uses the first {want} (world.num_world_steps {want})"
    )


def check_rollout_settings(cfg, reader: cf.CacheReader) -> None:
    """With world.num_world_steps > 0 the run's world.rollout is what rolls out live (an unfrozen VAE's batches,
    train.eval.benchmarks' images) and, saved with the model, what evaluate and describe roll out with later; a cache's
    rollouts were made with its fingerprint's `world` settings. Where they differ the model would meet predicted
    frames of one kind in its cache and another live: refused, naming each differing key with both values, also for
    a run that reads only cached latents (its saved settings would still be the wrong ones). The seed is the
    cache's in every live rollout (rollout.cache_seed), never the run's; a cache without rollouts has no settings."""
    world = (reader.manifest.get("fingerprint") or {}).get("world") or {}
    if not cfg.world.num_world_steps or not world:
        return
    run = cfg.world.rollout
    diff = [k for k in rollout_keys() if k in world and world[k] != getattr(run, k)]
    if diff:

        def values(get) -> str:
            return ", ".join(f"{k} {json.dumps(get(k))}" for k in diff)

        raise CacheMismatch(
            f"config key 'world.rollout': cache {reader.cache_dir} was rolled out with {values(world.get)}, but "
            f"this run gives {values(lambda k: getattr(run, k))}: set the cache's "
            f"({' '.join(f'--set world.rollout.{k}={json.dumps(world[k])}' for k in diff)}) or build a cache with "
            "the run's"
        )


def check_same_layout(first: cf.CacheReader, other: cf.CacheReader) -> None:
    """Refuse to mix caches whose world inputs differ in layout (image resolution and resize, latents kept, world
    steps: a batch's latents are stacked)."""

    def layout(r: cf.CacheReader) -> dict:
        image = (r.manifest.get("fingerprint") or {}).get("image") or {}
        return {
            "image.resolution": image.get("resolution"),
            "image.resize": image.get("resize"),
            "cache.latents": cf.latents_stored(r.manifest),
            "world steps": world_steps(r.manifest),
        }

    a, b = layout(first), layout(other)
    if diff := [k for k in a if a[k] != b[k]]:
        raise UserError(
            f"config key 'data': caches {first.cache_dir} and {other.cache_dir} have different world "
            f"layouts ({', '.join(f'{k} {a[k]} vs {b[k]}' for k in diff)}); a mixture needs one"
        )


def split_data(cfg, reader: cf.CacheReader | MixedReader) -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out) global indices: order.split of the cache, or of each cache of a mixture (train.eval.samples
    held out from each), offset into the mixture's index."""
    if not isinstance(reader, MixedReader):
        return split(reader, cfg.train.eval.samples)
    parts = [split(r, cfg.train.eval.samples) for r in reader.readers]
    return tuple(np.concatenate([p[k] + off for p, off in zip(parts, reader.offsets)]) for k in (0, 1))


def mixture_draw(cfg, reader: cf.CacheReader | MixedReader, train_indices: np.ndarray) -> Draw | None:
    """Each epoch's draw from a mixture's caches by weight (None for one cache)."""
    if not isinstance(reader, MixedReader):
        return None
    return Draw.build(reader, train_indices, [w for _, w in cfg.caches()], bucket_ids(reader))


def trained_prompt(reader: cf.CacheReader, train_indices: np.ndarray, look: int = 64) -> str:
    """The prompt the run trains with: the most common one among the first `look` training samples (a cache written
    from one source carries one prompt), recorded in final/ for describe and caption evaluation."""
    members, reader.members = reader.members, ()  # the caption and json alone
    try:
        prompts = [reader.sample(int(i), tensors=False).prompt for i in train_indices[:look]]
    finally:
        reader.members = members
    return Counter(prompts).most_common(1)[0][0] if prompts else DEFAULT_PROMPT


def check_texts(reader: cf.CacheReader) -> None:
    """Refuse a cache with a caption or prompt that holds a Gemma control string (theworld.control_text: the rule
    precompute applies). Shards whose sidecar records that precompute applied the rule are not read; in the others
    (written before it did) every sample's caption and json are read, before any model loads."""
    unchecked = [i for i, rule in enumerate(reader.text_rules) if rule != TEXT_RULE]
    if not unchecked:
        return
    members, reader.members = reader.members, ()  # the caption and json alone
    bad: list[tuple[int, str]] = []
    try:
        for index in reader.samples_in(unchecked).tolist():
            s = reader.sample(index, tensors=False)
            if problem := control_problem(s.caption, "caption") or control_problem(s.prompt, "prompt"):
                bad.append((index, problem))
    finally:
        reader.members = members
    if bad:
        index, problem = bad[0]
        shards = sorted({reader.shard_of(i) for i, _ in bad})
        sidecars = ", ".join(cf.sidecar_path(reader.cache_dir, i).name for i in shards[:3])
        first = cf.tar_path(reader.cache_dir, reader.shard_of(index)).name
        raise UserError(
            f"cache {reader.cache_dir}: {len(bad)} sample(s) hold a Gemma control string, which the model "
            f"would read as a control token, not text (first: shard {first}, sample {reader.key(index)}: "
            f"{problem}); the cache was built before precompute refused them: "
            f"to repair, delete {sidecars}{' ...' if len(shards) > 3 else ''} in "
            f"{reader.cache_dir / cf.SHARDS} and rerun the precompute command that built it (it rebuilds "
            "those shards alone, recording such samples in errors.jsonl)"
        )


def verify_fingerprint(cfg, model, processor, reader: cf.CacheReader | MixedReader, inputs: InputSources) -> None:
    """Full check against the loaded models (config digests and weight hashes), of each cache: format_version, image,
    and vae when cached latents are used, siglip when cached SigLIP features are used."""
    expected = cf.fingerprint_for(
        cfg.model,
        cfg.image,
        siglip=inputs.cached_siglip,
        vae=model.world_encoder.vae,
        gemma=model.gemma,
        processor=processor,
    )
    fields = (
        ["format_version", "image"]
        + (["vae"] if inputs.cached_latents else [])
        + (["siglip"] if inputs.cached_siglip else [])
    )
    for r in reader.readers if isinstance(reader, MixedReader) else [reader]:
        cf.check_fingerprint(r.manifest.get("fingerprint") or {}, expected, r.cache_dir, fields=fields)


# ----------------------------------------------------------------------------------------------------------------------
# Flip augmentation's text rule (docs/training.md, "Flip"): `left`/`right` (and `leftmost`/`rightmost`) are swapped,
# case kept, only where they name a side of the picture.
_SWAP = {"left": "right", "right": "left", "leftmost": "rightmost", "rightmost": "leftmost"}
SIDE_AFTER = frozenset(
    "of side sides half halves hand hands corner corners edge edges part parts portion portions "
    "quadrant quadrants third thirds column columns border margin wing".split()
)
SIDE_BEFORE = frozenset(
    "to on at from toward towards top bottom upper lower far center centre middle facing faces "
    "face looking looks pointing points turned turning turn turns leaning leans moving moves "
    "heading heads".split()
)
ARTICLES = frozenset("the its their his her a".split())
PREPOSITIONS = frozenset("to on at from toward towards in into onto near by off".split())
LINKS = frozenset(("and", "or", "to"))  # "left and right", "from right to left": both words swap
_WORD = re.compile(r"[A-Za-z']+")


def swap_left_right(text: str) -> str:
    """The caption of the mirrored picture: see the rule above and in docs/training.md."""
    words = list(_WORD.finditer(text))
    low = [m.group().lower() for m in words]

    def joined(i: int, j: int) -> bool:  # words i < j with nothing but spaces or hyphens between them
        return 0 <= i and j < len(words) and not text[words[i].end() : words[j].start()].strip(" -\t")

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
            if (
                0 <= lo
                and hi < len(low)
                and low[j] in _SWAP
                and low[lo + 1] in LINKS
                and joined(lo, lo + 1)
                and joined(lo + 1, hi)
            ):
                swap.add(j)
    out, end = [], 0
    for i in sorted(swap):
        m = words[i]
        word = _SWAP[low[i]]
        if m.group().isupper():
            word = word.upper()
        elif m.group()[0].isupper():
            word = word.capitalize()
        out += [text[end : m.start()], word]
        end = m.end()
    return "".join(out) + text[end:]


# ----------------------------------------------------------------------------------------------------------------------
# Dataset and collation (run in workers)


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
    ):
        """`rollouts`: the model rolls out live (world.num_world_steps > 0 without cached latents): each sample
        carries its rollout seed (`rollout_seed`)."""
        self.reader, self.indices, self.formatter, self.inputs = reader, indices, formatter, inputs
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
        index = int(self.indices[pos])
        raw = self.reader.raw(index)
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
                item["rollout_seeds"] = torch.tensor(rollout_seed(self.reader, index))
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
        image = self.reader.decode(index, self.reader.raw(index), tensors=False).image
        item = {PARTNER + "images": load_for_vae(image, self.resolution, self.resize)[0]}
        if self.rollouts:
            item[PARTNER + "rollout_seeds"] = torch.tensor(rollout_seed(self.reader, index))
        return item


def rollout_seed(reader: cf.CacheReader | MixedReader, index: int) -> int:
    """The seed of sample `index`'s live rollout: its cache's seed (`rollout.cache_seed`) and its key, the rule the
    precompute that wrote (or would write) its rollouts used, so a live rollout in training equals the cached one."""
    if isinstance(reader, MixedReader):  # each cache of a mixture has its own seed
        reader, index = reader.locate(index)
    return sample_seed(cache_seed(reader.manifest), reader.key(index))


@dataclass
class DataContext:
    """Everything a loader needs besides (rank, world_size, epoch, start): built once per run."""

    reader: cf.CacheReader
    inputs: InputSources
    formatter: ChatFormatter
    image_processor: object
    train_indices: np.ndarray
    eval_indices: np.ndarray
    buckets: np.ndarray  # (len(reader),) each sample's bucket (latent shape)
    draw: Draw | None = None  # a mixture's per-epoch draw from its caches
    truncation: str = ""  # with train.loader.max_length: how many training samples it shortens (start line)

    @classmethod
    def build(
        cls,
        cfg,
        reader: cf.CacheReader,
        inputs: InputSources,
        processor,
        split_: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> DataContext:
        """`split_`: split(reader, cfg.train.eval.samples) when the caller has it already."""
        train, held = split_ if split_ is not None else split(reader, cfg.train.eval.samples)
        formatter = ChatFormatter(processor, max_length=cfg.train.loader.max_length or None)
        first = reader.sample(train[0], tensors=False)
        encode_texts(formatter, [first.turns])  # a prompt over max_length: an error before any worker
        truncation = truncation_report(formatter, reader, train) if formatter.max_length else ""
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
        )

    def epoch_samples(self, seed: int, epoch: int) -> np.ndarray:
        """The training samples epoch `epoch` orders: all of them, or a mixture's draw."""
        return self.train_indices if self.draw is None else self.draw.epoch(seed, epoch)

    def describe_mixture(self, cfg) -> str:
        return "" if self.draw is None else self.draw.describe(self.reader, [w for _, w in cfg.caches()])

    def describe_buckets(self) -> str:
        """'' for one latent shape, else each shape (h x w) with its training samples."""
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
        )


def truncation_report(formatter: ChatFormatter, reader: cf.CacheReader, indices: np.ndarray, chunk: int = 1024) -> str:
    """The start line on what train.loader.max_length does to the samples at `indices`: conversations that lose whole
    turns from their end, and samples whose (first) answer is cut. Reads and tokenises every sample's text once."""
    members, reader.members = reader.members, ()  # the caption and json alone
    shortened = dropped_turns = cut = 0
    try:
        for lo in range(0, len(indices), chunk):
            convs = [reader.sample(int(i), tensors=False).turns for i in indices[lo : lo + chunk]]
            for c in (c for c in convs if len(c) > 1):
                kept = formatter.encode_turns(c)[1]
                shortened += kept < len(c)
                dropped_turns += len(c) - kept
            # a first turn over max_length, alone or all that is left of a conversation: its answer is cut
            firsts = formatter.conversation_ids([c[0] for c in convs])
            cut += sum(len(ids) > formatter.max_length for ids in firsts)
    finally:
        reader.members = members
    return (
        f"train.loader.max_length {formatter.max_length}: {shortened} conversation(s) shortened ({dropped_turns} "
        f"turn(s) dropped from their ends), {cut} sample(s) with the first answer cut, of {len(indices)} training "
        "samples"
    )


def _worker_init(_: int) -> None:
    # workers decode and tokenise; intra-op or tokenizer threads would only fight the training step
    torch.set_num_threads(1)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    ignore_in_workers()


def _loader(cfg, ctx: DataContext, dataset, **kw) -> DataLoader:
    workers = cfg.train.loader.num_workers
    if workers:
        # The main process then maps a batch's shared memory by name. The default strategy (file descriptors) asks
        # the worker process for each descriptor over a socket when the batch is received: a round trip that waits
        # for the worker to be scheduled, on the training step's time (docs/performance.md).
        torch.multiprocessing.set_sharing_strategy("file_system")
    return DataLoader(
        dataset,
        num_workers=workers,
        pin_memory=torch.cuda.is_available(),
        collate_fn=Collate(ctx.formatter),
        prefetch_factor=4 if workers else None,
        worker_init_fn=_worker_init if workers else None,
        **kw,
    )


def build_train_loader(cfg, ctx: DataContext, rank: int, world_size: int, epoch: int, start: int = 0) -> DataLoader:
    """Micro-batches of this process for `epoch` from global batch `start` on: accumulation_steps of them per step."""
    samples = ctx.epoch_samples(cfg.seed, epoch)
    idx = rank_indices(
        samples, cfg.seed, epoch, cfg.train.global_batch_size, rank, world_size, start, ctx.buckets[samples]
    )
    return _loader(cfg, ctx, ctx.dataset(cfg, idx, epoch), batch_size=cfg.train.micro_batch_size, shuffle=False)


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
