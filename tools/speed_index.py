"""Shard index size and open cost at DataComp-1B's scale: bytes per sample of a part (as format 4 first wrote it, and
narrow), then a synthetic index of --shards shards of 1,024 samples (DataComp-1B's shard size) built with
index.write_parts (no precompute, no tars), opened the way a training process opens it: time and Python-heap memory
(tracemalloc, which numpy reports to; memory-mapped pages are the node's page cache, shared) to open, and to read the
first sample of one part; the held-out split (held_out.split, train.eval.samples 256) of the lazily opened index from
the shard table's candidates and by the full pass (every key hashed, every part loaded), side by side; sha256 of a
million keys (what writing the candidates costs); one process's share of an epoch in the windowed order
(storage.shuffle_window 64, process 4 of 8, global batch 256) computed at its positions alone and over every sample,
side by side, and the first at DataComp-1B's size. Extrapolated to DataComp-1B (1,367,188 shards, 1.4B samples).

    python -m tools.speed_index [--shards 16384] [--whole-shards 4096] [--order-shards 1367188] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import itertools
import json
import tempfile
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from theworld import cache_format as cf
from theworld.cache_format import index, sample_index
from theworld.cache_format.held_out import split
from theworld.cache_format.names import CAPTION, LATENT, META
from train.data import order

PER_SHARD = 1024
DATACOMP_SHARDS = 1_367_188
# the members of the DataComp-1B plan's cache (docs/precompute.md: no images, no SigLIP): a caption, its json, a latent
MEMBERS = {CAPTION: 60, META: 180, LATENT: 262_300}
EVAL_SAMPLES = 256  # the shipped configs' train.eval.samples
ORDER = {"window": 64, "world": 8, "rank": 3, "global_batch": 256}  # the order case: a DataComp-like 8-process run


def _shard_sidecar(i: int) -> dict:
    """One shard's sidecar: 1,024 samples keyed by a 32-hex-digit uid as DataComp's, members laid out as a tar has
    them (512-byte headers, sizes rounded up to 512)."""
    samples, offset = [], 0
    for j in range(PER_SHARD):
        members, crc = {}, {}
        for name, size in sorted(MEMBERS.items()):
            offset += 512
            members[name] = [offset, size + j % 7]
            crc[name] = (i * 7919 + j * 104729 + len(name)) & 0xFFFFFFFF
            offset += -(-(size + j % 7) // 512) * 512
        uid = hashlib.md5(f"{i}-{j}".encode()).hexdigest()
        samples.append({"key": uid, "members": members, "crc32": crc, "latent_shape": [16, 1, 32, 32]})
    return {
        "count": PER_SHARD,
        "bytes": offset + 1024,
        "sha256": hashlib.sha256(str(i).encode()).hexdigest(),
        "text_rule": "gemma3-control-v1",
        "samples": samples,
    }


def _parts(n_shards: int) -> Iterator[index.Part]:
    """The parts index.write makes of shards of PER_SHARD samples: one shard's arrays built from its sidecar, tiled,
    each shard's keys and sha256 made its own (no Python step per sample)."""
    one = index.build([_shard_sidecar(0)], 0)
    for lo, hi in itertools.pairwise(index.part_bounds(np.full(n_shards, PER_SHARD, dtype=np.int64))):
        s = hi - lo
        keys = np.tile(one.keys.view(np.uint8).reshape(PER_SHARD, -1), (s, 1))
        keys[:, :8] = np.frombuffer(  # the first 8 hex digits: the shard's number, so every key differs
            np.repeat(np.char.encode(np.char.zfill(np.arange(lo, lo + s).astype(str), 8)), PER_SHARD).tobytes(),
            np.uint8,
        ).reshape(-1, 8)
        sha = np.frombuffer(b"".join(hashlib.sha256(str(i).encode()).digest() for i in range(lo, lo + s)), np.uint8)
        yield index.Part(
            first=lo,
            count=np.full(s, PER_SHARD, np.int64),
            bytes=np.full(s, int(one.bytes[0]), np.int64),
            sha256=sha.reshape(s, 32),
            text_rule=np.zeros(s, np.int32),
            rules=one.rules,
            keys=keys.view(one.keys.dtype).reshape(-1),
            names=one.names,
            spans=np.tile(one.spans, (s, 1, 1)),
            crc32=np.tile(one.crc32, (s, 1)),
            latent_shape=np.tile(one.latent_shape, (s, 1)),
        )


def part_bytes() -> dict:
    """Bytes per sample of a part of one 1,024-sample shard, wide (format 4 as first written: its arrays) and narrow."""
    part = index.build([_shard_sidecar(0)], 0)
    wide = sum(getattr(part, k).nbytes for k in ("keys", "spans", "crc32", "latent_shape"))
    narrow = index.encode(part)
    summary = index.Summary.of(part)
    table = index.encode_table([summary])
    # the held-out candidates are per part (HELD_OUT_CANDIDATES at most), not per sample: counted apart
    held = summary.held_out
    candidate = (held.sha256.nbytes + held.index.nbytes + index.key_rows(held.keys).nbytes) / len(held.index)
    return {
        "members": len(part.names),
        "key_bytes": part.keys.dtype.itemsize,
        "wide_per_sample": round(wide / PER_SHARD, 1),
        "narrow_part_per_sample": round(len(narrow) / PER_SHARD, 1),
        "table_per_sample": round((len(table) - candidate * len(held.index)) / PER_SHARD, 2),
        "candidates_per_part_kb": round(candidate * index.HELD_OUT_CANDIDATES / 1e3, 1),
    }


def sha256_per_million(n: int) -> float:
    """Seconds a million 32-byte keys take to hash (index.key_digests, timed on n): what writing the candidates adds."""
    keys = np.array([f"{i:032x}".encode() for i in range(n)])
    t = time.perf_counter()
    index.key_digests(keys)
    return round((time.perf_counter() - t) * 1e6 / n, 2)


def _count_loads(lazy: sample_index.Lazy) -> list[int]:
    """The parts this reader's index reads from now on (kept or not)."""
    loaded, load = [], lazy._load
    lazy._load = lambda p: loaded.append(p) or load(p)
    return loaded


@contextlib.contextmanager
def _opened(lazy: bool) -> Iterator[None]:
    """Caches opened within read their index a part at a time (lazy) or whole, whatever their size."""
    saved = sample_index.LAZY_BYTES
    sample_index.LAZY_BYTES = 0 if lazy else 1 << 62
    try:
        yield
    finally:
        sample_index.LAZY_BYTES = saved


def split_case(folder: Path) -> dict:
    """held_out.split of a lazily opened cache from the shard table's candidates, and by the full pass (the same
    cache with its candidates set aside, as one written before them): time, and the parts each loads."""
    out, held = {}, []
    with _opened(lazy=True):
        for name in ("candidates", "full_pass"):
            reader = cf.CacheReader(folder)
            loaded = _count_loads(reader._index)
            if name == "full_pass":
                reader._index.held_out = None
            t = time.perf_counter()
            held.append(split(reader, EVAL_SAMPLES)[1].tolist())
            out[f"{name}_s"] = round(time.perf_counter() - t, 4)
            out[f"{name}_parts_loaded"] = len(loaded)
    if held[0] != held[1]:
        raise RuntimeError("the split from the candidates differs from the full pass's")
    return out


def order_case(folder: Path) -> dict:
    """One process's share of epoch 0 in the windowed order, computed at its positions alone
    (order.windowed_rank_indices) and over every sample (order.rank_indices with its arrays of every sample's shard
    and bucket): time and numpy's peak memory (torch's permutations are not traced), and that both give the same
    indices."""
    with _opened(lazy=True):
        reader = cf.CacheReader(folder)
        train, held = split(reader, EVAL_SAMPLES)
    train = np.asarray(train)  # the array over every sample the second path orders
    o = ORDER
    args = (1, 0, o["global_batch"], o["rank"], o["world"], 0)
    windowed, w_s, _, w_peak = _measured(
        lambda: order.windowed_rank_indices(reader.shard_starts, held, *args, o["window"])
    )
    every, e_s, _, e_peak = _measured(
        lambda: order.rank_indices(
            train, *args, order.bucket_ids(reader)[train], shards=order.shards_of(reader, train), window=o["window"]
        )
    )
    if not np.array_equal(windowed, every):
        raise RuntimeError("the windowed order at one process's positions differs from the one over every sample")
    return {
        "samples": len(reader),
        "share": len(windowed),
        "windowed_s": w_s,
        "windowed_peak_mb": w_peak,
        "every_s": e_s,
        "every_peak_mb": e_peak,
    }


def full_size_order(n_shards: int) -> dict:
    """One process's share of epoch 0 in the windowed order over n_shards shards of 1,024 samples (DataComp-1B's
    count by default) and EVAL_SAMPLES held out, measured at that size: it needs the shard counts alone."""
    starts = np.arange(n_shards + 1, dtype=np.int64) * PER_SHARD
    held = np.sort(np.random.default_rng(0).choice(int(starts[-1]), EVAL_SAMPLES, replace=False))
    args = (1, 0, ORDER["global_batch"], ORDER["rank"], ORDER["world"], 0, ORDER["window"])
    share, seconds, _, peak = _measured(lambda: order.windowed_rank_indices(starts, held, *args))
    return {
        "shards": n_shards,
        "share": len(share),
        "share_gb": round(share.nbytes / 2**30, 2),
        "s": seconds,
        "peak_gb": round(peak / 1024, 2),
    }


def _write(folder: Path, n_shards: int) -> None:
    folder.mkdir(parents=True)
    fields = index.write_parts(folder, _parts(n_shards))
    manifest = {
        "format_version": cf.FORMAT_VERSION,
        "num_samples": n_shards * PER_SHARD,
        "num_errors": 0,
        "latent_shape": [16, 1, 32, 32],
        "latent_shapes": [{"shape": [16, 1, 32, 32], "count": n_shards * PER_SHARD}],
        "latent_dtype": "bfloat16",
        "contents": {},
        "num_shards": n_shards,
        "bytes": n_shards * int(_shard_sidecar(0)["bytes"]),
        "fingerprint": {},
        **fields,
    }
    (folder / cf.MANIFEST).write_text(json.dumps(manifest))
    (folder / cf.ERRORS).write_text("")


def _measured(fn):
    tracemalloc.start()
    t = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - t
    current, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return out, round(seconds, 3), round(current / 2**20, 3), round(peak / 2**20, 1)


def open_case(folder: Path, lazy: bool) -> dict:
    with _opened(lazy):
        reader, seconds, held, peak = _measured(lambda: cf.CacheReader(folder))
        _, first_s, _, part_peak = _measured(lambda: reader._index.members(len(reader) - 1))
    index_bytes = sum(e["bytes"] for e in reader.manifest["shard_index"])
    table = reader.manifest["shard_table"]["bytes"]
    return {
        "shards": reader.manifest["num_shards"],
        "samples": len(reader),
        "index_bytes": index_bytes,
        "table_bytes": table,
        "open_s": seconds,
        "open_held_mb": held,
        "open_peak_mb": peak,
        "first_sample_of_a_part_s": first_s,
        "part_load_peak_mb": part_peak,
    }


def run(n_shards: int, whole_shards: int, order_shards: int = DATACOMP_SHARDS) -> dict:
    report = {"part": part_bytes(), "full_size_order": full_size_order(order_shards)}
    with tempfile.TemporaryDirectory() as tmp:
        _write(Path(tmp) / "lazy", n_shards)
        report["lazy"] = open_case(Path(tmp) / "lazy", True)
        report["split"] = split_case(Path(tmp) / "lazy")
        report["order"] = order_case(Path(tmp) / "lazy")
        if whole_shards:
            _write(Path(tmp) / "whole", whole_shards)
            report["whole"] = open_case(Path(tmp) / "whole", False)
    report["sha256_per_million_s"] = sha256_per_million(min(n_shards * PER_SHARD, 1_000_000))
    lazy, per, cut = report["lazy"], report["part"], report["split"]
    scale = DATACOMP_SHARDS / lazy["shards"]
    report["datacomp"] = {
        "shards": DATACOMP_SHARDS,
        "samples": DATACOMP_SHARDS * PER_SHARD,
        "wide_index_gb": round(per["wide_per_sample"] * DATACOMP_SHARDS * PER_SHARD / 1e9, 1),
        "narrow_index_gb": round(lazy["index_bytes"] * scale / 1e9, 1),
        "table_gb": round(lazy["table_bytes"] * scale / 1e9, 2),
        "open_held_mb": round(lazy["open_held_mb"] * scale, 1),
        "open_s_local": round(lazy["open_s"] * scale, 1),
        "split_candidates_s": cut["candidates_s"],  # the table's first rows: the same at any size
        "split_full_pass_h": round(cut["full_pass_s"] * scale / 3600, 2),
        "candidates_write_h": round(report["sha256_per_million_s"] * DATACOMP_SHARDS * PER_SHARD / 1e6 / 3600, 2),
        "order_every_peak_gb": round(report["order"]["every_peak_mb"] * scale / 1024, 1),
    }
    return report


def _table(r: dict) -> str:
    p, lz, d = r["part"], r["lazy"], r["datacomp"]
    lines = [
        f"part of 1,024 samples ({p['members']} members, {p['key_bytes']}-byte keys): {p['wide_per_sample']} bytes a "
        f"sample as format 4 first wrote it, {p['narrow_part_per_sample']} narrow; shard table "
        f"{p['table_per_sample']} bytes a sample",
    ]
    for name in ("lazy", "whole"):
        if o := r.get(name):
            lines.append(
                f"{name:>5}: {o['shards']} shards, {o['samples']} samples, parts {o['index_bytes'] / 1e9:.2f} GB, "
                f"table {o['table_bytes'] / 1e6:.1f} MB: open {o['open_s']:.2f} s holding {o['open_held_mb']} MB "
                f"(peak {o['open_peak_mb']} MB); first sample of a part {o['first_sample_of_a_part_s']:.2f} s "
                f"(peak {o['part_load_peak_mb']} MB)"
            )
    c = r["split"]
    lines.append(
        f"split of {EVAL_SAMPLES} (lazy): {c['candidates_s']:.4f} s from the candidates "
        f"({c['candidates_parts_loaded']} parts loaded), {c['full_pass_s']:.2f} s by the full pass "
        f"({c['full_pass_parts_loaded']} parts loaded): "
        f"x{c['full_pass_s'] / max(c['candidates_s'], 1e-6):.0f}; sha256 of 1M keys {r['sha256_per_million_s']} s; "
        f"candidates {p['candidates_per_part_kb']} kB a full part"
    )
    o = r["order"]
    lines.append(
        f"order of process {ORDER['rank'] + 1} of {ORDER['world']} (window {ORDER['window']}, {o['share']} of "
        f"{o['samples']} samples): at its positions alone {o['windowed_s']:.2f} s, numpy peak "
        f"{o['windowed_peak_mb']} MB; "
        f"over every sample {o['every_s']:.2f} s, peak {o['every_peak_mb']} MB (the same indices)"
    )
    lines.append(
        f"DataComp-1B ({d['shards']} shards, {d['samples']} samples): index {d['wide_index_gb']} GB wide, "
        f"{d['narrow_index_gb']} GB narrow (loaded a part at a time); shard table {d['table_gb']} GB; open holds "
        f"~{d['open_held_mb']:.0f} MB a process besides the mapped table (lazy x {d['shards'] / lz['shards']:.1f}); "
        f"held-out split {d['split_candidates_s']} s from the candidates (any size), {d['split_full_pass_h']} h by "
        f"the full pass on every node; the candidates cost {d['candidates_write_h']} h of sha256 once, where the index "
        f"is written; the order over every sample peaks at {d['order_every_peak_gb']} GB of numpy a process"
    )
    f = r["full_size_order"]
    lines.append(
        f"order of process {ORDER['rank'] + 1} of {ORDER['world']} at its positions alone over {f['shards']} shards "
        f"(measured): {f['s']:.1f} s, numpy peak {f['peak_gb']} GB, of which its share {f['share_gb']} GB "
        f"({f['share']} samples)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.speed_index", description=__doc__.split("\n\n")[0])
    p.add_argument("--shards", type=int, default=16384, help="shards of 1,024 samples in the lazily opened index")
    p.add_argument("--whole-shards", type=int, default=4096, help="shards of the index opened whole (0: skip)")
    p.add_argument("--order-shards", type=int, default=DATACOMP_SHARDS, help="shards of the full-size order case")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.shards < 1 or args.whole_shards < 0 or args.order_shards < 1:
        p.error("--shards and --order-shards must be at least 1 and --whole-shards at least 0")
    report = run(args.shards, args.whole_shards, args.order_shards)
    print(json.dumps(report, indent=1) if args.json else _table(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
