"""Data: the input sources (cached vs live inputs), the cache and its fingerprint, the dataset and the DataLoaders.

Which sample goes where (split, epoch order, per-process slices, flip seeds) is `train.order`; collation into one
packed buffer is `train.batches`. Tokenisation (a batch at a time), image decoding and the Gemma image processor run
inside DataLoader workers; the main process receives collated batches packed into one buffer (`Batch`).
"""

from __future__ import annotations

import json
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from theworld import cache_format as cf
from theworld.cache_format.fingerprint import recorded, rollout_keys
from theworld.cache_format.held_out import Kept, split, split_parts
from theworld.cache_format.layout import world_steps
from theworld.core.errors import CacheDamaged, CacheMismatch, UserError
from theworld.model.config import DEFAULT_PROMPT, trains
from theworld.model.control_text import TEXT_RULE, control_problem
from train.data.mixture import Draw, MixedReader
from train.data.order import bucket_ids

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
    caches = [c for c, _ in cfg.caches()]
    for cache_dir, reader in zip(caches, open_readers(caches, cfg.storage)):
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


OPEN_AT_ONCE = 8  # caches of a mixture opened at once


def open_readers(caches: list[str], settings: cf.Settings) -> list[cf.CacheReader]:
    """Each cache opened and its consistency checked (sizes and keys only; every member's crc32 is checked as it is
    read). A mixture's caches open at once: each open is rounds of requests to its bucket (a dataset in parts, as
    DataComp-1B's plan writes it, is 8 or more caches). The first cache, in the given order, that fails raises."""

    def one(cache: str) -> cf.CacheReader:
        reader = cf.CacheReader(cache, settings=settings)
        reader.check_consistency()
        return reader

    if len(caches) == 1:
        return [one(caches[0])]
    with ThreadPoolExecutor(min(len(caches), OPEN_AT_ONCE)) as pool:
        return list(pool.map(one, caches))


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


def window_note(settings: cf.Settings, reader: cf.CacheReader | MixedReader) -> str:
    """The start line for caches at URLs larger than this node's shard cache read in the global order, which touches
    nearly every shard in every batch and so downloads most of them many times an epoch; the window that reads the
    cache about once an epoch instead (docs/cache-format.md, "Object storage"). '' otherwise."""
    remote = [r for r in getattr(reader, "readers", [reader]) if r.remote is not None]
    total, budget = sum(int(r.shard_table.bytes.sum()) for r in remote), settings.budget
    if settings.shuffle_window or total <= budget:
        return ""
    shards = sum(len(r.shard_table) for r in remote)
    window = max(1, int(budget / 4 / (total / shards)))  # a quarter of the shard cache, read-ahead beside it
    urls = ", ".join(r.remote.url for r in remote)
    return (
        f"note: {urls} hold(s) {total / 1e9:.3g} GB, more than this node's shard cache (storage.local_max_gb "
        f"{settings.local_max_gb:g}): in the global order (storage.shuffle_window 0) an epoch downloads most shards "
        f"many times over; --set storage.shuffle_window={window} reads {window} shard(s) at a time and downloads "
        "the cache about once an epoch"
    )


def node_groups_note(cfg, reader: cf.CacheReader | MixedReader, nodes: int) -> str:
    """The start line on what each of `nodes` nodes downloads of a cache at a URL read in a window of shards: with
    storage.node_groups, how many of its groups a node reads (processes take contiguous slices of each global batch,
    a node's processes one after another); without, that every node downloads every shard and the setting that
    splits them. '' otherwise."""
    settings, g = cfg.storage, cfg.train.global_batch_size
    remote = [r for r in getattr(reader, "readers", [reader]) if r.remote is not None]
    if not remote or not settings.shuffle_window or nodes < 2 and settings.node_groups == 1:
        return ""
    if settings.node_groups == 1:
        if g % nodes or settings.shuffle_window % nodes or cfg.data and not cfg.joined:
            return ""
        return (
            f"note: each of the {nodes} nodes downloads every shard of each window (the cache {nodes} times an epoch "
            f"from the bucket); --set storage.node_groups={nodes} gives each node its own {1 / nodes:.0%} of the shards"
        )
    c, part = settings.node_groups, g // settings.node_groups
    if c % nodes == 0:
        return f"order: storage.node_groups {c} over {nodes} node(s): each node reads {c // nodes} group(s) of shards"
    # node n's processes hold positions [n g / nodes, (n + 1) g / nodes) of each batch; part k is group k's
    most = max(((n + 1) * g // nodes - 1) // part - n * g // nodes // part + 1 for n in range(nodes))
    return (
        f"note: storage.node_groups {c} does not divide among {nodes} nodes: a node reads up to {most} of the {c} "
        f"groups of shards; a multiple of {nodes} gives each node its own"
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
    had = lambda k: recorded(world, k)  # noqa: E731
    diff = [k for k in rollout_keys() if had(k) is not None and had(k) != getattr(run, k)]
    if "condition" in diff:  # the rule first: the prompt does not matter where the questions condition
        diff = ["condition"]
    if diff:

        def values(get) -> str:
            return ", ".join(f"{k} {json.dumps(get(k))}" for k in diff)

        raise CacheMismatch(
            f"config key 'world.rollout': cache {reader.cache_dir} was rolled out with {values(had)}, but "
            f"this run gives {values(lambda k: getattr(run, k))}: set the cache's "
            f"({' '.join(f'--set world.rollout.{k}={json.dumps(had(k))}' for k in diff)}) or build a cache with "
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
    """(train, held-out) global indices: held_out.split of the cache, or of each cache of a mixture by weight
    (train.eval.samples held out from each), offset into the mixture's index, or of the parts of one dataset as one."""
    if not isinstance(reader, MixedReader):
        return split(reader, cfg.train.eval.samples)
    if cfg.joined:  # the parts of one dataset: held out of it as one cache of their samples would be
        return split_parts(reader.readers, cfg.train.eval.samples)
    held = np.concatenate([split(r, cfg.train.eval.samples)[1] + o for r, o in zip(reader.readers, reader.offsets)])
    return Kept(len(reader), held), held  # the training samples: every other one, not an array over them


def mixture_draw(cfg, reader: cf.CacheReader | MixedReader, train_indices: np.ndarray) -> Draw | None:
    """Each epoch's draw from a mixture's caches by weight (None for one cache, or caches read as one: cfg.joined)."""
    if not isinstance(reader, MixedReader) or cfg.joined:
        return None
    return Draw.build(reader, train_indices, [w for _, w in cfg.caches()], bucket_ids(reader))


def trained_prompt(reader: cf.CacheReader, train_indices: np.ndarray, look: int = 64) -> str:
    """The prompt the run trains with: the most common one among the first `look` training samples (a cache written
    from one source carries one prompt), recorded in final/ for describe and caption evaluation."""
    prompts = [reader.text(int(i)).prompt for i in train_indices[:look]]
    return Counter(prompts).most_common(1)[0][0] if prompts else DEFAULT_PROMPT


def check_texts(reader: cf.CacheReader) -> None:
    """Refuse a cache with a caption or prompt that holds a Gemma control string (theworld.model.control_text: the rule
    precompute applies). Shards whose sidecar records that precompute applied the rule are not read; in the others
    (written before it did) every sample's caption and json are read, before any model loads."""
    unchecked = [i for i, rule in enumerate(reader.text_rules) if rule != TEXT_RULE]
    if not unchecked:
        return
    bad: list[tuple[int, str]] = []
    for index in reader.samples_in(unchecked).tolist():
        s = reader.text(index)
        if problem := control_problem(s.caption, "caption") or control_problem(s.prompt, "prompt"):
            bad.append((index, problem))
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
