"""Look inside a latent cache.

    python -m precompute.inspect summary CACHE [--json]
    python -m precompute.inspect verify CACHE [--json]
    python -m precompute.inspect compare-live CACHE --n N [--json] [--config CFG] [--set key=value ...]
    python -m precompute.inspect decode CACHE --n N --out sheet.png [--json] [--config CFG] [--set ...]

Exit codes: 0 fine, 1 verify/compare found a problem, 2 a user mistake (no cache, fingerprint mismatch, bad args).
compare-live and decode need the VAE: by default the one named in the cache's fingerprint (model id and dtype);
--config/--set override it, and a VAE that would not reproduce the cache is refused, naming the differing field.
With --config, summary and verify check the fingerprint too. On a rollout cache (contents.world_steps N > 0),
compare-live reruns each sample's rollout with the cache's seed and settings (theworld/model/rollout.py), and decode
shows
each sample's rollout as a filmstrip: the original, then the decoded observed frame and the N predicted ones.
"""

from __future__ import annotations

import json
import math
import random
import sys
import tarfile
import zlib
from pathlib import Path

import torch

from precompute import fonts
from precompute.config import PrecomputeConfig
from theworld import cache_format as cf
from theworld.cache_format.layout import world_steps
from theworld.core import atomic, location, paths
from theworld.core.config import ArgParser, add_config_args, load_config
from theworld.core.errors import CacheDamaged, UserError, as_shown, cli_entry, one_line
from theworld.model import encoders, images
from theworld.model.rollout import Rollout, observed_and_predicted, sample_inputs

# ----------------------------------------------------------------------------------------------------------------------
# Models and fingerprints


def _config_for(manifest: dict, args) -> PrecomputeConfig:
    """The config whose models should reproduce this cache: the fingerprint's, overridden by --config/--set."""
    base = cf.fingerprint_overrides(manifest["fingerprint"])
    overrides = ([] if args.config else base) + list(args.overrides)
    return load_config(PrecomputeConfig, args.config, overrides)


def _load_checked_vae(cache: Path, manifest: dict, args, rollout: bool = False):
    """(VAE, config, rollout) after checking that this VAE + image settings (and with `rollout`, on a rollout cache,
    the Video2World pipeline and its settings: None otherwise) reproduce the cache's numbers."""
    cfg = _config_for(manifest, args)
    vae = encoders.load_vae(cfg.model.vae, cfg.model.dtype)
    fields = ["format_version", "vae", "image"]
    pipeline = None
    if rollout and (world_steps(manifest) or cfg.world.num_world_steps):
        fields.append("world")
        if cfg.world.num_world_steps:
            pipeline = Rollout.load(cfg.model.vae, cfg.model.dtype, vae, cfg.world.num_world_steps, cfg.world.rollout)
    expected = cf.fingerprint_for(cfg.model, cfg.image, vae=vae, world=cfg.world, rollout=pipeline, seed=cfg.seed)
    cf.check_fingerprint(manifest["fingerprint"], expected, cache, fields=fields)
    return vae.eval(), cfg, pipeline


def _check_full_fingerprint(cache: Path, manifest: dict, args) -> None:
    if not args.config and not args.overrides:
        return
    from precompute.pipeline import load_frozen

    cf.check_fingerprint(manifest["fingerprint"], load_frozen(_config_for(manifest, args))[3], cache)


def _pick(n_total: int, n: int, seed: int, flag: str = "--n") -> list[int]:
    if n <= 0:
        raise UserError(f"{flag} must be positive, got {n}")
    if not n_total:
        raise UserError("the cache holds no samples (every input failed: see its errors.jsonl)")
    return sorted(random.Random(seed).sample(range(n_total), min(n, n_total)))


# ----------------------------------------------------------------------------------------------------------------------
# Subcommands: each returns (report dict, exit code, human-readable text)


def summary(cache: Path, args) -> tuple[dict, int, str]:
    manifest = cf.load_manifest(cache)
    _check_full_fingerprint(cache, manifest, args)
    reader = cf.CacheReader(cache, members=(cf.LATENT,), remote=getattr(args, "remote", None))
    n = len(reader)
    idx = range(n) if n <= args.max_samples else _pick(n, args.max_samples, 0, "--max-samples")
    total_bytes = manifest["bytes"]
    stats = {}
    if n:
        means = [reader[i].mean.float() for i in idx]  # (C, 1, h, w) each; (h, w) varies with aspect-ratio buckets
        per_channel = torch.cat([m.reshape(m.shape[0], -1) for m in means], dim=1)
        stats = {
            "channel_mean": [round(v, 5) for v in per_channel.mean(1).tolist()],
            "channel_std": [round(v, 5) for v in per_channel.std(1).tolist()],
            "stats_over_samples": len(idx),
        }
    reader.close()
    reasons = cf.error_classes(cache)
    report = {
        "cache": str(cache),
        "num_samples": manifest["num_samples"],
        "num_errors": manifest["num_errors"],
        "num_shards": manifest["num_shards"],
        "bytes": total_bytes,
        "bytes_per_sample": round(total_bytes / n, 1) if n else None,
        "latent_shape": manifest["latent_shape"],
        "latent_shapes": manifest.get("latent_shapes"),
        "latent_dtype": manifest["latent_dtype"],
        "latents": cf.latents_stored(manifest),
        "world_steps": world_steps(manifest),
        "latent_frames": 1 + world_steps(manifest),
        "contents": manifest.get("contents", {}),
        **stats,
        "error_reasons": dict(reasons),
        "vae": (manifest["fingerprint"].get("vae") or {}).get("model"),
        "resolution": (manifest["fingerprint"].get("image") or {}).get("resolution"),
    }
    lines = [
        f"cache {cache}: {report['num_samples']} samples, {report['num_errors']} errors, "
        f"{report['num_shards']} shards, {total_bytes / 1e6:.2f} MB ({report['bytes_per_sample']} B/sample)",
        f"latent frames {report['latent_frames']} (the observed one + {report['world_steps']} world steps), "
        f"latent {_shapes_text(manifest)} {report['latent_dtype']} ({report['latents']}), contents "
        f"{report['contents']}, vae {report['vae']} at {report['resolution']} px",
    ]
    if stats:
        lines.append("channel mean " + " ".join(f"{v:+.3f}" for v in stats["channel_mean"]))
        lines.append("channel std  " + " ".join(f"{v:.3f}" for v in stats["channel_std"]))
    lines += [f"errors: {count} x {reason}" for reason, count in reasons.items()]
    return report, 0, "\n".join(lines)


def _shapes_text(manifest: dict) -> str:
    if manifest.get("latent_shape") is not None:
        return str(manifest["latent_shape"])
    return ", ".join(f"{s['shape']} x{s['num_samples']}" for s in manifest.get("latent_shapes") or [])


def _check_sample(key: str, members: dict[str, bytes], manifest: dict, shape: list[int] | None) -> list[str]:
    """`shape`: the latent shape the sidecar records for this sample (None: the manifest's common one)."""
    problems = []
    shape = list(shape or manifest["latent_shape"] or [])
    contents = manifest.get("contents", {})
    for m in (cf.CAPTION, cf.META, cf.LATENT):
        if m not in members:
            problems.append(f"{key}: missing member {m}")
    try:
        s = cf.decode_sample(key, members)
    except Exception as e:  # noqa: BLE001 - any decode failure is a finding, not a crash
        return problems + [f"{key}: does not decode: {type(e).__name__}: {one_line(e)}"]
    tensors = {"mean": s.mean, "logvar": s.logvar}
    if contents.get("flip"):
        tensors.update(flip_mean=s.flip_mean, flip_logvar=s.flip_logvar)
    if cf.latents_stored(manifest) == "mean":
        for name in ("logvar", "flip_logvar"):
            if tensors.pop(name, None) is not None:
                problems.append(f"{key}: holds {name}, but the cache stores the latent mean only")
    for name, t in tensors.items():
        if t is None:
            problems.append(f"{key}: missing tensor {name}")
        elif list(t.shape) != shape or str(t.dtype).removeprefix("torch.") != manifest["latent_dtype"]:
            problems.append(f"{key}: {name} is {list(t.shape)} {t.dtype}, expected {shape} {manifest['latent_dtype']}")
        elif not torch.isfinite(t.float()).all():
            problems.append(f"{key}: {name} has non-finite values")
    if contents.get("siglip") and (s.siglip is None or not torch.isfinite(s.siglip.float()).all()):
        problems.append(f"{key}: siglip features missing or non-finite")
    if contents.get("images") and s.image is None:
        problems.append(f"{key}: image bytes missing")
    return problems


def _read_tar(path: Path, spans: dict | None = None) -> tuple[dict[str, dict[str, bytes]], str | None]:
    """{key: {member: bytes}} in tar order, and what broke the reading (None: the tar is whole). `spans`, when given,
    receives {key: {member: [data offset, size]}} as the tar itself places them."""
    samples: dict[str, dict[str, bytes]] = {}
    try:
        with tarfile.open(path, "r:") as tf:
            for m in tf:
                if m.isfile():
                    key, member = cf.split_member(m.name)
                    member = cf.migrations.member(member)  # an older cache's names read as this version's
                    samples.setdefault(key, {})[member] = tf.extractfile(m).read()
                    if spans is not None:
                        spans.setdefault(key, {})[member] = [m.offset_data, m.size]
    except (tarfile.TarError, OSError, EOFError) as e:
        return samples, f"unreadable tar: {type(e).__name__}: {one_line(e)}"
    return samples, None


def _check_sidecar(side: dict, manifest: dict, samples: dict[str, dict[str, bytes]], spans: dict) -> list[str]:
    """The sidecar's keys, member offsets and crc32s against what the tar holds."""
    try:
        entries = {e["key"]: e for e in cf.migrations.sidecar(side, manifest)["samples"]}
        if list(entries) != list(samples):
            return [f"sidecar lists {len(entries)} keys, the tar holds {len(samples)}, or not in the same order"]
        problems = []
        for key, e in entries.items():
            if {n: list(v) for n, v in e["members"].items()} != spans[key]:
                problems.append(f"{key}: sidecar offsets {e['members']} != the tar's {spans[key]}")
            for name, crc in (e.get(cf.CHECKSUMS) or {}).items():
                if zlib.crc32(samples[key].get(name, b"")) != crc:
                    problems.append(f"{key}: {name} fails its crc32 check")
        return problems
    except (KeyError, TypeError, AttributeError) as e:
        return [f"sidecar is malformed ({type(e).__name__}: {one_line(e)})"]


def _shard_file(cache: Path, index: int, entry: dict, remote: cf.RemoteCache | None) -> tuple[Path, str | None]:
    """(shard `index`'s tar, None), or (a path, why it is not there) for a remote cache's shard that does not stage
    (missing, or not the object the manifest lists)."""
    if remote is None:
        return cache / entry["path"], None
    try:
        return remote.stage(index, entry["bytes"], entry["sha256"]), None
    except cf.storage.ShardCacheFull:
        raise
    except UserError as e:
        return cache / entry["path"], str(e)


def _settings(args) -> cf.Settings:
    """Object storage settings: the --config/--set precompute config's, or the defaults."""
    if not args.config and not args.overrides:
        return cf.Settings()
    return load_config(PrecomputeConfig, args.config, list(args.overrides)).storage


def verify(cache: Path, args) -> tuple[dict, int, str]:
    try:
        manifest = cf.load_manifest(cache)
    except CacheDamaged as e:  # a finding of verify's, like a bad shard
        return {"cache": str(cache), "ok": False, "problems": [str(e)], "shards": []}, 1, f"verify {cache}: FAILED: {e}"
    _check_full_fingerprint(cache, manifest, args)
    seen: dict[str, str] = {}
    shards, total = [], 0
    entries = cf.shard_table(cache, manifest).entries()
    for i, entry in enumerate(entries):
        path, staged = _shard_file(cache, i, entry, getattr(args, "remote", None))
        problems: list[str] = []
        if staged is not None or not path.is_file():
            shards.append({"path": entry["path"], "ok": False, "problems": [staged or "missing"]})
            continue
        size, digest = path.stat().st_size, cf.sha256_file(path)
        if size != entry["bytes"]:
            problems.append(f"size {size} != manifest {entry['bytes']}")
        if digest != entry["sha256"]:
            owner = next((e["path"] for e in entries if e["sha256"] == digest), None)
            problems.append(
                f"sha256 {digest[:12]}.. != manifest {entry['sha256'][:12]}.."
                + (f": it holds what the manifest lists for {owner} (copied or swapped)" if owner else "")
            )
        side = cf.read_sidecar(cache, i)
        if side is None or side.get("sha256") != entry["sha256"]:
            problems.append("sidecar missing or does not match the manifest")
        shapes = {e["key"]: e.get("latent_shape") for e in (side or {}).get("samples", [])}
        spans: dict = {}
        samples, broken = _read_tar(path, spans)
        if broken:
            problems.append(broken)
        elif side is not None:
            problems += _check_sidecar(side, manifest, samples, spans)
        if len(samples) != entry["num_samples"]:
            problems.append(f"{len(samples)} samples, manifest says {entry['num_samples']}")
        for key, members in samples.items():
            if key in seen:
                problems.append(f"{key}: duplicate key (also in {seen[key]})")
            seen.setdefault(key, entry["path"])
            problems += _check_sample(key, members, manifest, shapes.get(key))
        total += len(samples)
        shards.append(
            {
                "path": entry["path"],
                "ok": not problems,
                "num_samples": len(samples),
                "problems": problems[:20] + ([f"... {len(problems) - 20} more"] if len(problems) > 20 else []),
            }
        )
    cache_problems = []
    if total != manifest["num_samples"]:
        cache_problems.append(f"{total} samples in shards, manifest says {manifest['num_samples']}")
    bad = [s for s in shards if not s["ok"]]
    ok = not bad and not cache_problems
    report = {
        "cache": str(cache),
        "ok": ok,
        "num_samples_checked": total,
        "num_shards": len(shards),
        "bad_shards": [s["path"] for s in bad],
        "problems": cache_problems,
        "shards": shards,
    }
    lines = [f"bad shard {s['path']}: {'; '.join(s['problems'][:3])}" for s in bad] + cache_problems
    lines.append(
        f"verify {cache}: {'OK' if ok else 'FAILED'}: {total} samples in {len(shards)} shards checked"
        + (f", {len(bad)} bad shard(s)" if bad else "")
    )
    return report, 0 if ok else 1, "\n".join(lines)


def _stored_pixels(sample: cf.Sample, cfg: PrecomputeConfig) -> torch.Tensor:
    if sample.image is None:
        raise UserError("this cache was built with cache.images false: no stored images to re-encode")
    return images.load_for_vae(sample.image, cfg.image.resolution, cfg.image.resize)[0]


def compare_live(cache: Path, args) -> tuple[dict, int, str]:
    manifest = cf.load_manifest(cache)
    vae, cfg, rollout = _load_checked_vae(cache, manifest, args, rollout=True)
    encoder = encoders.WorldEncoder(vae)
    reader = cf.CacheReader(cache, remote=getattr(args, "remote", None))
    picked = _pick(len(reader), args.n, args.seed)
    names = ("mean",) if cf.latents_stored(manifest) == "mean" else ("mean", "logvar")
    flip = manifest.get("contents", {}).get("flip")
    worst = dict.fromkeys(names + tuple(f"flip_{n}" for n in names if flip), 0.0)
    per_sample = []
    with torch.no_grad():
        for start in range(0, len(picked), args.batch_size):
            samples = [reader[i] for i in picked[start : start + args.batch_size]]
            for group in _same_shape(pixels := [_stored_pixels(s, cfg) for s in samples]):
                batch = torch.stack([pixels[j] for j in group])
                if rollout is None:
                    live = dict(zip(("mean", "logvar"), encoder(batch)))
                else:  # the cache's seed and each sample's key: the same noise as precompute drew
                    seeds, qs = sample_inputs(rollout.condition, cfg.seed, [samples[j] for j in group])
                    live = dict(zip(("mean", "logvar"), observed_and_predicted(encoder, rollout, batch, seeds, qs)))
                if flip:
                    live.update(zip(("flip_mean", "flip_logvar"), encoder(batch.flip(-1))))
                for row, j in enumerate(group):
                    s = samples[j]
                    diffs = {
                        name: (live[name][row].float() - getattr(s, name).float()).abs().max().item() for name in worst
                    }
                    for name, d in diffs.items():
                        worst[name] = max(worst[name], d)
                    per_sample.append({"key": s.key, **{f"max_abs_diff_{k}": v for k, v in diffs.items()}})
    reader.close()
    max_diff = max(worst.values())
    fail = args.tol is not None and max_diff > args.tol
    report = {
        "cache": str(cache),
        "n": len(picked),
        "latent_dtype": manifest["latent_dtype"],
        "world_steps": world_steps(manifest),
        "max_abs_diff": max_diff,
        **{f"max_abs_diff_{k}": v for k, v in worst.items()},
        "tol": args.tol,
        "ok": not fail,
        "samples": per_sample,
    }
    text = (
        f"compare-live {cache}: {len(picked)} samples re-encoded from their stored images"
        + (f" and rolled out {world_steps(manifest)} steps" if rollout is not None else "")
        + "; max abs difference "
        + ", ".join(f"{k} {v:.3g}" for k, v in worst.items())
        + f" (cache dtype {manifest['latent_dtype']})"
        + (f": exceeds --tol {args.tol}" if fail else "")
    )
    return report, 1 if fail else 0, text


def _same_shape(tensors: list[torch.Tensor]) -> list[list[int]]:
    """Positions grouped by tensor shape (aspect-ratio buckets), each group in order, groups by first position."""
    groups: dict[tuple, list[int]] = {}
    for j, t in enumerate(tensors):
        groups.setdefault(tuple(t.shape), []).append(j)
    return list(groups.values())


LINE = 14  # px per text line of the label font (fonts.SIZE)


def _sheet(pairs: list[tuple[torch.Tensor, ...]], labels: list[str], header: str, min_tile: int = 128, gap: int = 4):
    """A grid of (original | decoded ...) strips on square tiles (a pair, or with rollouts a filmstrip: original,
    observed frame, predicted frames), each picture upscaled (nearest) by the same whole factor so that the largest
    side is at least `min_tile` px and centred on its tile; `header` on top, each strip's label (key, caption) under
    it, cut to the strip's width."""
    from PIL import Image, ImageDraw

    res = max(max(t.shape[-2:]) for strip in pairs for t in strip)
    scale = max(1, math.ceil(min_tile / res))
    tile = res * scale
    per_strip = max(len(strip) for strip in pairs)
    cols = max(1, min(4, len(pairs), 8 // per_strip))
    rows = math.ceil(len(pairs) / cols)
    pair_w = per_strip * tile + (per_strip - 1) * gap
    font, lacks = fonts.for_text([header, *labels])
    fonts.say_missing(lacks)
    top = 2 * gap + LINE * len(header.splitlines())
    cell_h = tile + 2 * LINE + 2 * gap
    sheet = Image.new("RGB", (cols * pair_w + (cols + 1) * gap * 2, top + rows * cell_h + 2 * gap), (32, 32, 32))
    draw = ImageDraw.Draw(sheet)
    draw.multiline_text((2 * gap, gap), header, fill=(255, 255, 255), spacing=LINE - fonts.SIZE, font=font)
    for n, (strip, label) in enumerate(zip(pairs, labels)):
        x = 2 * gap + (n % cols) * (pair_w + 2 * gap)
        y = top + (n // cols) * cell_h
        for k, t in enumerate(strip):
            h, w = t.shape[-2:]
            img = Image.fromarray(t.permute(1, 2, 0).numpy()).resize((w * scale, h * scale), Image.NEAREST)
            sheet.paste(img, (x + k * (tile + gap) + (tile - w * scale) // 2, y + (tile - h * scale) // 2))
        for i, line in enumerate(label.splitlines()[:2]):
            line = line if len(line) <= pair_w // 3 else line[: pair_w // 3 - 3] + "..."  # no glyph is under 3 px
            while len(line) > 3 and font.getlength(line) > pair_w:  # cut to the pair's width
                line = line[:-4] + "..."
            draw.text((x, y + tile + gap // 2 + i * LINE), line, fill=(220, 220, 220), font=font)
    return sheet


def _decode_header(cfg: PrecomputeConfig, steps: int = 0) -> str:
    note = (
        "\nVAE: tiny (random weights): decodes are noise by design; a trained VAE decodes to the picture"
        if location.is_tiny(cfg.model.vae)
        else f"\nVAE: {cfg.model.vae}"
    )
    if steps:
        return (
            f"each filmstrip: original | decoded observed frame | {steps} predicted frames (the video frame "
            "ending each latent frame)" + note
        )
    return "each pair: original | decoded" + note


def _decoded_frames(vae, z: torch.Tensor) -> list[torch.Tensor]:
    """uint8 (B, 3, H, W) pictures of latents z (B, C, 1 + N, h, w), un-normalised: the first frame and, for each
    predicted latent frame, the last video frame it decodes to (the VAE decodes latent frame k >= 1 to `temporal`
    video frames)."""
    video = vae.decode(z).sample.float().clamp(-1, 1)  # (B, 3, 1 + N * temporal, H, W) in [-1, 1]
    temporal = (video.shape[2] - 1) // max(1, z.shape[2] - 1)
    picks = [0] + [k * temporal for k in range(1, z.shape[2])]
    return [((video[:, :, t] + 1) * 127.5).round().to(torch.uint8) for t in picks]


def _writable_image_path(path: str) -> Path:
    """--out, checked before any decoding: an image format PIL writes, in a folder that exists or can be made."""
    from PIL import Image

    out = Path(path)
    if out.suffix.lower() not in Image.registered_extensions():
        raise UserError(f"--out {out}: unknown image extension {out.suffix!r} (use .png)")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {out}: cannot create its folder ({e.strerror})") from None
    return out


def decode(cache: Path, args) -> tuple[dict, int, str]:
    out_path = _writable_image_path(args.out)
    manifest = cf.load_manifest(cache)
    vae, cfg, _ = _load_checked_vae(cache, manifest, args)
    dtype = next(vae.parameters()).dtype
    reader = cf.CacheReader(cache, remote=getattr(args, "remote", None))
    picked = _pick(len(reader), args.n, args.seed)
    pairs, per_sample = [], []
    with torch.no_grad():
        for start in range(0, len(picked), args.batch_size):
            samples = [reader[i] for i in picked[start : start + args.batch_size]]
            recon = [None] * len(samples)
            for group in _same_shape([s.mean for s in samples]):
                z = torch.stack([samples[j].mean for j in group]).to(dtype)  # (B, 16, 1 + N, h, w), un-normalised
                frames = _decoded_frames(vae, z)
                for row, j in enumerate(group):
                    recon[j] = [f[row] for f in frames]
            for s, film in zip(samples, recon):
                r = film[0]
                orig = _stored_pixels(s, cfg) if s.image is not None else torch.full_like(r, 128)
                mse = ((orig.float() - r.float()) / 127.5).pow(2).mean().item() if s.image is not None else None
                psnr = 10 * math.log10(4.0 / mse) if mse else None  # signal range [-1, 1] has peak-to-peak 2
                pairs.append((orig, *film))
                per_sample.append({"key": s.key, "caption": s.caption, "psnr_db": psnr and round(psnr, 2)})
    reader.close()
    header = _decode_header(cfg, world_steps(manifest))
    labels = [f"{p['key']}\n{' '.join(p['caption'].split())}" for p in per_sample]
    from PIL import Image

    with atomic.file(out_path, fsync=False) as tmp:
        _sheet(pairs, labels, header).save(tmp, format=Image.registered_extensions()[out_path.suffix.lower()])
    report = {"cache": str(cache), "n": len(pairs), "out": str(out_path), "samples": per_sample, "header": header}
    return report, 0, (f"decode {cache}: {len(pairs)} samples -> {out_path} (" + header.replace("\n", "; ") + ")")


# ----------------------------------------------------------------------------------------------------------------------
# CLI


def _parser() -> ArgParser:
    p = ArgParser(prog="precompute.inspect", description="Inspect a latent cache.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=ArgParser)

    def add(name: str, help_: str, models: bool = False):
        sp = sub.add_parser(name, help=help_)
        sp.add_argument("cache", help="the cache directory")
        sp.add_argument("--json", action="store_true", help="print one JSON object instead of text")
        add_config_args(
            sp,
            "precompute config to check the fingerprint against"
            + (" and take the VAE from" if models else " (loads the models)"),
        )
        if models:
            sp.add_argument("--n", type=int, default=8, help="how many random samples")
            sp.add_argument("--seed", type=int, default=0)
            sp.add_argument("--batch-size", type=int, default=16)
        return sp

    add("summary", "counts, sizes, latent statistics, error reasons").add_argument(
        "--max-samples", type=int, default=2048, help="latent statistics over at most this many samples"
    )
    add("verify", "check every shard and tensor against the manifest")
    add("compare-live", "re-encode stored images and compare with the cached latents", models=True).add_argument(
        "--tol", type=float, default=None, help="exit 1 when the max abs difference exceeds this"
    )
    add("decode", "decode latents with the VAE into a contact sheet", models=True).add_argument(
        "--out", required=True, help="PNG file to write"
    )
    return p


COMMANDS = {"summary": summary, "verify": verify, "compare-live": compare_live, "decode": decode}


@cli_entry
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    tol = getattr(args, "tol", None)
    if tol is not None and not 0 <= tol < float("inf"):  # a NaN tolerance would pass any difference
        raise UserError(f"precompute.inspect: --tol must be a finite number >= 0, got {tol}")
    where = location.place(args.cache, "CACHE_DIR")
    if args.command == "decode" and isinstance(where, location.Local):
        paths.check_not_input(args.out, {"the cache": where.path})
    # a URL: its stand-in folder and the cache handle every subcommand reads through (args.remote)
    cache, args.remote = cf.open_cache(args.cache, _settings(args))
    try:
        report, code, text = COMMANDS[args.command](cache, args)
    except (OSError, CacheDamaged) as e:  # most often a shard missing or cut short: verify reports every problem,
        # the rest stop
        raise UserError(
            f"{args.command} {cache}: {e} (if the cache is damaged, python -m precompute.inspect verify "
            f"{cache} checks every shard)"
        ) from None
    print(as_shown(json.dumps(report, indent=1) if args.json else text))  # a URL, not its stand-in folder
    return code


if __name__ == "__main__":
    sys.exit(main())
