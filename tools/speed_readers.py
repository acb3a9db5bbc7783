"""Reading a latent cache from object storage: our reader against the peers a user would pick instead, on one S3
server (moto's, started on 127.0.0.1 in this process) and the same samples, side by side in one run.

    python -m tools.speed_readers [--samples N] [--rounds R] [--json] [--cache DIR] [--root DIR]

Readers, each decoding every sample the same way (`decode_sample`: caption, json, latent safetensors):
  theworld    CacheReader over s3://... as training reads it: index fetched, whole shards staged through s3fs into
              the shard cache (cache_local_dir), each member checked by its crc32.
  webdataset  webdataset.WebDataset over the shards' presigned http:// URLs on the same server (its own URL pipeline:
              a curl pipe per shard), with its cache_dir so a second epoch reads local copies.
  streaming   MosaicML Streaming's StreamingDataset over the same samples written with its MDSWriter (every member,
              uncompressed, shards of about our shard's bytes) to s3:// on the same server, local= a new folder.
Per round each reader starts from empty local folders: epoch 1 (setup included: index fetches, downloads) and epoch 2
(served from its local copies) are timed; a warm-up round is not counted; figures are medians over rounds. Every
reader must yield the same keys in the same order and the same latents, or the run fails (the comparison is fair).
"Exact resume": whether a run resumed mid-epoch reads exactly what an uninterrupted one reads (ours:
train/data/order.py's
order is a function of seed, epoch and step; Streaming: its state_dict); webdataset's pipeline has no such state.
The cache is built once with the precompute CLI under --root (as tools.speed_train does), or given with --cache.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import fsspec

from theworld import cache_format as cf
from theworld.cache_format.names import CAPTION, LATENT, META
from tools.speed_train import BENCH_ROOT, ensure_cache, s3_copy

RESUME = {"theworld": True, "webdataset": False, "streaming": True}
Epoch = Callable[[], Iterable[cf.Sample]]


def _same_decode(key: str, members: dict[str, bytes]) -> cf.Sample:
    """What every reader does with a sample: the work of `CacheReader.sample` with members=(LATENT,)."""
    return cf.decode_sample(key, {n: members[n] for n in (CAPTION, META, LATENT)})


# ----------------------------------------------------------------------------------------------------------------------
# The readers: each makes its dataset in `tmp` (timed with epoch 1) and returns what iterates one epoch


def theworld(url: str, tmp: Path) -> Epoch:
    reader = cf.CacheReader(url, members=(LATENT,), settings=cf.Settings(cache_local_dir=str(tmp)))
    return lambda: (reader.sample(i) for i in range(len(reader)))


def webdataset(http_urls: list[str], tmp: Path) -> Epoch:
    import webdataset as wds

    ds = wds.WebDataset(http_urls, shardshuffle=False, cache_dir=str(tmp))
    return lambda: (_same_decode(s["__key__"], s) for s in ds)


def streaming(remote: str, tmp: Path) -> Epoch:
    ds = _streaming_base().StreamingDataset(remote=remote, local=str(tmp), shuffle=False, batch_size=1)
    return lambda: (_same_decode(s["__key__"], s) for s in ds)


def _streaming_base() -> types.ModuleType:
    """streaming.base without the package's __init__, which imports streaming.vision and so torchvision (not a
    dependency of this project, and its wheels pin torch)."""
    if "streaming" not in sys.modules:
        spec = importlib.util.find_spec("streaming")
        if spec is None:
            raise SystemExit(
                "tools.speed_readers: mosaicml-streaming is not installed; pip install --no-deps the packages of "
                "pyproject.toml's bench extra"
            )
        package = types.ModuleType("streaming")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["streaming"] = package
    import streaming.base

    return streaming.base


def write_mds(cache: Path, remote: str) -> None:
    """Every sample of `cache`, every member as bytes, written with MDSWriter to `remote` (uploaded as it goes)."""
    reader = cf.CacheReader(cache)
    names = reader.member_names()
    shard_bytes = max(e["bytes"] for e in reader.manifest["shards"])
    columns = {"__key__": "str", **{n: "bytes" for n in names}}
    with _streaming_base().MDSWriter(out=remote, columns=columns, size_limit=shard_bytes, progress_bar=False) as out:
        for i in range(len(reader)):
            out.write({"__key__": reader.key(i), **reader.raw(i)})


# ----------------------------------------------------------------------------------------------------------------------
# Measuring


def _epoch(samples: Iterable[cf.Sample]) -> tuple[float, list[str], str]:
    """(seconds, keys in order, digest of keys and latents) of one pass."""
    t0, keys, h = time.perf_counter(), [], hashlib.sha256()
    for s in samples:
        keys.append(s.key)
        h.update(s.key.encode())
        h.update(s.mean.contiguous().numpy().tobytes())
    return time.perf_counter() - t0, keys, h.hexdigest()[:16]


def measure(make: Callable[[Path], Epoch]) -> dict:
    """One round of one reader from empty local folders: two epochs, each checked to yield the same samples."""
    with tempfile.TemporaryDirectory(prefix="bench-readers-") as tmp:
        t0 = time.perf_counter()
        epoch = make(Path(tmp))
        setup = time.perf_counter() - t0
        first, keys, digest = _epoch(epoch())
        second, keys2, digest2 = _epoch(epoch())
    if (keys2, digest2) != (keys, digest):
        raise RuntimeError(f"{make.__name__}: its second epoch yields other samples than its first")
    return {"epoch1_s": setup + first, "epoch2_s": second, "keys": keys, "digest": digest}


def run(cache: Path, rounds: int) -> dict:
    """All readers, a warm-up round then `rounds` rounds taken in turn, on one S3 server holding the cache."""
    manifest = cf.load_manifest(cache)
    n_shards = len(manifest["shards"])
    with _scratch(), s3_copy(cache) as (url, _), _env("S3_ENDPOINT_URL", os.environ["AWS_ENDPOINT_URL"]):
        # presigned: plain http GETs that curl can make without the AWS signature
        fs = fsspec.filesystem("s3", skip_instance_cache=True)
        http_urls = [fs.sign(f"bench/cache/{e['path']}", expiration=24 * 3600) for e in manifest["shards"]]
        write_mds(cache, "s3://bench/mds")
        makes: dict[str, Callable[[Path], Epoch]] = {
            "theworld": lambda tmp: theworld(url, tmp),
            "webdataset": lambda tmp: webdataset(http_urls, tmp),
            "streaming": lambda tmp: streaming("s3://bench/mds", tmp),
        }
        for name, make in makes.items():
            make.__name__ = name
        results = {name: [] for name in makes}
        for r in range(rounds + 1):
            for name, make in makes.items():
                m = measure(make)
                if r:  # round 0 warms up imports, connections and the server
                    results[name].append(m)
    return _rows(results, manifest["num_samples"], n_shards, rounds)


def _rows(results: dict[str, list[dict]], n: int, n_shards: int, rounds: int) -> dict:
    ours = results["theworld"][0]
    rows = []
    for name, ms in results.items():
        for m in ms:
            if (m["keys"], m["digest"]) != (ours["keys"], ours["digest"]):
                raise RuntimeError(f"{name} yields other samples or latents than theworld's reader: not comparable")
        rows.append(
            {
                "reader": name,
                "epoch1_samples_per_s": round(statistics.median(n / m["epoch1_s"] for m in ms), 1),
                "epoch2_samples_per_s": round(statistics.median(n / m["epoch2_s"] for m in ms), 1),
                "epoch1_rounds": [round(n / m["epoch1_s"], 1) for m in ms],  # the spread on a loaded machine
                "epoch2_rounds": [round(n / m["epoch2_s"], 1) for m in ms],
                "exact_resume": RESUME[name],
                "keys_digest": hashlib.sha256("\n".join(ms[0]["keys"]).encode()).hexdigest()[:16],
                "latents_digest": ms[0]["digest"],
            }
        )
    return {"samples": n, "shards": n_shards, "rounds": rounds, "rows": rows}


@contextlib.contextmanager
def _scratch() -> Iterator[None]:
    """Python's temporary folder in one of its own for the run: Streaming leaves file locks in it per dataset."""
    saved = tempfile.tempdir
    with tempfile.TemporaryDirectory(prefix="bench-readers-") as tmp:
        tempfile.tempdir = tmp
        try:
            yield
        finally:
            tempfile.tempdir = saved


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    """Streaming's S3 client takes its endpoint from S3_ENDPOINT_URL."""
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def _table(report: dict) -> str:
    lines = [
        f"{report['samples']} samples in {report['shards']} shards on an S3 server on 127.0.0.1 (moto); samples/s, "
        f"median of {report['rounds']} rounds",
        f"{'reader':<12} {'epoch 1':>10} {'epoch 2':>10}  exact resume",
    ]
    for row in report["rows"]:
        resume = "yes" if row["exact_resume"] else "no"
        lines.append(
            f"{row['reader']:<12} {row['epoch1_samples_per_s']:>10.1f} {row['epoch2_samples_per_s']:>10.1f}  {resume}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.speed_readers", description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=1024, help="samples of the cache built under --root")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--root", default=str(BENCH_ROOT), help="where the benchmark's cache is built once")
    p.add_argument("--cache", help="read this local cache instead of building one")
    p.add_argument("--json", action="store_true", help="print the figures as JSON alone")
    args = p.parse_args(argv)
    if args.samples < 1 or args.rounds < 1:
        p.error("--samples and --rounds must be at least 1")
    if args.cache:
        cache = Path(args.cache)
        if not (cache / cf.MANIFEST).is_file():
            p.error(f"--cache {cache}: no {cf.MANIFEST} there; give a complete local cache")
    else:
        cache = ensure_cache(Path(args.root), "tiny", "tiny", 64, args.samples)
    report = run(cache, args.rounds)
    print(json.dumps(report, indent=1) if args.json else _table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
