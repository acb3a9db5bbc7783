"""The precompute run (`run(cfg)`, what `python -m precompute.cosmos_latents` runs once its config is checked): the
frozen encoders' outputs into a crash-safe WebDataset cache, shard i on process i % world_size.

DataLoader workers read and resize images (uint8, so little crosses process boundaries); the main process encodes in
batches of one input shape that never straddle a shard (each shard's samples grouped by aspect-ratio bucket, so a
latent does not depend on how shards are spread over processes); a writer
thread turns finished shards into tars so encoding never waits for the disk. A shard is done iff its sidecar matches
its tar; a rerun after a crash redoes only the shards that are not, and rank 0 writes errors.jsonl and then the
manifest from the sidecars once every process is through.
"""

from __future__ import annotations

import errno
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from precompute import identity, sources
from precompute.config import PrecomputeConfig
from precompute.entry_dataset import EntryDataset, collate
from precompute.shard_writer import ShardWriter
from theworld import cache_format as cf
from theworld.cache_format import storage
from theworld.core import location, run_lock
from theworld.core.config import to_dict
from theworld.core.errors import UserError, as_shown
from theworld.core.process_group import process_group, shared_folder_check
from theworld.model import encoders, images
from theworld.model.arch import latent_side
from theworld.model.rollout import Rollout, sample_inputs, with_predicted

# ----------------------------------------------------------------------------------------------------------------------
# The run


def load_frozen(cfg: PrecomputeConfig) -> tuple:
    """(VAE, Gemma, processor, fingerprint, rollout): the models this config's cache is made with (Gemma and its
    processor None without cache.siglip, the Video2World pipeline None without world.num_world_steps) and the
    fingerprint they give it."""
    vae = encoders.load_vae(cfg.model.vae, cfg.model.dtype)
    gemma = processor = rollout = None
    if cfg.world.num_world_steps:
        rollout = Rollout.load(cfg.model.vae, cfg.model.dtype, vae, cfg.world.num_world_steps, cfg.world.rollout)
    if cfg.cache.siglip:
        gemma, processor = encoders.load_gemma(cfg.model.gemma, cfg.model.dtype)
    fp = cf.fingerprint_for(
        cfg.model,
        cfg.image,
        siglip=cfg.cache.siglip,
        vae=vae,
        gemma=gemma,
        processor=processor,
        world=cfg.world,
        rollout=rollout,
        seed=cfg.seed,
    )
    return vae, gemma, processor, fp, rollout


def _load_models(cfg: PrecomputeConfig, device: torch.device):
    vae, gemma, processor, fp, rollout = load_frozen(cfg)
    encoder = encoders.WorldEncoder(vae).to(device).eval()
    if gemma is not None:
        gemma = gemma.to(device).eval()
    if rollout is not None:
        rollout = rollout.to(device)
    return encoder, gemma, processor, fp, rollout


@torch.no_grad()
def encode_latents(encoder, pixels: torch.Tensor, cfg: PrecomputeConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, logvar) of a batch of uint8 pixels as float32 CPU tensors. A compiled encoder sees one input shape:
    a short batch is padded to `batch_size`, as a new shape would recompile it (docs/performance.md)."""
    n = len(pixels)
    if cfg.compile and n < cfg.batch_size:
        pixels = torch.cat([pixels, pixels.new_zeros(cfg.batch_size - n, *pixels.shape[1:])])
    mean, logvar = (t[:n].float().cpu() for t in encoder(pixels))
    return mean, logvar


class BucketBatcher:
    """Encoder batches of one shape: each shard's good samples are grouped by input shape (aspect-ratio bucket) in
    source order, and a group is encoded when it holds `batch_size` samples or its shard is complete. So a bucketed
    shard costs one encoder call per `batch_size` samples of a shape, not one per shape in every loader batch (a
    compiled encoder also sees fewer short, padded batches), and a sample's batch-mates are a function of its shard
    alone, whatever the process or worker count. Pixels wait on the device, at most batch_size - 1 per shape."""

    def __init__(self, encoder, cfg: PrecomputeConfig, rollout: Rollout | None = None):
        self.encoder, self.cfg, self.rollout = encoder, cfg, rollout
        self.groups: dict[tuple, list[tuple[cf.Sample, torch.Tensor]]] = {}  # (shard, shape) -> waiting samples

    def add(self, shard: int, samples: list[cf.Sample], pixels: torch.Tensor) -> None:
        """Samples of `shard` with their (n, 3, H, W) uint8 pixels, all of one shape."""
        group = self.groups.setdefault((shard, tuple(pixels.shape[1:])), [])
        for s, p in zip(samples, pixels):
            group.append((s, p))
            if len(group) == self.cfg.batch_size:
                self._encode(group)
                group.clear()

    def flush(self, shard: int) -> None:
        """Encode what is left of `shard`'s groups (shapes in sorted order)."""
        for key in sorted(k for k in self.groups if k[0] == shard):
            self._encode(self.groups.pop(key))

    @torch.no_grad()
    def _encode(self, group: list[tuple[cf.Sample, torch.Tensor]]) -> None:
        if not group:
            return
        pixels = torch.stack([p for _, p in group])
        mean, logvar = encode_latents(self.encoder, pixels, self.cfg)
        if self.rollout is not None:  # each sample's noise from (seed, key): its batch-mates do not matter
            seeds, questions = sample_inputs(self.rollout.condition, self.cfg.seed, [s for s, _ in group])
            mean, logvar = with_predicted(mean, logvar, self.rollout(pixels, seeds, questions).cpu())
        flip = encode_latents(self.encoder, pixels.flip(-1), self.cfg) if self.cfg.cache.flip else None
        keep_logvar = self.cfg.cache.latents != "mean"
        for j, (s, _) in enumerate(group):
            s.mean, s.logvar = mean[j], logvar[j] if keep_logvar else None
            if flip is not None:
                s.flip_mean, s.flip_logvar = flip[0][j], flip[1][j] if keep_logvar else None


@torch.no_grad()
def _samples(batch: dict, gemma, device) -> list[cf.Sample]:
    """Samples for the batch's good items, in order, without latents (BucketBatcher adds them); SigLIP features are
    computed here, a loader batch at a time (their input has one shape)."""
    good = [b for b in batch["items"] if b["error"] is None]
    out = [cf.Sample(key=b["key"], caption=b["caption"], meta=b["meta"], image=b.get("image")) for b in good]
    if gemma is not None and good:
        pv = batch["pixel_values"].to(device, gemma.dtype, non_blocking=True)
        feats = gemma.model.get_image_features(pixel_values=pv).pooler_output.float().cpu()
        for s, f in zip(out, feats):
            s.siglip = f
    return out


def _process_shards(
    cfg: PrecomputeConfig,
    listing: sources.Listing,
    pending: list[int],
    out: Path,
    encoder,
    gemma,
    processor,
    device,
    show: bool,
    publish: Callable[[int], None] | None = None,
    rollout: Rollout | None = None,
) -> tuple[int, int, dict]:
    """Encode and write the `pending` shards; returns how many images were encoded, how many of them were smaller
    than the resolution (upscaled: their crop box is under it on a side), and where the main loop's time
    went: waiting for decoded batches (decode-bound), encoding (device-bound), waiting for the shard writer
    (disk-bound), plus the writer thread's own serialise-and-write time."""
    from tqdm import tqdm

    S, B = cfg.shard_size, cfg.batch_size
    bounds = {i: (i * S, min((i + 1) * S, len(listing))) for i in pending}
    # Batches never straddle a shard: a sample's batch-mates are the same whatever the process count.
    batches = [list(range(a, min(a + B, hi))) for i in pending for lo, hi in [bounds[i]] for a in range(lo, hi, B)]
    dataset = EntryDataset(listing, cfg, processor.image_processor if processor is not None else None)
    loader = DataLoader(
        dataset,
        batch_sampler=batches,
        collate_fn=collate,
        num_workers=cfg.num_workers,
        prefetch_factor=4 if cfg.num_workers else None,
        persistent_workers=False,
        pin_memory=device.type == "cuda",
    )
    writer = ShardWriter(out, cfg.cache.dtype, publish)
    batcher = BucketBatcher(encoder, cfg, rollout)
    buffers: dict[int, dict] = {}
    encoded = upscaled = 0
    seconds = dict.fromkeys(("wait_for_batches", "encode", "wait_for_writer"), 0.0)
    bar = tqdm(
        total=sum(hi - lo for lo, hi in bounds.values()),
        unit="img",
        disable=not show,
        dynamic_ncols=True,
        desc="precompute",
        file=sys.stderr,
    )
    t = time.perf_counter()
    try:
        for batch in loader:
            seconds["wait_for_batches"] += (t1 := time.perf_counter()) - t
            i = batch["items"][0]["pos"] // S  # a batch never straddles a shard
            buf = buffers.setdefault(i, {"samples": [], "errors": [], "left": bounds[i][1] - bounds[i][0]})
            samples = _samples(batch, gemma, device)
            for rows, pixels in batch["pixels"]:  # one tensor per shape
                batcher.add(i, [samples[j] for j in rows.tolist()], pixels.to(device, non_blocking=True))
            buf["left"] -= len(batch["items"])
            if buf["left"] == 0:
                batcher.flush(i)  # waits for the device
            seconds["encode"] += (t2 := time.perf_counter()) - t1
            buf["samples"] += samples
            buf["errors"] += [
                {"key": b["key"], "source": b["source"], "reason": b["error"], "shard": i}
                for b in batch["items"]
                if b["error"] is not None
            ]
            upscaled += sum(images.upscaled(s.meta, cfg.image.resolution, cfg.image.resize) for s in samples)
            encoded += len(samples)
            if buf["left"] == 0:
                writer.put(i, buf["samples"], buf["errors"])  # blocks while 2 shards are queued
                del buffers[i]
            bar.update(len(batch["items"]))
            seconds["wait_for_writer"] += (t := time.perf_counter()) - t2
    finally:
        bar.close()
        writer.close()
    seconds["wait_for_writer"] += time.perf_counter() - t  # the last shards
    seconds["writer_thread_busy"] = writer.write_seconds
    return encoded, upscaled, {k: round(v, 3) for k, v in seconds.items()}


def _finish(
    cfg: PrecomputeConfig,
    out: Path,
    n_shards: int,
    run_id: dict,
    latent_shape: list[int],
    hint: Callable[[], str] = lambda: "",
    remote: storage.RemoteWriter | None = None,
) -> dict:
    """Rank 0, after everyone is done: errors.jsonl and the manifest, both from the per-shard files (for a remote
    output_dir, fetched from it first; both put back, the manifest last)."""
    if remote is not None:
        identity.check_remote_claim(remote, out)  # a store without exclusive creates: checked again here
        remote.fetch_records(n_shards)
    sidecars = []
    for i in range(n_shards):
        side = cf.read_sidecar(out, i)
        if side is None or not cf.error_path(out, i).is_file():
            raise RuntimeError(f"shard {i} is missing after all processes finished")
        sidecars.append(side)
    errors = b"".join(cf.error_path(out, i).read_bytes() for i in range(n_shards))
    cf.atomic_write_bytes(out / cf.ERRORS, errors)
    num_errors = errors.count(b"\n")
    if not sum(s["count"] for s in sidecars):  # a cache nothing can train on: no manifest, so nothing looks finished
        raise UserError(
            f"no usable sample in {cfg.source.type} source: all {run_id['num_entries']} inputs failed "
            f"({_reasons(out)}; each in {out / cf.ERRORS})" + (f"; {h}" if (h := hint()) else "")
        )
    manifest = cf.write_manifest(
        out,
        sidecars,
        fingerprint=run_id["fingerprint"],
        latent_shape=latent_shape,
        latent_dtype=cfg.cache.dtype,
        num_errors=num_errors,
        contents={
            "images": cfg.cache.images,
            "siglip": cfg.cache.siglip,
            "flip": cfg.cache.flip,
            **({"latents": "mean"} if cfg.cache.latents == "mean" else {}),  # absent: the posterior
            **({"world_steps": cfg.world.num_world_steps} if cfg.world.num_world_steps else {}),  # absent: 0
        },
        extra={
            "source": run_id["source"],
            "shard_size": cfg.shard_size,
            "num_entries": run_id["num_entries"],
            "config": to_dict(cfg),
        },
    )
    if remote is not None:
        remote.finish()
    return manifest


def _compile_encoder(encoder, cfg: PrecomputeConfig, device: torch.device) -> float:
    """Compile before the clock starts, at the square batch shape (crop and squash: the only one `BucketBatcher`
    passes): the first call traces and compiles (its time at 512 px on an H100: docs/performance.md)."""
    t = time.perf_counter()
    r = cfg.image.resolution
    with torch.no_grad():
        encoder(torch.zeros(cfg.batch_size, 3, r, r, dtype=torch.uint8, device=device))
    return round(time.perf_counter() - t, 3)


def run(cfg: PrecomputeConfig) -> dict:
    """Build (or finish) the cache at cfg.output_dir; returns the manifest plus a "summary" of this run."""
    cfg.validate_paths()
    state = process_group()
    where = location.place(cfg.output_dir, "config key 'output_dir':")
    remote = storage.for_writing(cfg.output_dir, cfg.storage) if isinstance(where, location.Remote) else None
    out = remote.out if remote else Path(cfg.output_dir)
    if remote is not None:  # the run record (or nothing) in the stand-in folder, before it is checked
        if state.is_local_main_process:
            remote.prepare()
        state.wait_for_everyone()
    # before listing the source or loading a model: output_dir holds nothing built by another config (a webdataset
    # listing would otherwise be written into another cache's folder)
    identity.check_identity(out, identity.layout_identity(cfg))
    # one run per output_dir (a second one would delete this run's unfinished shards as a killed run's leftovers);
    # taking the lock creates the folder, or says why it cannot be written
    fresh = not out.exists()
    with run_lock.hold(out, state):
        # every process writes its shards there: a node with a folder of its own is refused before any model loads
        # (a URL's stand-in folder is per node by design: every node puts its shards into the same object store)
        if remote is None:
            shared_folder_check(state, out, (out / run_lock.LOCK_FILE).is_file(), "output_dir")
        try:
            return _build(cfg, state, out, remote)
        except UserError:
            if fresh and state.is_main_process:
                _forget_listing(out)
            raise
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            raise UserError(
                f"no space left on device writing {e.filename or out}: free some space and rerun the same "
                "command (finished shards are kept, the unfinished one is redone)"
            ) from None


def _reasons(out: Path) -> str:
    return ", ".join(f"{n} {reason}" for reason, n in cf.error_classes(out).items()) or "no reason recorded"


def _forget_listing(out: Path) -> None:
    """A refused run into a folder it created: before any shard exists, what it wrote is only the source's listing
    (and the empty folders and run record claim_output made), which goes with it."""
    if any((out / cf.SHARDS).glob("*")):
        return
    shutil.rmtree(out / cf.INDEX_DIR, ignore_errors=True)
    (out / cf.RUN_FILE).unlink(missing_ok=True)


def _build(cfg: PrecomputeConfig, state, out: Path, remote: storage.RemoteWriter | None) -> dict:
    """run() with output_dir held (for a remote output_dir, its stand-in folder)."""
    from accelerate.utils import gather_object

    rank, world = state.process_index, state.num_processes
    t0 = time.time()
    # Collective for webdataset sources: each tar is header-scanned by one process, once per output_dir.
    listing = sources.open_source(
        cfg.source,
        cfg.seed,
        cfg.image.resolution,
        index_dir=out / cf.INDEX_DIR,
        rank=rank,
        world=world,
        barrier=state.wait_for_everyone,
    )
    if not len(listing):
        raise UserError(f"config key 'source.path': no samples found in {cfg.source.path or cfg.source.name}")
    encoder, gemma, processor, fingerprint, rollout = _load_models(cfg, state.device)
    encoder.optimize_for_inference(channels_last=state.device.type == "cuda", compile=cfg.compile)
    if state.device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # every batch has the same shape: pick the fastest conv kernels once
    run_id = identity.run_identity(cfg, fingerprint, len(listing))
    identity.check_identity(out, run_id)
    n_shards = -(-len(listing) // cfg.shard_size)
    if rank == 0:
        identity.claim_output(out, run_id)
        if remote is not None:
            identity.claim_remote(remote, out)
    state.wait_for_everyone()
    pending = _pending(out, range(rank, n_shards, world), remote)
    if pending and (out / cf.MANIFEST).exists():
        (out / cf.MANIFEST).unlink(missing_ok=True)  # a shard went missing: the cache is not complete any more
    if pending and remote is not None:
        remote.incomplete()
    compile_s = _compile_encoder(encoder, cfg, state.device) if cfg.compile and pending else 0.0
    t_enc = time.time()
    encoded, upscaled, seconds = (
        _process_shards(
            cfg,
            listing,
            pending,
            out,
            encoder,
            gemma,
            processor,
            state.device,
            show=state.is_main_process,
            publish=remote.publish if remote else None,
            rollout=rollout,
        )
        if pending
        else (0, 0, {})
    )
    if remote is not None:  # this process's records in one object, for rank 0's final step
        remote.put_records(rank, range(rank, n_shards, world))
    counts = gather_object([encoded]) if world > 1 else [encoded]
    upscaled = sum(gather_object([upscaled])) if world > 1 else upscaled
    state.wait_for_everyone()
    elapsed = time.time() - t_enc
    side, frames = latent_side(cfg.image.resolution), 1 + cfg.world.num_world_steps
    latent_shape = [encoder.vae.config.z_dim, frames, side, side]
    empty = None
    if rank == 0:
        try:
            _finish(cfg, out, n_shards, run_id, latent_shape, listing.failure_hint, remote)
        except UserError as e:
            empty = e
    if world > 1:  # every process stops on rank 0's verdict, with its line
        empty = gather_object([str(empty) if empty else None])[0]
        empty = UserError(empty) if empty else None
    state.wait_for_everyone()
    if empty is not None:
        raise empty
    manifest = cf.load_manifest(out)
    summary = {
        "samples": manifest["num_samples"],
        "errors": manifest["num_errors"],
        "shards": n_shards,
        "bytes": manifest["bytes"],
        "encoded_this_run": sum(counts),
        "processes": world,
        "encode_seconds": round(elapsed, 3),
        "total_seconds": round(time.time() - t0, 3),
        "images_per_s": images_per_s(sum(counts), elapsed),
        "upscaled_this_run": upscaled,
        "resolution": cfg.image.resolution,
        "compile_seconds": compile_s,
        "seconds_rank0": seconds,
    }
    if state.is_main_process:
        _print_summary(summary, out)
    return {**manifest, "summary": summary}


def _pending(out: Path, mine: range, remote: storage.RemoteWriter | None) -> list[int]:
    """This process's shards that are not done. For a remote output_dir, done means up in the bucket; a shard
    finished here but not put (a run killed during its upload) is put now, not encoded again."""
    local_done = lambda i: cf.error_path(out, i).is_file() and cf.shard_is_done(out, i)
    if remote is None:
        return [i for i in mine if not local_done(i)]
    up = remote.done()
    pending = []
    for i in (i for i in mine if i not in up):
        if local_done(i):
            remote.publish(i)
        else:
            pending.append(i)
    return pending


def images_per_s(n: int, seconds: float) -> float:
    """Three significant digits, so a slow run shows its rate (0.0333), not 0.0."""
    return float(f"{n / seconds:.3g}") if seconds > 0 and n else 0.0


def _print_summary(s: dict, out: Path) -> None:
    reasons = cf.error_classes(out)
    print(
        f"precompute: {s['samples']} samples, {s['errors']} errors, {s['bytes'] / 1e6:.1f} MB in {s['shards']} "
        f"shards ({s['bytes'] / max(1, s['samples']) / 1e3:.1f} kB/sample); this run encoded {s['encoded_this_run']} "
        f"images in {s['encode_seconds']:.1f} s = {s['images_per_s']:g} images/s on {s['processes']} process(es)"
        + (f" ({s['upscaled_this_run']} smaller than {s['resolution']} px, upscaled)" if s["upscaled_this_run"] else "")
        + f" -> {as_shown(str(out))}"
        + (f"; errors: {reasons}" if reasons else "")
        + (f" (after {s['compile_seconds']:.1f} s compiling the encoder)" if s["compile_seconds"] else ""),
        flush=True,
    )
    if s["seconds_rank0"]:
        print(
            "precompute: main loop seconds: "
            + ", ".join(f"{k.replace('_', ' ')} {v:.1f}" for k, v in s["seconds_rank0"].items()),
            flush=True,
        )
