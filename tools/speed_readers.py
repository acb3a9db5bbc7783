"""Reading a latent cache from object storage: our reader against the peers a user would pick instead, on one S3
server (moto's, started on 127.0.0.1 in this process) and the same samples, side by side in one run.

    python -m tools.speed_readers [--samples N] [--rounds R] [--json] [--cache DIR] [--root DIR]

Readers, each decoding every sample the same way (`decode_sample`: caption, json, latent safetensors):
  theworld    CacheReader over s3://... as training reads it: index fetched, whole shards staged through s3fs into
              the shard cache (storage.local_dir), each member checked by its crc32.
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

    python -m tools.speed_readers --latency 0,20,80 [--rows-only] [--bandwidth-mbps B] [--samples N] [--json]

The latency case puts a proxy, in a process of its own, in front of the S3 server: it holds each request the given
milliseconds before forwarding it (and can cap each answer's bandwidth), and counts requests and bytes. For each
latency, through one DataLoader worker in batches of 32: cold (empty local folders, opening included) and warm epochs'
samples/s, time to the first batch, requests and bytes per epoch, for the project's training loader as train.loop
builds it (train.data.cache.open_cache, DataContext.build, build_train_loader: its worker, the windowed order with
`storage.shuffle_window` a quarter of the shards, read-ahead at its default, the tokenising collate, the tiny model's
processor), webdataset's pipeline streaming the shards (no cache_dir) and MosaicML Streaming at its documented
settings (batch_size given); the peers decode each sample's caption, json and latents. Each reader runs in a spawned
process of its own with its imports (and our processor) loaded before the clock starts, the S3 clients' packages
included (s3fs and aiobotocore for ours, boto3 for Streaming: each imports them at its first request); the first
batch is timed from "make a loader over the URL" to "its first batch in hand": ours: opening the cache (its S3
client; manifest, errors, run record and the shard index's first objects at once),
DataContext.build (one sample's text as a byte range, in the background), the first shards staged, its worker
forked, and the first batch (32 samples decoded, tokenised and collated) made in the main process;
webdataset: its DataLoader's worker forked, a curl per shard streaming the first tar, 32 samples decoded;
Streaming: StreamingDataset made (its index.json downloaded), its worker forked, the first shard downloaded, 32
samples decoded. litdata is not measured: its
wheel needs another torch than this project's lock. Then, at the first non-zero latency: bytes one epoch of the
training loader downloads when the shard cache holds a quarter of the cache (windowed and global order, and on each
of two nodes without and with storage.node_groups 2); data_overhead
of training the tiny model for a whole epoch from a cold shard cache (the epoch's wall time, opening included, over
that of the same steps on batches in memory; the median of three cold epochs, each followed by a warm one from its
shard cache), with the step on torch's default threads and on one (the loader worker then has a core of its own, as
beside a GPU); the time to open caches of 16, 1,024 and 16,384 shards (their index alone: manifest and shard index)
and a dataset in 8 parts (at once, and one after another); and precompute's final step (`RemoteWriter.fetch_records`)
over 1,024 shards.

    python -m tools.speed_readers --budget-latency 20 [--json]

The bytes case alone.

    python -m tools.speed_readers --open-latency 20 [--json]

The open and final-step cases alone (no cache of samples is built): the time to open, the shard index's and
manifest's bytes and the index arrays a reader holds, for 16, 1,024 and 16,384 shards of one sample each, for 16,384
shards of 1,024 DataComp-shaped samples, whose index is read lazily (its shard table downloaded once per node: the
node's first process and a second one are timed), and for a dataset in 8 parts of 1,024 shards; the final step's
time.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import http.client
import importlib.util
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from multiprocessing.pool import ThreadPool
from pathlib import Path

import fsspec
import numpy as np
from torch.utils.data import DataLoader, IterableDataset

from theworld import cache_format as cf
from theworld.cache_format import index
from theworld.cache_format.names import CAPTION, LATENT, META, SHARD_INDEX
from tools.speed_train import BENCH_ROOT, ensure_cache, s3_copy

RESUME = {"theworld": True, "webdataset": False, "streaming": True}
Epoch = Callable[[], Iterable[cf.Sample]]


def _same_decode(key: str, members: dict[str, bytes]) -> cf.Sample:
    """What every reader does with a sample: the work of `CacheReader.sample` with members=(LATENT,)."""
    return cf.decode_sample(key, {n: members[n] for n in (CAPTION, META, LATENT)})


# ----------------------------------------------------------------------------------------------------------------------
# The readers: each makes its dataset in `tmp` (timed with epoch 1) and returns what iterates one epoch


def theworld(url: str, tmp: Path) -> Epoch:
    reader = cf.CacheReader(url, members=(LATENT,), settings=cf.Settings(local_dir=str(tmp)))
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
    shard_bytes = int(reader.shard_table.bytes.max())
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
    n_shards = manifest["num_shards"]
    with _scratch(), s3_copy(cache) as (url, _), _env("S3_ENDPOINT_URL", os.environ["AWS_ENDPOINT_URL"]):
        # presigned: plain http GETs that curl can make without the AWS signature
        fs = fsspec.filesystem("s3", skip_instance_cache=True)
        http_urls = [
            fs.sign(f"bench/cache/{e['path']}", expiration=24 * 3600) for e in cf.shard_table(cache, manifest).entries()
        ]
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


# ----------------------------------------------------------------------------------------------------------------------
# The latency case: a proxy process that holds each request, in front of the S3 server


def _proxy_serve(upstream: int, latency_ms: float, bandwidth: float, port, counts) -> None:
    """The proxy's process: forwards to 127.0.0.1:`upstream` after `latency_ms`, answers at most `bandwidth` bytes/s
    each (0: no cap); counts[0] requests, counts[1] body bytes sent."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # an answer is written as its headers then its body: with Nagle's algorithm on, a small body waits for the
        # client's delayed ACK of the headers (40 ms on Linux), a delay that is no part of the latency modelled
        disable_nagle_algorithm = True

        def log_message(self, *a):
            pass

        def forward(self):
            n = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(n) if n else None
            time.sleep(latency_ms / 1000)
            conn = http.client.HTTPConnection("127.0.0.1", upstream, timeout=120)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection",)}
            conn.request(self.command, self.path, body, headers)
            resp = conn.getresponse()
            data = resp.read()
            with counts.get_lock():
                counts[0] += 1
                counts[1] += len(data)
            self.send_response(resp.status)
            for k, v in resp.getheaders():
                if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                    self.send_header(k, v)
            length = resp.getheader("Content-Length") if self.command == "HEAD" else str(len(data))
            self.send_header("Content-Length", length or "0")
            self.end_headers()
            if self.command != "HEAD":
                step = 1 << 16
                for lo in range(0, len(data), step):
                    self.wfile.write(data[lo : lo + step])
                    if bandwidth:
                        time.sleep(min(step, len(data) - lo) / bandwidth)
            conn.close()

        do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = forward

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        # socketserver's backlog of 5 drops the connections of a burst beyond it, which the client's TCP sends again
        # after 1 s: no part of a bucket's latency (an open of several caches makes 40 connections at once)
        request_queue_size = 1024

        def handle_error(self, request, client_address):
            # a client that hangs up (a read-ahead download cut short as its loader ends) is no error of the proxy's
            if not isinstance(sys.exc_info()[1], ConnectionError):
                super().handle_error(request, client_address)

    server = Server(("127.0.0.1", 0), Handler)
    port.value = server.server_address[1]
    server.serve_forever()


class Counts:
    """The proxy's counters: counts() -> (requests, body bytes) so far; handed to a reader's own process. `pid`: the
    proxy's process."""

    def __init__(self, shared, pid: int):
        self.shared, self.pid = shared, pid

    def __call__(self) -> tuple[int, int]:
        return self.shared[0], self.shared[1]


@contextlib.contextmanager
def latency_proxy(latency_ms: float, bandwidth_mbps: float = 0) -> Iterator[Counts]:
    """AWS_ENDPOINT_URL through a proxy process holding each request `latency_ms`; yields counts() -> (requests,
    bytes) so far."""
    upstream = int(os.environ["AWS_ENDPOINT_URL"].rsplit(":", 1)[1])
    ctx = multiprocessing.get_context("spawn")  # its own interpreter: not the measured reader's GIL
    port, counts = ctx.Value("i", 0), ctx.Array("q", 2)
    proc = ctx.Process(target=_proxy_serve, args=(upstream, latency_ms, bandwidth_mbps * 1e6 / 8, port, counts))
    proc.daemon = True
    proc.start()
    while not port.value:
        time.sleep(0.05)
    saved = {k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "S3_ENDPOINT_URL")}
    os.environ["AWS_ENDPOINT_URL"] = os.environ["S3_ENDPOINT_URL"] = f"http://127.0.0.1:{port.value}"
    try:
        yield Counts(counts, proc.pid)
    finally:
        proc.terminate()
        proc.join(10)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


BATCH = 32


def _settings(local: str, **kw) -> cf.Settings:
    """Object storage settings with a new filesystem: fsspec's cached one would still point at an earlier proxy."""
    return cf.Settings({"skip_instance_cache": True}, local_dir=local, **kw)


def _loader(ds, workers: int = 1) -> DataLoader:
    return DataLoader(ds, batch_size=BATCH, num_workers=workers, collate_fn=list)


def _train_config(url: str, local: str, window: int, workers: int = 1, *sets: str):
    """The training config of the benchmark's runs: the tiny model, the cache at `url`, the shard cache `local`."""
    from theworld.core.config import load_config
    from train.config import TrainConfig

    return load_config(
        TrainConfig,
        None,
        [
            "model.gemma=tiny",
            "model.vae=tiny",
            "model.dtype=float32",
            "image.resolution=64",
            f"cache_dir={url}",
            f"storage.local_dir={local}",
            "storage.options={skip_instance_cache: true}",  # fsspec's cached filesystem points at an earlier proxy
            f"output_dir={local}/run",
            "trackers=[]",
            "resume=null",
            "train.eval.samples=16",
            f"train.global_batch_size={BATCH}",
            f"train.micro_batch_size={BATCH}",
            f"train.loader.num_workers={workers}",
            f"storage.shuffle_window={window}",
            *sets,
        ],
    )


def _processor():
    from transformers import AutoProcessor

    from theworld.embedded import tiny
    from theworld.model.encoders import pretrained

    return AutoProcessor.from_pretrained(pretrained("tiny", tiny.TINY_GEMMA_DIR)[0])


class _Batches:
    """The project's training loader as train.loop builds it (train.data.cache.open_cache, DataContext.build,
    build_train_loader: workers, windowed order, read-ahead, tokenising collate), opened when first iterated (the
    open is part of a cold epoch); yields its batches."""

    def __init__(self, cfg, processor, rank: int = 0, world: int = 1):
        self.cfg, self.processor, self.ctx = cfg, processor, None
        self.rank, self.world = rank, world  # the process's place: its share of each global batch

    def __iter__(self) -> Iterator:
        from train.data import cache as data
        from train.data.loader import DataContext, build_train_loader

        if self.ctx is None:
            reader, inputs = data.open_cache(self.cfg)
            self.ctx = DataContext.build(self.cfg, reader, inputs, self.processor)
        yield from build_train_loader(self.cfg, self.ctx, self.rank, self.world, epoch=0)


def _time_epochs(make: Callable[[], Iterable], counts: Callable[[], tuple[int, int]]) -> dict:
    """Cold then warm epoch of the loader `make()` returns: samples/s, seconds to the first batch, requests."""
    out = {}
    t0, c0 = time.perf_counter(), counts()
    loader = make()
    for name in ("cold", "warm"):
        n, first = 0, None
        t = t0 if name == "cold" else time.perf_counter()
        c = c0 if name == "cold" else counts()
        for batch in loader:
            first = first if first is not None else time.perf_counter() - t
            n += batch.size if hasattr(batch, "size") else len(batch)
        out[name] = {
            "samples_per_s": round(n / (time.perf_counter() - t), 1),
            "first_batch_s": round(first or 0.0, 3),
            "requests": counts()[0] - c[0],
            "bytes": counts()[1] - c[1],
            "samples": n,
        }
    return out


def _ours(url: str, local: str, window: int) -> Callable[[], Iterable]:
    # imported before the clock starts, as the peers' are: s3fs's client, which storage.py imports at its first
    # request (as Streaming does boto3), and the training loader
    import aiobotocore.session  # noqa: F401
    import s3fs  # noqa: F401

    from theworld.core import heap
    from train.data import cache, loader  # noqa: F401

    processor = _processor()
    heap.freeze()  # as train.loop keeps its imports out of the collector's passes before it opens a cache
    return lambda: _Batches(_train_config(url, local, window), processor)


def _wds_stream(urls: list[str]) -> Callable[[], Iterable]:
    import webdataset as wds

    def make():
        ds = wds.WebDataset(urls, shardshuffle=False, nodesplitter=wds.split_by_node)
        ds = ds.map(lambda s: _same_decode(s["__key__"], s)).batched(BATCH, collation_fn=list)
        return DataLoader(ds, batch_size=None, num_workers=1)

    return make


def _mosaic(remote: str, local: str) -> Callable[[], Iterable]:
    import boto3.s3.transfer  # noqa: F401 - its S3 client, imported at its first download: before the clock starts
    import boto3.session  # noqa: F401

    base = _streaming_base()

    def make():
        ds = base.StreamingDataset(remote=remote, local=local, shuffle=False, batch_size=BATCH)

        class Decoded(IterableDataset):
            def __iter__(self):
                return (_same_decode(s["__key__"], s) for s in ds)

        return _loader(Decoded())

    return make


READERS = {"theworld": _ours, "webdataset": _wds_stream, "streaming": _mosaic}


def _reader_epochs(name: str, args: tuple, counts: Counts) -> dict:
    """A reader's figures: its imports (and for ours the tokenizer's processor) before the clock starts, then
    `_time_epochs`."""
    return _time_epochs(READERS[name](*args), counts)


def _send(fn: Callable, args: tuple, conn, scratch: str) -> None:
    """A spawned process's body: sends fn(*args), or the error's text. `scratch`: the run's temporary folder."""
    tempfile.tempdir = scratch
    multiprocessing.set_start_method("fork", force=True)  # a spawned process inherits spawn: not a user's default
    try:
        conn.send(fn(*args))
    except BaseException as e:  # noqa: BLE001 - reported by the parent, which would otherwise wait
        conn.send(f"{fn.__name__}: {type(e).__name__}: {e}")
        raise


def _spawned(fn: Callable, *args):
    """fn(*args) in a new interpreter (spawned): apart from the S3 server, which runs in this process and would
    otherwise take the measured code's interpreter for every request it answers, and with the first-time costs of a
    process (its S3 client, its DataLoader worker) paid again, none inherited from a case measured before it."""
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_send, args=(fn, args, theirs, tempfile.gettempdir()))
    proc.start()
    theirs.close()
    try:
        got = ours.recv()
    except EOFError:
        got = None
    proc.join()
    if got is None:
        got = f"{fn.__name__}: its process exited with status {proc.exitcode} before reporting"
    if isinstance(got, str):
        raise RuntimeError(got)
    return got


def latency_run(cache: Path, latencies: list[float], bandwidth_mbps: float, rows_only: bool = False) -> dict:
    manifest = cf.load_manifest(cache)
    shards = manifest["num_shards"]
    report: dict = {"samples": manifest["num_samples"], "shards": shards, "bandwidth_mbps": bandwidth_mbps, "rows": []}
    processor = _processor()
    with _scratch(), s3_copy(cache) as (url, _), _env("S3_ENDPOINT_URL", os.environ["AWS_ENDPOINT_URL"]):
        write_mds(cache, "s3://bench/mds")
        for ms in latencies:
            with latency_proxy(ms, bandwidth_mbps) as counts, tempfile.TemporaryDirectory() as tmp:
                fs = fsspec.filesystem("s3", skip_instance_cache=True)
                http_urls = [
                    fs.sign(f"bench/cache/{e['path']}", expiration=3600)
                    for e in cf.shard_table(cache, manifest).entries()
                ]
                args = {
                    "theworld": (url, tmp + "/o", max(1, shards // 4)),
                    "webdataset": (http_urls,),
                    "streaming": ("s3://bench/mds", tmp + "/m"),
                }
                row = {"latency_ms": ms}
                for name in READERS:
                    row[name] = _spawned(_reader_epochs, name, args[name], counts)
                report["rows"].append(row)
        if rows_only:
            return report
        probe = next((x for x in latencies if x > 0), latencies[-1])
        with latency_proxy(probe, bandwidth_mbps) as counts:
            report["budget"] = _budget_bytes(url, manifest, counts, processor)
            report["cold_overhead"] = [
                _spawned(_cold_overhead, url, max(1, shards // 4), [os.getpid(), counts.pid], threads)
                for threads in (0, 1)
            ]
            report["open"] = _spawned(_open_times)
            report["fetch_records_1024_s"] = _fetch_records_time()
        report["probe_latency_ms"] = probe
    report["litdata"] = (
        "not installed (its wheel needs another torch)"
        if importlib.util.find_spec("litdata") is None
        else "installed, not measured"
    )
    return report


def _budget_bytes(url: str, manifest: dict, counts, processor) -> dict:
    """Bytes one epoch of the training loader downloads with a shard cache of a quarter of the cache, in the windowed
    order (a window of an eighth of the shards, read-ahead at its default) and in the global order; then on each of
    two nodes (a process each, its own shard cache), without node groups and with storage.node_groups 2 (a window
    twice as wide, so each node's is the same)."""
    total, budget = manifest["bytes"], f"storage.local_max_gb={manifest['bytes'] / 4 / 1e9}"
    out = {"cache_bytes": total}

    def epoch(window: int, *sets: str, rank: int = 0, world: int = 1) -> float:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = _train_config(url, tmp, window, 1, budget, *sets)
            c = counts()
            for _ in _Batches(cfg, processor, rank, world):
                pass
            return round((counts()[1] - c[1]) / total, 2)

    window = max(1, manifest["num_shards"] // 8)
    out["windowed"], out["global"] = epoch(window), epoch(0)
    # each node's window the same: W shards without groups, 2W in two groups of W
    half = f"train.micro_batch_size={BATCH // 2}"
    out["per_node"] = [epoch(window, half, rank=r, world=2) for r in range(2)]
    out["per_node_grouped"] = [epoch(2 * window, half, "storage.node_groups=2", rank=r, world=2) for r in range(2)]
    return out


def _cpu_s(pid: int) -> float:
    """CPU seconds (user and system) process `pid` has used so far (Linux's /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


COLD_ROUNDS = 3  # rounds of _cold_overhead: one epoch on a shared VM scatters by +-5%


def _cold_overhead(url: str, window: int, server: list[int], threads: int) -> dict:
    """data_overhead of training the tiny model for one whole epoch from a cold shard cache (its open included):
    the epoch's wall seconds over the mean of the same steps on batches already in memory just before and just after
    its round, the median over COLD_ROUNDS rounds (each a cold epoch from a new shard cache, then a warm one from the
    same shard cache: the loader's cost apart from the bucket's); and the CPU seconds the `server` processes (the S3
    server's, the proxy's) used during a cold epoch, on the machine's cores with it (a bucket's are elsewhere).
    `threads`: the step's torch threads (0: torch's default, every core; 1 leaves the loader worker a
    core of its own, as it has beside a GPU)."""
    import torch

    from tools.speed_train import _steps
    from train import components
    from train.step import LoopState, optimization_step

    if threads:
        torch.set_num_threads(threads)
    processor = _processor()

    def timed(run: Callable[[], object]) -> float:
        t = time.perf_counter()
        run()
        return time.perf_counter() - t

    with tempfile.TemporaryDirectory() as tmp:
        cfg = _train_config(url, f"{tmp}/staged", window)
        launch = components.resolve_launch(cfg)
        c = components.build(cfg, components.make_accelerator(cfg, launch), launch.accum)
        state = LoopState()
        staged = list(_Batches(cfg, processor))
        _steps(c, state, staged[:3], 1)  # allocator and kernel caches: not the epoch

        def in_memory() -> float:
            return timed(lambda: _steps(c, state, staged, 1))

        def epoch(batches: Iterable) -> None:
            for batch in batches:
                optimization_step(c, state, [batch])

        def loaded(r: int) -> float:  # the shard cache of cold epoch r
            return timed(lambda: epoch(_Batches(_train_config(url, f"{tmp}/cold{r}", window), processor)))

        staged_s, cold_s, warm_s, server_s = [in_memory()], [], [], 0.0
        for r in range(COLD_ROUNDS):  # a loaded machine drifts: each round against the in-memory epochs around it
            before = sum(map(_cpu_s, server))
            cold_s.append(loaded(r))
            server_s += sum(map(_cpu_s, server)) - before
            warm_s.append(loaded(r))  # its shards now local: what the bucket does not cost
            staged_s.append(in_memory())

    def overheads(epochs: list[float]) -> list[float]:
        return [round(x / statistics.fmean(staged_s[i : i + 2]), 3) for i, x in enumerate(epochs)]

    return {
        "threads": torch.get_num_threads(),
        "steps": len(staged),
        "staged_s": round(statistics.fmean(staged_s), 2),
        "cold_s": round(statistics.median(cold_s), 2),
        "data_overhead": statistics.median(overheads(cold_s)),
        "rounds": overheads(cold_s),
        "warm_data_overhead": statistics.median(overheads(warm_s)),
        "server_cpu_s": round(server_s / COLD_ROUNDS, 2),
    }


def _synthetic_index(folder: Path, n_shards: int) -> None:
    """A cache's index alone (manifest, shard index, errors) for n_shards shards of one sample: what opening reads."""
    from theworld.cache_format.layout import write_manifest

    folder.mkdir(parents=True)
    sides = [
        {
            "shard": f"shard-{i:06d}.tar",
            "count": 1,
            "bytes": 10240,
            "sha256": hashlib.sha256(str(i).encode()).hexdigest(),
            "format_version": cf.FORMAT_VERSION,
            "samples": [
                {
                    "key": f"k{i:07d}",
                    "members": {CAPTION: [512, 10], META: [1024, 20], LATENT: [2048, 4096]},
                    "crc32": {CAPTION: 1, META: 2, LATENT: 3},
                    "latent_shape": [16, 1, 4, 4],
                }
            ],
        }
        for i in range(n_shards)
    ]
    write_manifest(
        folder, sides, fingerprint={}, latent_shape=[16, 1, 4, 4], latent_dtype="float32", num_errors=0, contents={}
    )
    (folder / cf.ERRORS).write_text("")


def _put(folder: Path, prefix: str, only: Callable[[Path], bool] = lambda p: True) -> str:
    fs = fsspec.filesystem("s3", skip_instance_cache=True)  # through the proxy: the figures do not count it
    with ThreadPool(32) as pool:
        pool.map(
            lambda p: fs.put_file(str(p), f"bench/{prefix}/{p.relative_to(folder)}"),
            [p for p in sorted(folder.rglob("*")) if p.is_file() and not p.name.startswith(".") and only(p)],
        )
    return f"s3://bench/{prefix}"


LAZY_SHARDS = 16384  # the lazily read case: shards of 1,024 DataComp-shaped samples (tools.speed_index)


def _open_times() -> dict:
    """The opens' figures, in a process apart from the S3 server's (`_spawned`), as each reader of the latency case
    is: in the server's process its answers would take the opening interpreter."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        # the process's first S3 client (s3fs's imports, botocore's models: once a process) before any clock starts
        _synthetic_index(Path(tmp) / "first", 1)
        cf.CacheReader(_put(Path(tmp) / "first", "first"), settings=_settings(f"{tmp}/l-first"))
        for n in (16, 1024, 16384):
            _synthetic_index(Path(tmp) / f"i{n}", n)
            out[str(n)] = _open_case(Path(tmp) / f"i{n}", _put(Path(tmp) / f"i{n}", f"open{n}"), f"{tmp}/l{n}")
        out[f"{LAZY_SHARDS}x1024"] = _lazy_open(Path(tmp))
        out["parts"] = _parts_open(Path(tmp), 8, 1024)
    return out


def _parts_open(tmp: Path, parts: int, shards: int) -> dict:
    """A dataset in `parts` caches of `shards` shards (a mixture, as DataComp-1B's plan trains on its parts): opened
    at once by `train.data.cache.open_readers`, as a run's start does, and one after another, each with its own
    empty shard cache. The caches share one S3 client, as a run's do (fsspec's cached filesystem: this process has
    known one proxy alone), made before the clocks start; the imports are frozen as train.loop freezes them, or a
    full pass of the collector over torch's objects, started by the opens' allocations, lands in the first clock."""
    from theworld.core import heap
    from train.data.cache import open_readers

    _synthetic_index(tmp / "part", shards)
    urls = [_put(tmp / "part", f"part{i}") for i in range(parts)]
    open_readers([urls[0]], cf.Settings(local_dir=f"{tmp}/l-parts-client"))
    heap.freeze()  # train.data.cache's imports (torch's) out of the collector's passes, as train.loop has them
    out = {"parts": parts, "shards": shards}
    for name, groups in (("at_once_s", [urls]), ("one_by_one_s", [[u] for u in urls])):
        t = time.perf_counter()
        for group in groups:
            open_readers(group, cf.Settings(local_dir=f"{tmp}/l-{name}"))
        out[name] = round(time.perf_counter() - t, 3)
    return out


def _open_case(folder: Path, url: str, local: str) -> dict:
    """Seconds to open the cache at `url` (a copy of `folder`) with the shard cache `local` as a run's start does
    (with its consistency check), and what it holds."""
    t = time.perf_counter()
    reader = cf.CacheReader(url, settings=_settings(local))
    reader.check_consistency()
    seconds = round(time.perf_counter() - t, 3)
    held = sum(a.nbytes for a in vars(reader).values() if isinstance(a, np.ndarray))  # the index arrays
    return {
        "seconds": seconds,
        "samples": len(reader),
        "arrays_mb": round(held / 2**20, 2),
        "index_bytes": sum(e["bytes"] for e in reader.manifest["shard_index"]),
        "manifest_bytes": (folder / cf.MANIFEST).stat().st_size,
    }


def _lazy_open(tmp: Path) -> dict:
    """A cache of DataComp's shape read lazily (LAZY_SHARDS shards of 1,024 samples: its index parts over
    sample_index.LAZY_BYTES): opened by the node's first process, which downloads the shard table, then by another
    of its processes (a second reader on the same shard cache), which opens the node's copy. Its manifest lists
    every shard, as a cache written by precompute does (167 bytes a shard). Of the index parts only
    the first is put in the bucket (the open asks for its first bytes before the manifest is read); a part is read
    when a sample of it is."""
    from tools.speed_index import _write

    folder = tmp / "lazy"
    _write(folder, LAZY_SHARDS)
    manifest = json.loads((folder / cf.MANIFEST).read_text())
    manifest["shards"] = cf.CacheReader(folder).shard_table.entries()  # the list write_manifest keeps for tools
    cf.atomic_write_json(folder / cf.MANIFEST, manifest)
    url = _put(folder, "lazy", lambda p: p.parent.name != SHARD_INDEX or p.name in (index.TABLE, index.part_name(0)))
    out = _open_case(folder, url, f"{tmp}/l-lazy")
    out["table_bytes"] = cf.load_manifest(folder)["shard_table"]["bytes"]
    out["second_process_s"] = _open_case(folder, url, f"{tmp}/l-lazy")["seconds"]
    return out


def _fetch_records_time(n: int = 1024) -> float:
    """Precompute's final step (rank 0) over n shards another node wrote (its shards, error files and records object,
    as its `put_records` leaves them): listings, then that object, each file checked by the listing's md5."""
    from theworld.cache_format import storage

    with tempfile.TemporaryDirectory() as tmp:
        other = storage.for_writing("s3://bench/records", _settings(f"{tmp}/other"))
        folder = other.out
        for i in range(n):
            (folder / "shards").mkdir(parents=True, exist_ok=True)
            (folder / "errors").mkdir(exist_ok=True)
            (folder / "shards" / f"shard-{i:06d}.tar").write_bytes(b"x" * 10)
            (folder / "shards" / f"shard-{i:06d}.json").write_text(json.dumps({"bytes": 10}))
            (folder / "errors" / f"shard-{i:06d}.jsonl").write_text("")
        url = _put(folder, "records")
        other.put_records(1, range(n))
        writer = storage.for_writing(url, _settings(f"{tmp}/l"))
        writer.out.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        writer.fetch_records(n)
        return round(time.perf_counter() - t, 3)


def budget_run(cache: Path, latency_ms: float) -> dict:
    """The bytes case alone (`_budget_bytes`), through the proxy at `latency_ms`."""
    manifest, processor = cf.load_manifest(cache), _processor()
    with _scratch(), s3_copy(cache) as (url, _), latency_proxy(latency_ms) as counts:
        return {"probe_latency_ms": latency_ms, "budget": _budget_bytes(url, manifest, counts, processor)}


def _budget_line(r: dict) -> str:
    b = r["budget"]
    return (
        f"shard cache = 1/4 of the cache, {r['probe_latency_ms']:g} ms: one epoch downloads {b['windowed']}x the "
        f"cache (windowed order), {b['global']}x (global order); on each of two nodes {b['per_node']}x, "
        f"{b['per_node_grouped']}x with storage.node_groups 2"
    )


def open_run(latency_ms: float) -> dict:
    """The open and final-step cases alone, through the proxy at `latency_ms`."""
    with _scratch(), tempfile.TemporaryDirectory() as empty, s3_copy(Path(empty)):
        with latency_proxy(latency_ms) as counts:
            c = counts()
            report = {"probe_latency_ms": latency_ms, "open": _spawned(_open_times)}
            report["open_requests"] = counts()[0] - c[0]
            report["fetch_records_1024_s"] = _fetch_records_time()
    return report


def _open_line(n: str, o: dict, latency_ms: float) -> str:
    line = (
        f"open {n:>6} shards at {latency_ms:g} ms: {o['seconds']:.3f} s (shard index {o['index_bytes']} bytes, "
        f"manifest {o['manifest_bytes']} bytes, index arrays {o['arrays_mb']:.2f} MB)"
    )
    if "table_bytes" in o:
        line += f"; read lazily: shard table {o['table_bytes']} bytes, a second process {o['second_process_s']:.3f} s"
    return line


def _open_lines(r: dict) -> list[str]:
    opens = dict(r["open"])
    p = opens.pop("parts")
    lines = [_open_line(n, o, r["probe_latency_ms"]) for n, o in opens.items()]
    return lines + [
        f"open a dataset in {p['parts']} parts of {p['shards']} shards at {r['probe_latency_ms']:g} ms: "
        f"{p['at_once_s']:.3f} s at once (a run's start), {p['one_by_one_s']:.3f} s one after another"
    ]


def _open_table(r: dict) -> str:
    lines = _open_lines(r)
    return "\n".join(lines + [f"precompute's final step, 1024 shards: {r['fetch_records_1024_s']:.3f} s"])


def _latency_table(r: dict) -> str:
    lines = [
        f"{r['samples']} samples in {r['shards']} shards, S3 server behind a proxy process holding each request; "
        "one loader worker, batches of 32",
        f"{'latency':>8} {'reader':<11} {'cold/s':>8} {'warm/s':>8} {'1st batch s':>11} {'requests':>9} {'MB':>7}",
    ]
    for row in r["rows"]:
        for name in ("theworld", "webdataset", "streaming"):
            c, w = row[name]["cold"], row[name]["warm"]
            lines.append(
                f"{row['latency_ms']:>6g}ms {name:<11} {c['samples_per_s']:>8.1f} {w['samples_per_s']:>8.1f} "
                f"{c['first_batch_s']:>11.3f} {c['requests']:>9} {c['bytes'] / 1e6:>7.1f}"
            )
    if "budget" not in r:  # --rows-only
        return "\n".join(lines)
    lines.append(_budget_line(r))
    for o in r["cold_overhead"]:
        lines.append(
            f"training a whole cold epoch at {r['probe_latency_ms']:g} ms, step on {o['threads']} thread(s): "
            f"data_overhead {o['data_overhead']} (rounds {o['rounds']}; {o['cold_s']} s vs {o['staged_s']} s for its "
            f"{o['steps']} steps on batches in memory); warm {o['warm_data_overhead']}"
        )
    lines += _open_lines(r)
    lines.append(f"precompute's final step, 1024 shards: {r['fetch_records_1024_s']:.3f} s; litdata: {r['litdata']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.speed_readers", description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=1024, help="samples of the cache built under --root")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--root", default=str(BENCH_ROOT), help="where the benchmark's cache is built once")
    p.add_argument("--cache", help="read this local cache instead of building one")
    p.add_argument("--json", action="store_true", help="print the figures as JSON alone")
    p.add_argument("--latency", help="the latency case: milliseconds per request, comma-separated (e.g. 0,20,80)")
    p.add_argument(
        "--rows-only", action="store_true", help="the latency case's rows alone (no budget, cold-epoch or open cases)"
    )
    p.add_argument("--bandwidth-mbps", type=float, default=0.0, help="the latency case's cap per answer (0: none)")
    p.add_argument(
        "--open-latency",
        type=float,
        help="only the opens (16 to 16,384 shards, 8 parts of a dataset) and precompute's final step, at ms",
    )
    p.add_argument(
        "--budget-latency", type=float, help="only the bytes an epoch downloads (a small shard cache), at ms"
    )
    args = p.parse_args(argv)
    if args.samples < 1 or args.rounds < 1:
        p.error("--samples and --rounds must be at least 1")
    if args.open_latency is not None:  # needs no cache of samples
        report = open_run(args.open_latency)
        print(json.dumps(report, indent=1) if args.json else _open_table(report))
        return 0
    if args.cache:
        cache = Path(args.cache)
        if not (cache / cf.MANIFEST).is_file():
            p.error(f"--cache {cache}: no {cf.MANIFEST} there; give a complete local cache")
    else:
        cache = ensure_cache(Path(args.root), "tiny", "tiny", 64, args.samples)
    if args.budget_latency is not None:
        report = budget_run(cache, args.budget_latency)
        print(json.dumps(report, indent=1) if args.json else _budget_line(report))
        return 0
    if args.latency:
        try:
            latencies = [float(x) for x in args.latency.split(",")]
        except ValueError:
            p.error(f"--latency {args.latency}: give milliseconds, comma-separated (e.g. 0,20,80)")
        report = latency_run(cache, latencies, args.bandwidth_mbps, args.rows_only)
        print(json.dumps(report, indent=1) if args.json else _latency_table(report))
        return 0
    report = run(cache, args.rounds)
    print(json.dumps(report, indent=1) if args.json else _table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
