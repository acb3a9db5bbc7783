"""Helpers for the precompute/inspect tests: small configs, image zoo, reading a cache back without our reader."""

from __future__ import annotations

import io
import json
import struct
import zlib
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from precompute.config import PrecomputeConfig
from theworld.core.config import load_config


def make_cfg(out: Path, *overrides: str, n: int = 20, res: int = 32, shard: int = 8) -> PrecomputeConfig:
    base = [
        f"output_dir={out}",
        "model.dtype=float32",
        "cache.dtype=float32",
        f"image.resolution={res}",
        f"source.num_samples={n}",
        f"shard_size={shard}",
        "batch_size=4",
        "num_workers=0",
    ]
    return load_config(PrecomputeConfig, None, base + list(overrides))


def cli_args(out: Path, *overrides: str, n: int = 20, res: int = 32, shard: int = 8) -> list[str]:
    base = [
        f"output_dir={out}",
        "model.dtype=float32",
        "cache.dtype=float32",
        f"image.resolution={res}",
        f"source.num_samples={n}",
        f"shard_size={shard}",
        "batch_size=4",
        "num_workers=0",
    ]
    return [a for o in base + list(overrides) for a in ("--set", o)]


def read_cache_plain(cache: Path) -> dict[str, dict[str, bytes]]:
    """{key: {member: bytes}} read with plain webdataset (no theworld code), in shard order."""
    import webdataset as wds

    from theworld import cache_format as cf

    urls = [str(cache / s["path"]) for s in cf.shard_table(cache, cf.load_manifest(cache)).entries()]
    out: dict[str, dict[str, bytes]] = {}
    if not urls:
        return out
    for s in wds.WebDataset(urls, shardshuffle=False, nodesplitter=wds.split_by_node):
        key = s.pop("__key__")
        assert key not in out, f"duplicate key {key}"
        out[key] = {k: v for k, v in s.items() if not k.startswith("__")}
    return out


def latents(cache: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    return {k: load(m["latent.safetensors"])["mean"] for k, m in read_cache_plain(cache).items()}


def png_bytes(img: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG", **kw)
    return buf.getvalue()


def jpeg_bytes(img: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=95, **kw)
    return buf.getvalue()


def bomb_png(width: int = 20000, height: int = 20000) -> bytes:
    """A valid PNG header that claims width x height pixels (no pixel data worth decoding)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = lambda t, d: struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d) & 0xFFFFFFFF)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 16)) + chunk(b"IEND", b"")
    )


def gradient(w: int, h: int) -> Image.Image:
    x = np.linspace(0, 255, w, dtype=np.float32)[None, :, None]
    y = np.linspace(0, 255, h, dtype=np.float32)[:, None, None]
    arr = np.concatenate(
        [np.broadcast_to(x, (h, w, 1)), np.broadcast_to(y, (h, w, 1)), np.full((h, w, 1), 90, np.float32)], axis=2
    )
    return Image.fromarray(arr.astype(np.uint8), "RGB")


def image_zoo(root: Path) -> tuple[list[dict], dict[str, str]]:
    """Write a folder of good, unusual and bad images; returns (captions.jsonl records, {key: expected error word})."""
    root.mkdir(parents=True, exist_ok=True)
    g = gradient(48, 40)
    files = {
        "rgb.jpg": jpeg_bytes(g),
        "cmyk.jpg": jpeg_bytes(g.convert("CMYK")),
        "rgba.png": png_bytes(g.convert("RGBA")),
        "palette.png": png_bytes(g.convert("P")),
        "gray.png": png_bytes(g.convert("L")),
        "gray16.png": png_bytes(Image.fromarray((np.asarray(g.convert("L"), np.uint16) * 257).astype("<u2"))),
        "sub/pic.bmp": (lambda b: (g.save(b, format="BMP"), b.getvalue())[1])(io.BytesIO()),
        "corrupt.jpg": b"\xff\xd8\xff\xe0" + bytes(range(256)) * 4,
        "truncated.png": png_bytes(gradient(64, 64).rotate(30))[:-120],
        "empty.png": b"",
        "bomb.png": bomb_png(),
    }
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90: stored 48x40, shown 40x48
    files["rotated.jpg"] = jpeg_bytes(g, exif=exif.tobytes())
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    records = [{"image": rel, "caption": f"caption of {rel}"} for rel in sorted(files)]
    records.insert(2, {"image": "missing.png", "caption": "not there"})
    next(r for r in records if r["image"] == "cmyk.jpg")["prompt"] = "what is this ?"
    expected_bad = {
        "corrupt_jpg": "unreadable",
        "truncated_png": "unreadable",
        "empty_png": "empty",
        "bomb_png": "oversized",
        "missing_png": "cannot read",
    }
    lines = [json.dumps(r) for r in records]
    lines += ["{not json", json.dumps({"image": "rgb.jpg"}), json.dumps({"image": "rgb.jpg", "caption": "again"})]
    (root / "captions.jsonl").write_text("\n".join(lines) + "\n")
    n = len(records)
    expected_bad.update(
        {f"line-{n + 1}": "bad caption line", f"line-{n + 2}": "bad caption line", "rgb_jpg#dup": "duplicate"}
    )
    return records, expected_bad


def wds_source(
    root: Path, tars: int, per_tar: int, dup: tuple[int, int] | None = None, no_caption: tuple[int, int] | None = None
) -> list[Path]:
    """img2dataset-like tars `root/<j:05d>.tar` (jpg + txt + json); `dup`: that (tar, sample) reuses tar 0's key 0;
    `no_caption`: that (tar, sample) has no txt member. Returns the tar paths."""
    import webdataset as wds

    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for j in range(tars):
        paths.append(root / f"{j:05d}.tar")
        with wds.TarWriter(str(paths[-1])) as w:
            for i in range(per_tar):
                key = "000000000" if (j, i) == dup else f"{j:05d}{i:04d}"
                sample = {
                    "__key__": key,
                    "jpg": jpeg_bytes(gradient(36 + i % 5, 36 + j % 3)),
                    "json": json.dumps({"url": f"http://x/{key}"}).encode(),
                }
                if (j, i) != no_caption:
                    sample["txt"] = f"text {j} {i}".encode()
                w.write(sample)
    return paths


BUCKET_SIZES = [(200, 100), (150, 100), (100, 100), (100, 150), (100, 200), (90, 300)]  # w x h, five buckets at 128


def bucket_folder(root: Path, n: int) -> Path:
    """A `folder` source of n JPEGs cycling through BUCKET_SIZES (a few pixels of jitter), captions.jsonl beside."""
    root.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(n):
        w, h = BUCKET_SIZES[i % len(BUCKET_SIZES)]
        img = gradient(w + i % 7, h)
        if i % 2:
            img = img.transpose(Image.Transpose.ROTATE_180)
        (root / f"img{i:03d}.jpg").write_bytes(jpeg_bytes(img))
        lines.append(
            json.dumps({"image": f"img{i:03d}.jpg", "caption": f"a {'dark' if i % 2 else 'light'} corner number {i}"})
        )
    (root / "captions.jsonl").write_text("\n".join(lines) + "\n")
    return root


def encoded_samples(n: int, long_key: bool = False) -> list[tuple[str, dict]]:
    """`n` seeded samples encoded as the writer takes them ((key, members)); `long_key`: keys too long for ustar."""
    from theworld import cache_format as cf

    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        key = f"{'k' * 150}-{i}" if long_key else f"s{i:04d}"  # a key too long for a plain ustar name
        s = cf.Sample(
            key=key,
            caption=f"caption {i}",
            meta={"prompt": "p", "i": i},
            mean=torch.randn(16, 1, 4, 4, generator=g),
            logvar=torch.randn(16, 1, 4, 4, generator=g),
            image=b"\x89PNG\r\n\x1a\n" + bytes(range(i % 7 + 1)),
        )
        out.append((key, cf.encode_sample(s, "float32")))
    return out


def sidecar_json(cache: Path, i: int) -> dict:
    """Shard `i`'s sidecar as written."""
    from theworld import cache_format as cf

    return json.loads(cf.sidecar_path(cache, i).read_text())


def flip_byte(cache: Path, shard: int, sample: int, member: str, at: int = 0) -> str:
    """Flip one byte inside a member's data (found through the sidecar); returns the sample's key."""
    from theworld import cache_format as cf

    entry = sidecar_json(cache, shard)["samples"][sample]
    offset, size = entry["members"][member]
    tar = cf.tar_path(cache, shard)
    data = bytearray(tar.read_bytes())
    data[offset + (at % size)] ^= 0x40
    tar.write_bytes(bytes(data))
    return entry["key"]


def strip_checksums(cache: Path) -> None:
    """What a cache written before member checksums looks like (format 3: its reader reads the sidecars)."""
    from tests.theworld.cache_format.conftest import as_format_3
    from theworld import cache_format as cf

    as_format_3(cache)
    for i in range(len(json.loads((cache / cf.MANIFEST).read_text())["shards"])):
        side = sidecar_json(cache, i)
        for s in side["samples"]:
            s.pop(cf.CHECKSUMS)
        cf.atomic_write_json(cf.sidecar_path(cache, i), side)


def rewrite_manifest(cache: Path) -> dict:
    """The manifest and shard index written again from the cache's sidecars, as a rerun of precompute writes them
    (after a test rewrote a shard with `cf.write_shard`)."""
    from theworld import cache_format as cf

    m = json.loads((cache / cf.MANIFEST).read_text())
    sides = [cf.read_sidecar(cache, i) for i in range(m["num_shards"])]
    known = ("format_version", "num_samples", "latent_shapes", "num_shards", "bytes", "shards", "shard_index")
    fields = ("fingerprint", "latent_shape", "latent_dtype", "num_errors", "contents")
    extra = {k: v for k, v in m.items() if k not in known + fields}
    return cf.write_manifest(cache, sides, **{k: m[k] for k in fields}, extra=extra)


def single_threaded_run(cfg) -> dict:
    """pipeline.run on one thread: each launched process runs one, and the thread count moves latents by ~1e-7, so a
    single-process reference compared bit for bit with two processes' cache runs on one too."""
    import torch

    from precompute import pipeline

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return pipeline.run(cfg)
    finally:
        torch.set_num_threads(threads)
