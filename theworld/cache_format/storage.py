"""A cache location may be a URL: `s3://bucket/prefix` (read and write), `gs://`, `hf://`, `https://` (read), through
fsspec, with credentials and endpoints as those libraries take them (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...) plus the
config's `storage.options`.

A remote cache is used through a local stand-in folder that looks like a cache (its manifest, sidecars, errors and
run record, fetched first), so the cache format's code reads and writes local files as always; only the shards' tars
stay remote. A reader stages whole shards into a bounded per-node shard cache (`storage.local_dir`, at most
`storage.local_max_gb`, least recently used evicted first), so an epoch that fits is downloaded once. A writer finishes
each shard locally and puts it as one object (tar, then sidecar: the sidecar marks it done), the manifest last.

Messages name the URL, not the stand-in: `theworld.core.errors.show_as` maps one to the other. docs/cache-format.md,
"Object
storage".
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import gzip
import hashlib
import json
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from theworld.cache_format import index, sample_index
from theworld.cache_format.layout import (
    REBUILD_MANIFEST,
    REMOTE_INDEX,
    atomic_write_bytes,
    error_path,
    read_index_part,
    sha256_file,
    sidecar_path,
    tar_path,
)
from theworld.cache_format.names import ERRORS, ERRORS_DIR, MANIFEST, RECORDS, RUN_FILE, SHARD_INDEX, SHARDS
from theworld.cache_format.settings import Settings
from theworld.core import atomic, location, log
from theworld.core.errors import UserError, one_line, show_as
from theworld.core.location import is_url

_log = log.get(__name__)

T = TypeVar("T")
READ_ONLY = ("http", "https", "hf")  # fsspec reads these; a cache is not written there
PART_BYTES = 8 << 20  # a shard is downloaded in range requests of this size ...
PARTS_IN_FLIGHT = 8  # ... this many at once (the bytes one download holds in memory)
CONNECTIONS = 32  # small objects (sidecars, index objects, error files) requested at once
POOL_CONNECTIONS = 64  # a process's connections to a bucket
# The shard index's first part and its shard table are asked for with the manifest, up to this many bytes each, before
# the manifest says what they are: a cache whose index is one part this size or less (tens of thousands of samples:
# docs/cache-format.md) then opens in one round of requests. A larger object (or one the manifest names otherwise) is
# fetched once the manifest is read.
GUESS_BYTES = 4 << 20
RANGED = ("s3", "s3a", "gs", "gcs")  # object stores that answer a byte range (an HTTP server may send the whole file)
# A staged shard no reader has opened yet (read ahead) carries a modification time this far in the future, so the
# least-recently-used eviction takes it last; opening it sets the time to now (`open_tar`)
UNREAD_S = 10 * 365 * 86400


class ShardCacheFull(UserError):
    """The local shard cache cannot hold a shard: a problem of this node's disk, not of the cache."""


class NoRoomAhead(Exception):
    """A read-ahead would evict a shard that was read ahead and is not read yet: it is left to the read that needs
    it, so read-ahead never costs a download twice."""


@dataclass(frozen=True)
class RetryPolicy:
    """The one retry policy of network calls, handed to the client's own retries (botocore's standard mode; s3fs's
    own retry loop is turned off, so retries do not nest). Each call then has a deadline: attempts x (connect + read
    timeout + backoff). Only what the client cannot retry (a body cut short after its answer began) is retried here,
    with the same attempts, and all of a process's retries together stop after `command_s`."""

    attempts: int = 3  # the first try included
    # an endpoint that drops connections: attempts x connect_s plus botocore's backoff (< 3 s), one line within 10 s
    connect_s: float = 1.0
    read_s: float = 20.0  # a server that accepts and never answers: an error after attempts x read_s
    command_s: float = 300.0  # wall-clock bound on the retries of a whole command (per process)
    backoff_s: float = 0.2  # first wait of a retry here; doubled after each

    def client_options(self, scheme: str, options: dict) -> dict:
        """`options` (the config's storage.options, which win) with this policy in the client's own terms."""
        if scheme not in ("s3", "s3a"):
            return dict(options)
        config = {
            "retries": {"total_max_attempts": self.attempts, "mode": "standard"},
            "connect_timeout": self.connect_s,
            "read_timeout": self.read_s,
            # botocore's pool of 10 would queue what a process asks for at once: the first shards' downloads
            # (8 x PARTS_IN_FLIGHT ranges), CONNECTIONS small objects, a mixture's caches opening together
            "max_pool_connections": POOL_CONNECTIONS,
        }
        return {**options, "config_kwargs": {**config, **options.get("config_kwargs", {})}}


POLICY = RetryPolicy()
# Errors of a body cut short after its answer began: what the client's retries (which cover a request) do not see
BODY_ERRORS = (
    "ClientPayloadError",
    "IncompleteRead",
    "ServerDisconnectedError",
    "ResponseStreamingError",
    "_ShortRead",
)
_retrying_since: list[float] = []  # when this process first retried (the command's bound counts from there)
_BOTO_LOADER: list = []  # botocore's data loader (its parsed service models) of this process's first S3 session
_FILESYSTEMS: dict[tuple, Any] = {}  # (process, scheme, storage.options, env) -> the filesystem its caches share
CLIENT_ENV = ("AWS_", "S3_", "GOOGLE_", "GCE_", "FSSPEC_")  # variables a filesystem's client reads as it is made
_FS_LOCK = threading.Lock()


# ----------------------------------------------------------------------------------------------------------------------
# One remote cache


class RemoteCache:
    """The cache at `url`: its stand-in folder (`local`), reads, writes and the shard cache. Picklable: the fsspec
    filesystem is made again in each process (DataLoader workers)."""

    def __init__(self, url: str, settings: Settings):
        where = location.remote(url)  # no bucket, an empty segment or a bad bucket name: one line here
        self.url, self.scheme, rest = where.url, where.scheme, where.path
        self.settings = settings
        self.local = settings.folder / "caches" / self.scheme / _safe_path(rest)
        self.shard_dir = settings.folder / "shards"
        self._fs, self._pid = None, 0
        self._root = ""
        self._checked: set[str] = set()  # sha256 of staged shards this process has re-hashed
        self._manifest: dict | None = None  # the stand-in's manifest as fetch_index parsed it (take_manifest)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_fs": None, "_checked": set(), "_manifest": None}

    @property
    def fs(self):
        # made again in a forked process (a DataLoader worker): fsspec's async filesystems are not fork-safe; under a
        # lock, and marked as this process's only once made, since a worker's read-ahead thread asks for it too
        if self._fs is None or self._pid != os.getpid():
            with _FS_LOCK:
                if self._fs is None or self._pid != os.getpid():
                    self._fs, self._root = self._make_fs()
                    self._pid = os.getpid()
        return self._fs

    def _make_fs(self):
        """(filesystem, this cache's root in it). One filesystem per process for every cache of the same scheme,
        storage.options and client environment (the caches of a mixture: a client is 50 ms of CPU, in each process and
        loader worker), unless the options ask for `skip_instance_cache`."""
        import fsspec

        given = json.dumps(self.settings.options, sort_keys=True, default=repr)
        # the endpoint and credentials the client reads from the environment: a changed one is another client
        env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(CLIENT_ENV)))
        key = (os.getpid(), self.scheme, given, env)
        shared = not self.settings.options.get("skip_instance_cache")
        if shared and key in _FILESYSTEMS:
            fs = _FILESYSTEMS[key]
            return fs, type(fs)._strip_protocol(self.url)
        options = POLICY.client_options(self.scheme, self.settings.options)
        if self.scheme in ("s3", "s3a") and "session" not in options:
            options["session"] = _s3_session()
        try:
            fs, root = fsspec.core.url_to_fs(self.url, **options)
        except ImportError as e:  # fsspec names the package to install (s3fs, gcsfs)
            raise UserError(f"{self.url}: {one_line(e)}") from None
        except (ValueError, TypeError) as e:
            raise UserError(f"{self.url}: {one_line(e, 200)}; check the URL and storage.options") from None
        if hasattr(fs, "retries") and self.scheme in ("s3", "s3a"):
            fs.retries = 1  # s3fs's own loop off: botocore's retries are the one layer (RetryPolicy)
        if shared:
            _FILESYSTEMS[key] = fs
        return fs, root

    def path(self, name: str) -> str:
        self.fs  # noqa: B018 - sets _root
        return f"{self._root.rstrip('/')}/{name}" if name else self._root

    def object_url(self, name: str) -> str:
        return f"{self.url}/{name}"

    # -- network operations, each retried ----------------------------------------------------------------------------

    def _call(self, what: str, fn: Callable[[], T], missing_ok: bool = False) -> T | None:
        """fn() (the client retries it under POLICY); a missing object is None (missing_ok) or an error, anything
        else one line naming `what`."""
        try:
            return fn()
        except FileNotFoundError:
            if missing_ok:
                return None
            raise UserError(f"{what}: not found; rerun the precompute command that built this cache") from None
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - every failure the client gave up on is one line
            raise self._failure(what, e) from None

    def _failure(self, what: str, e: BaseException) -> UserError:
        if (line := self._fatal(e)) is not None:
            return UserError(f"{what}: {line}")
        return UserError(
            f"{what}: failed after {POLICY.attempts} attempts ({type(e).__name__}: {one_line(e, 200)}); check the "
            "network, the endpoint (AWS_ENDPOINT_URL) and the server, then rerun the same command (finished work "
            "is kept)"
        )

    def _fatal(self, e: Exception) -> str | None:
        """The one-line cause of an error that retrying does not mend, or None."""
        name = type(e).__name__
        if name in ("NoCredentialsError", "PartialCredentialsError") or "Unable to locate credentials" in str(e):
            return (
                "no credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT_URL for a server "
                "other than AWS), or give them in the config's storage.options"
            )
        if isinstance(e, PermissionError) or "AccessDenied" in str(e) or "InvalidAccessKeyId" in str(e):
            return f"access denied ({one_line(e, 160)}): check the credentials and the bucket's permissions"
        if isinstance(e, (ValueError, TypeError, NotImplementedError)):
            return f"{name}: {one_line(e, 200)}"
        return None

    def check_access(self) -> None:
        """The bucket (or repository, or server) answers: a missing bucket or credentials is one line now, not at the
        first shard."""
        bucket = self.path("").split("/")[0]
        if self.scheme in location.BUCKET_STORES:
            try:
                found = self._call(f"{self.url}", lambda: self.fs.info(bucket), missing_ok=True)
            except UserError as e:
                if "access denied" in str(e):  # a policy may grant the prefix but not the bucket's own metadata
                    return
                raise
            if found is None:
                raise UserError(
                    f"{self.url}: bucket {bucket} does not exist; create it (e.g. aws s3 mb {self.scheme}://{bucket}) "
                    "or fix the URL"
                )

    def read(self, name: str) -> bytes | None:
        """A small object's bytes (manifest, sidecar, errors), or None when it does not exist."""
        # s3fs asks for an object's size (a HEAD, one round trip more) before a GET of it unless told one request
        # at a time will do, as it does for an object this small
        one = {"max_concurrency": 1} if self.scheme in ("s3", "s3a") else {}
        return self._call(self.object_url(name), lambda: self.fs.cat_file(self.path(name), **one), missing_ok=True)

    def listing(self, folder: str) -> dict[str, int]:
        """{file name: size} of the objects directly under `folder` ({} when there are none)."""
        return {name: size for name, (size, _) in self.listed(folder).items()}

    def listed(self, folder: str) -> dict[str, tuple[int, str | None]]:
        """{file name: (size, md5 hex or None)} of the objects directly under `folder`: the md5 where the listing
        gives one (S3's ETag of an object put in one part)."""
        found = self._call(
            self.object_url(folder), lambda: self.fs.ls(self.path(folder), detail=True, refresh=True), missing_ok=True
        )
        out = {}
        for e in (e for e in found or [] if e["type"] == "file"):
            etag = str(e.get("ETag") or e.get("etag") or "").strip('"')
            size = e.get("size")  # an HTTP folder listing names links without their sizes: a HEAD each
            if size is None:
                where = e["name"] if is_url(e["name"]) else self.object_url(e["name"])
                size = self._call(where, lambda e=e: self.fs.size(e["name"]), missing_ok=True)
            md5 = etag if re.fullmatch(r"[0-9a-f]{32}", etag) else None  # "<md5>-<parts>": a multipart put's
            out[e["name"].rstrip("/").rsplit("/", 1)[-1]] = (int(size or 0), md5)
        return out

    def put(self, local: Path, name: str) -> None:
        """One object from a finished local file; a put is all or nothing, so a killed upload leaves no object."""
        self._check_writable()
        self._call(f"uploading {self.object_url(name)}", lambda: self.fs.put_file(str(local), self.path(name)))

    def delete(self, name: str) -> None:
        self._check_writable()
        with contextlib.suppress(FileNotFoundError):
            self._call(f"deleting {self.object_url(name)}", lambda: self.fs.rm_file(self.path(name)), missing_ok=True)

    def _check_writable(self) -> None:
        if self.scheme in READ_ONLY:
            raise UserError(
                f"output_dir {self.url}: {self.scheme}:// is read-only here; write the cache to s3:// or gs://"
            )

    # -- the stand-in folder -------------------------------------------------------------------------------------------

    def fetch_index(self) -> Path:
        """Fetch the manifest, errors and run record, then the shard index the manifest names (a few objects, at
        once) into the stand-in folder. A cache written before the shard index, or one whose index object is missing
        or stale, has its sidecars fetched instead (at once, with a note of the cost); sidecars the folder already
        holds for the manifest's shards are kept. A missing manifest leaves none there, so `load_manifest` says
        why. The bucket is asked about only when the manifest is missing (a missing bucket is then named): a cache
        that opens pays no request for it, and its shards are not listed (CacheReader.check_consistency)."""
        make_dir(self.local / SHARDS)
        small = (MANIFEST, ERRORS, RUN_FILE)
        guesses = (f"{SHARD_INDEX}/{index.part_name(0)}", f"{SHARD_INDEX}/{index.TABLE}")
        with ThreadPoolExecutor(len(small) + len(guesses)) as pool:
            reads = {n: pool.submit(self.read, n) for n in small}
            reads |= {n: pool.submit(self._guess, n) for n in guesses}
        for name in small:
            self._keep(name, reads[name].result())
        guessed = {n: reads[n].result() for n in guesses}
        manifest = self.local / MANIFEST
        if not manifest.is_file():  # load_manifest tells a half-written cache (shards, no manifest) from none
            self.check_access()
            for p in (self.local / SHARDS).glob("*"):
                p.unlink(missing_ok=True)
            if not self.listing(SHARDS):
                (self.local / SHARDS).rmdir()
            return self.local
        try:
            m = json.loads(manifest.read_bytes())
            self._manifest = m if isinstance(m, dict) else None
            shards, parts = m.get("shards"), m.get("shard_index")
            n = len(shards) if isinstance(shards, list) else int(m.get("num_shards", 0))
        except (ValueError, AttributeError, RecursionError, TypeError):
            return self.local  # load_manifest says what is wrong with it
        if _lazy(m):  # the shard table now, each part when a sample of it is read (index_part)
            self._drop_other_copies([m["shard_table"], *parts])
            self._link_table(m["shard_table"], guessed)
            return self.local
        indexed = self._fetch_shard_index(parts, guessed) if isinstance(parts, list) else set()
        for p in (self.local / SHARDS).glob("shard-*.json"):
            if p.stem[6:].isdigit() and int(p.stem[6:]) in indexed:
                p.unlink(missing_ok=True)  # the index's record is the current one
        wanted = []
        for i in sorted(set(range(n)) - indexed):  # set arithmetic: no Python step per indexed shard
            side = sidecar_path(self.local, i)
            entry = shards[i] if isinstance(shards, list) else None
            have = _json_field(side, "sha256") if side.is_file() else None
            if not isinstance(entry, dict) or have is None or have != entry.get("sha256"):
                wanted.append(f"{SHARDS}/{side.name}")
        if wanted and not isinstance(parts, list):
            _log.info(
                f"{self.url}: written before the shard index, so opening it reads {len(wanted)} sidecar(s), one "
                "request each (at once); a cache written now opens with a few requests"
            )
        for name, data in self.read_many(wanted).items():
            self._keep(name, data)
        return self.local

    def take_manifest(self) -> dict | None:
        """The manifest fetch_index parsed, once (a reader's load_manifest need not parse it again: 0.8 s a process
        at DataComp-1B), or None."""
        m, self._manifest = self._manifest, None
        return m

    def _guess(self, name: str) -> bytes | None:
        """Object `name` whole if it holds under GUESS_BYTES (one range request), else None: a guess at what the
        manifest will name, so a missing object, a larger one or a failure is None, never an error."""
        if self.scheme not in RANGED:
            return None
        try:
            data = self.fs.cat_file(self.path(name), start=0, end=GUESS_BYTES)
        except Exception:  # noqa: BLE001 - the manifest's own fetch of it retries and reports
            return None
        return data if len(data) < GUESS_BYTES else None

    def _fetch_shard_index(self, parts: list, guessed: dict[str, bytes | None]) -> set[int]:
        """The shard-index objects the manifest names, each checked against its entry, into the stand-in's
        REMOTE_INDEX folder; the shards they cover. `guessed`: objects fetched with the manifest (`_guess`), used
        where they are what the manifest lists. A missing or stale one is left out with a note (its shards'
        sidecars are fetched instead)."""
        folder = self.local / REMOTE_INDEX
        make_dir(folder)
        try:
            names = [str(e["path"]) for e in parts]
        except (TypeError, KeyError):
            names = []
        # The processes of a node open at once: another's part in the making, or one it may be reading (the same
        # name holds the same checked bytes), stays; another cache's parts and a killed process's partials go.
        current = {Path(n).name for n in names}
        for p in folder.iterdir():
            if p.name not in current and not atomic.is_partial(p.name):
                p.unlink(missing_ok=True)
        atomic.remove_stale(folder)
        known = {n: d for e, n in zip(parts, names) if (d := _as_listed(guessed.get(n), e)) is not None}
        fetched = {**known, **self.read_many([n for n in names if n not in known])}
        covered: set[int] = set()
        for entry, name in zip(parts, names):
            data = fetched[name]
            try:
                if data is None:
                    raise ValueError("missing")
                if name.endswith(index.SUFFIX):
                    index.decode(data, entry)
                else:  # format 3: gzipped JSON of whole sidecars
                    read_index_part(data, entry)
            except (ValueError, KeyError, TypeError, OSError, EOFError) as e:
                _log.warning(
                    f"{self.object_url(name)}: shard index object {one_line(e, 120)}; reading the sidecars of its "
                    "shards instead (rerun the precompute command that built this cache to rewrite it)"
                )
                (folder / Path(name).name).unlink(missing_ok=True)
                continue
            target = folder / Path(name).name
            if not (target.is_file() and target.read_bytes() == data):
                atomic_write_bytes(target, data)
            covered.update(range(*entry["shards"]))
        return covered

    def index_part(self, entry: dict) -> Path:
        """The node's copy of a shard index part (sample_index.Lazy), memory-mapped by the node's processes."""
        return self._node_copy(entry)

    def _link_table(self, entry: dict, guessed: dict[str, bytes | None]) -> None:
        """A lazily read cache's shard table (GBs at DataComp size) as the stand-in's: the node's copy
        (`_node_copy`), linked into place, so the node's other processes and later runs open it without a request.
        Its sha256 is checked again as the reader opens it (index.read_table)."""
        copy = self._node_copy(entry, guessed)
        target = self.local / entry["path"]  # a path inside the cache: _node_copy checked it
        with contextlib.suppress(FileNotFoundError):
            if os.path.samefile(copy, target):
                return
        target.parent.mkdir(parents=True, exist_ok=True)
        link = atomic.partial_path(target)
        link.unlink(missing_ok=True)
        try:
            os.link(copy, link)
        except OSError:  # a file system without hard links: a copy
            shutil.copyfile(copy, link)
        os.replace(link, target)

    def _drop_other_copies(self, entries: list) -> None:
        """The node's copies of index objects this cache's manifest no longer names (an earlier version's table and
        parts: GBs each at DataComp size) go; a process still reading one keeps its mapping."""
        folder = self.local / REMOTE_INDEX
        current = {_copy_name(e[2]) for e in map(_index_entry, entries) if e is not None}
        for p in folder.glob(_copy_name("*")) if folder.is_dir() else ():
            if p.name not in current and SHA256_HEX.fullmatch(p.name.removesuffix(index.SUFFIX)):
                p.unlink(missing_ok=True)

    def _node_copy(self, entry: dict, guessed: dict[str, bytes | None] | None = None) -> Path:
        """The node's copy of the index object `entry` names (the shard table, a part; `_copy_name`). The first
        process of the node that needs it downloads it, under the node's lock: by ranges several at once, written as
        they come and hashed, renamed into place once it is what the manifest lists (`guessed`: its bytes fetched
        with the manifest, used if they are)."""
        if (listed := _index_entry(entry)) is None:
            raise UserError(
                f"{self.object_url(MANIFEST)}: an index object's entry {one_line(repr(entry), 100)} is not "
                f"{{path, bytes, sha256}} of an object inside the cache; {REBUILD_MANIFEST}"
            )
        name, size, sha256 = listed
        folder = self.local / REMOTE_INDEX
        make_dir(folder)
        path = folder / _copy_name(sha256)
        if path.is_file() and path.stat().st_size == size:
            return path
        with _locked(folder / ".download.lock"):  # one lock file for every object: none left behind per object
            if not (path.is_file() and path.stat().st_size == size):
                atomic.remove_stale(folder)  # what a killed download left
                data = _as_listed((guessed or {}).get(name), entry)
                if data is not None:
                    atomic_write_bytes(path, data)
                else:
                    part = atomic.partial_path(path)
                    fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
                    try:
                        self._download(name, fd, part, path, size, sha256)
                    finally:
                        os.close(fd)
        return path

    def read_many(self, names: list[str]) -> dict[str, bytes | None]:
        """{name: bytes, or None when there is no such object} of many small objects, CONNECTIONS requests at a
        time (each under POLICY, like `read`)."""
        if len(names) < 2:
            return {n: self.read(n) for n in names}
        self.fs  # noqa: B018 - made once here, not in each thread
        with ThreadPoolExecutor(min(CONNECTIONS, len(names))) as pool:
            return dict(zip(names, pool.map(self.read, names)))

    def _keep(self, name: str, data: bytes | None, fsync: bool = True) -> bool:
        """Object `name`'s bytes into the stand-in folder (None: remove the stand-in's copy). fsync=False: the caller
        syncs many files at once (`os.sync`) rather than each."""
        target = self.local / name
        if data is None:
            target.unlink(missing_ok=True)
            return False
        target.parent.mkdir(parents=True, exist_ok=True)
        with atomic.file(target, fsync=fsync) as tmp:
            tmp.write_bytes(data)
        return True

    def _mirror(self, name: str) -> bool:
        """Copy object `name` into the stand-in folder (or remove the stand-in's copy when there is none)."""
        return self._keep(name, self.read(name))

    # -- the shard cache -----------------------------------------------------------------------------------------------

    def open_tar(self, index: int, size: int, sha256: str) -> int:
        """A read-only descriptor of shard `index`'s tar, staged in the shard cache (downloaded when not there)."""
        for _ in range(3):  # another process may evict it between staging and opening
            path = self.stage(index, size, sha256)
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue
            os.utime(fd)  # the least recently used shard goes first (by descriptor: the name may be evicted by now)
            return fd
        raise UserError(f"{self.url}: the shard cache {self.shard_dir} evicts shards as fast as they come")

    def stage(self, index: int, size: int, sha256: str, ahead: bool = False) -> Path:
        """Shard `index` in the shard cache, by content (its sha256), downloaded once per node.

        The download goes to `.<sha256>.tar.part`, locked (flock) while it is written and renamed into place once its
        sha256 is checked: the lock keeps two processes from fetching it twice, dies with its process (kill -9
        included), and leaves no file behind; a `.part` is never read. `ahead` (read-ahead): raises NoRoomAhead
        rather than evict a shard that was read ahead and not read yet."""
        path = self.shard_dir / f"{sha256}.tar"
        if self._trusted(path, size, sha256, index):
            return path
        make_dir(self.shard_dir)
        part = path.with_name(f".{path.name}.part")
        while True:
            fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # flock, not lockf: held by this descriptor, so threads exclude too
                if self._trusted(path, size, sha256, index):
                    return path  # another process staged it while this one waited
                if not _same_file(fd, part):
                    continue  # renamed into place or dropped while this one waited: look again
                try:
                    self._make_room(size, index, fd, ahead)
                except BaseException:
                    part.unlink(missing_ok=True)  # nothing written (no room ahead, a full disk): no `.part` stays
                    raise
                name = f"{SHARDS}/{tar_path(self.local, index).name}"
                self._download(name, fd, part, path, size, sha256, unread=ahead)
                self._checked.add(sha256)
                return path
            finally:
                os.close(fd)

    def _trusted(self, path: Path, size: int, sha256: str, index: int) -> bool:
        """Whether the shard cache holds shard `index` intact: the size, and once per process the sha256 (a bit
        flipped on this node's disk is this node's problem: the copy is dropped and downloaded again)."""
        try:
            if path.stat().st_size != size:
                return False
        except FileNotFoundError:
            return False
        if sha256 in self._checked:
            return True
        try:
            got = sha256_file(path)
        except FileNotFoundError:
            return False
        if got != sha256:
            _log.warning(
                f"{self.url}: the staged copy {path} of {tar_path(self.local, index).name} is damaged on this node's "
                f"disk (sha256 {got[:12]}..., the manifest lists {sha256[:12]}...); downloading it again"
            )
            path.unlink(missing_ok=True)
            return False
        self._checked.add(sha256)
        return True

    def _download(
        self, name: str, fd: int, part: Path, path: Path, size: int, sha256: str, unread: bool = False
    ) -> None:
        """The object `name` into `fd` (the locked `part`) by range requests, several at once, hashed in order;
        renamed to `path` once it is what the manifest lists (`unread`: a shard marked read ahead, UNREAD_S)."""
        h = hashlib.sha256()
        os.ftruncate(fd, size)  # its reservation (_make_room); what a killed download left past it goes
        try:
            step = PART_BYTES * PARTS_IN_FLIGHT
            for lo in range(0, max(size, 1), step):
                starts = list(range(lo, min(size, lo + step), PART_BYTES)) or [0]
                ends = [min(x + PART_BYTES, size) for x in starts]
                ends[-1] += ends[-1] == size  # one byte more at the end: an object longer than listed shows
                got = 0
                for start, block in zip(starts, self._ranges(name, starts, ends, size)):
                    h.update(block[: size - start])
                    os.pwrite(fd, block, start)
                    got = start + len(block)
            if got != size or h.hexdigest() != sha256:
                raise UserError(
                    f"{self.object_url(name)}: the object is not what the manifest lists ({got} bytes, sha256 "
                    f"{h.hexdigest()[:12]}... vs {size} and {sha256[:12]}...): the cache changed after it was built; "
                    "rerun the precompute command that built it"
                )
            if unread:  # evicted last until a reader opens it (open_tar sets the time to now)
                os.utime(fd, (time.time(), time.time() + UNREAD_S))
            os.replace(part, path)
        except OSError as e:
            part.unlink(missing_ok=True)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise self._full(f"no space left on device staging {self.object_url(name)}") from None
            raise
        except BaseException:
            part.unlink(missing_ok=True)
            raise

    def holds(self, sha256: str) -> bool:
        """Whether the shard cache holds the shard of this sha256 (staged, whole)."""
        return (self.shard_dir / f"{sha256}.tar").is_file()

    def read_ranges(self, name: str, starts: list[int], ends: list[int], size: int) -> list[bytes]:
        """Byte ranges of object `name` (of `size` bytes), requested at once and not staged: a few samples' captions
        need not download their whole shard. The caller checks each member's crc32."""
        return self._ranges(name, starts, ends, size)

    def _ranges(self, name: str, starts: list[int], ends: list[int], size: int) -> list[bytes]:
        """The byte ranges [start, end) of object `name`, requested at once; a range whose body was cut short
        (which the client's retries do not cover) is asked for again under POLICY."""
        where, out = self.object_url(name), [b""] * len(starts)
        todo, wait = list(range(len(starts))), POLICY.backoff_s
        for attempt in range(POLICY.attempts):
            lo, hi = [starts[i] for i in todo], [ends[i] for i in todo]
            got = self._call(
                where, lambda lo=lo, hi=hi: self.fs.cat_ranges([self.path(name)] * len(lo), lo, hi, on_error="return")
            )
            failed = []
            for i, r in zip(todo, got):
                if isinstance(r, FileNotFoundError):
                    raise UserError(f"{where}: not found; rerun the precompute command that built this cache")
                if isinstance(r, BaseException) and type(r).__name__ not in BODY_ERRORS:
                    raise self._failure(where, r)
                want = min(ends[i], size) - starts[i]
                if not isinstance(r, BaseException) and len(r) < want:
                    r = _ShortRead(len(r), want)  # a truncated body
                if isinstance(r, BaseException):
                    failed.append((i, r))
                else:
                    out[i] = r
            if not failed:
                return out
            todo = [i for i, _ in failed]
            if attempt == POLICY.attempts - 1 or not _may_retry():
                raise self._failure(where, failed[0][1])
            _log.warning(f"{where}: {type(failed[0][1]).__name__} in {len(todo)} range(s); retry in {wait:g} s")
            time.sleep(wait)
            wait *= 2
        raise AssertionError("unreachable")

    def _make_room(self, size: int, index: int, fd: int, ahead: bool = False) -> None:
        """Evict the least recently used shards until `size` more bytes fit under storage.local_max_gb, then reserve
        them: the download's `.part` (`fd`) takes its size at once, so downloads in flight, of this process or
        another, count against the budget from their start. Downloads that died with their process (an unlocked
        `.part`) go. Shards read ahead and not opened yet go last; a read-ahead (`ahead`) that would have to evict
        one, or wait for a download in flight, raises NoRoomAhead instead: a window and read-ahead larger than the
        budget then download each shard once, reading ahead only as far as the budget allows."""
        budget = self.settings.budget
        if size > budget:
            raise self._full(
                f"shard {tar_path(self.local, index).name} ({size / 1e9:.3g} GB) is larger than storage.local_max_gb "
                f"{self.settings.local_max_gb:g}"
            )
        with _locked(self.shard_dir / ".evict.lock"):
            _drop_dead_parts(self.shard_dir)
            files, mine = [], os.fstat(fd).st_ino
            for p in self.shard_dir.glob("*.tar"):
                with contextlib.suppress(FileNotFoundError):
                    st = p.stat()
                    files.append((st.st_mtime, st.st_size, p))
            flight = 0  # bytes reserved by the other downloads under way
            for p in self.shard_dir.glob(".*.part"):
                with contextlib.suppress(FileNotFoundError):
                    st = p.stat()
                    flight += st.st_size if st.st_ino != mine else 0
            used, now = sum(s for _, s, _ in files) + flight, time.time()
            if ahead and flight + sum(s for m, s, _ in files if m > now) + size > budget:
                raise NoRoomAhead(f"{tar_path(self.local, index).name}: the shard cache holds shards not read yet")
            for _, s, p in sorted(files):
                if used + size <= budget:
                    break
                p.unlink(missing_ok=True)  # a reader that has it open keeps reading it
                used -= s
            try:
                os.ftruncate(fd, size)  # the reservation (a sparse file until written)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise self._full(f"no space left on device for shard {tar_path(self.local, index).name}") from None
                raise

    def _full(self, what: str) -> ShardCacheFull:
        return ShardCacheFull(
            f"{self.url}: the local shard cache {self.shard_dir} is full ({what}): raise storage.local_max_gb, free "
            "space there or point storage.local_dir at a larger disk, then rerun the same command"
        )


class _ShortRead(OSError):
    """A range answered with fewer bytes than asked for (a truncated body)."""

    def __init__(self, got: int, want: int):
        super().__init__(f"{got} of {want} bytes")


def _s3_session():
    """An aiobotocore session that shares the parsed service models of this process's first one, which a forked
    DataLoader worker inherits: the worker's first request then skips re-reading botocore's JSON (about a second of a
    worker's start on a loaded machine, on the way to the first batch). The session itself is new: its credentials
    and connections belong to this process."""
    from aiobotocore.session import AioSession

    session = AioSession()
    if _BOTO_LOADER:
        session.register_component("data_loader", _BOTO_LOADER[0])
    else:
        _BOTO_LOADER.append(session.get_component("data_loader"))
    return session


def _may_retry() -> bool:
    """Whether this process is still within POLICY.command_s of its first retry."""
    if not _retrying_since:
        _retrying_since.append(time.monotonic())
    return time.monotonic() - _retrying_since[0] < POLICY.command_s


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def _drop_dead_parts(folder: Path) -> None:
    """Remove the `.part` files of downloads whose process died (nobody holds their lock)."""
    for p in folder.glob(".*.part"):
        try:
            fd = os.open(p, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if _same_file(fd, p):
                p.unlink(missing_ok=True)
        except OSError:
            pass  # being written
        finally:
            os.close(fd)


def make_dir(path: Path) -> None:
    """`path` as a folder, or one line on storage.local_dir (a file there, a read-only disk)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        if not os.access(path, os.W_OK):
            raise PermissionError(errno.EACCES, "not writable")
    except OSError as e:
        raise UserError(
            f"config key 'storage.local_dir': cannot use {path} as a folder ({e.strerror or e}); point "
            "storage.local_dir at a writable folder"
        ) from None


def _safe_path(rest: str) -> str:
    """A URL's bucket and prefix as a relative local path (no '..', no empty parts)."""
    parts = [re.sub(r"[^A-Za-z0-9._=-]", "_", p) for p in rest.split("/") if p not in ("", ".", "..")]
    return "/".join(parts) or "_"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------------------------------------------------
# Where callers start


def open_cache(
    location: str | Path,
    settings: Settings | None = None,
    remote: RemoteCache | None = None,
) -> tuple[Path, RemoteCache | None]:
    """(the folder to read, the remote cache or None): a local path as it is; a URL's stand-in folder, its index
    fetched first. `remote`: a cache handle opened before (its stand-in folder is `location`), used as it is."""
    if remote is not None:
        return remote.local, remote
    if not is_url(str(location)):
        return Path(location), None
    remote = RemoteCache(str(location), settings or Settings())
    show_as(remote.local, remote.url)
    return remote.fetch_index(), remote


def for_writing(location: str, settings: Settings) -> RemoteWriter:
    """The remote cache a precompute writes, its stand-in folder named as the URL in messages."""
    remote = RemoteCache(location, settings)
    remote._check_writable()
    show_as(remote.local, remote.url)
    return RemoteWriter(remote)


# ----------------------------------------------------------------------------------------------------------------------
# Writing (precompute): shards are finished in the stand-in folder, then put one object each


class RemoteWriter:
    """What precompute does to a remote output_dir, around its usual work in the stand-in folder `remote.local`."""

    def __init__(self, remote: RemoteCache):
        self.remote = remote
        self.out = remote.local

    def prepare(self) -> None:
        """Before the identity check (once per node): the bucket answers, and the stand-in holds the remote run
        record, or nothing of an older cache once at this URL."""
        r = self.remote
        r.check_access()
        self.out.mkdir(parents=True, exist_ok=True)
        before = _read(self.out / RUN_FILE)
        if r._mirror(RUN_FILE):
            if _read(self.out / RUN_FILE) == before:
                return  # the stand-in's shards belong to the cache in the bucket
        elif any(n.endswith(".tar") for n in r.listing(SHARDS)):
            raise UserError(
                f"output_dir {r.url} holds shards but no {RUN_FILE}, so what built them is unknown: use another "
                "output_dir or delete it"
            )
        for folder in (SHARDS, ERRORS_DIR, SHARD_INDEX, REMOTE_INDEX, RECORDS):  # another cache's, once at this URL
            for p in (self.out / folder).glob("*"):
                p.unlink(missing_ok=True)
        (self.out / MANIFEST).unlink(missing_ok=True)

    def claimed(self) -> None:
        """Rank 0, after claim_output: the run record goes up first, so a rerun anywhere checks against it."""
        if self.remote.read(RUN_FILE) is None:
            self.remote.put(self.out / RUN_FILE, RUN_FILE)

    def done(self) -> set[int]:
        """Shards whose sidecar object exists (put after its tar and error file: all three are there)."""
        names = self.remote.listing(SHARDS)
        errors = self.remote.listing(ERRORS_DIR)
        out = set()
        for name in names:
            stem, dot, ext = name.partition(".")
            if ext == "json" and f"{stem}.tar" in names and f"{stem}.jsonl" in errors and stem[6:].isdigit():
                out.add(int(stem[6:]))
        return out

    def publish(self, index: int) -> None:
        """Shard `index`, finished in the stand-in: its error file, its tar, then its sidecar (which marks it done),
        each one object; the local tar goes once it is up."""
        tar, side = tar_path(self.out, index), sidecar_path(self.out, index)
        self.remote.put(error_path(self.out, index), f"{ERRORS_DIR}/{error_path(self.out, index).name}")
        self.remote.put(tar, f"{SHARDS}/{tar.name}")
        self.remote.put(side, f"{SHARDS}/{side.name}")
        tar.unlink(missing_ok=True)

    def put_records(self, rank: int, shards: range) -> None:
        """Each process, once its shards are up: the sidecars and error files of its shards that this node holds, in
        one object (RECORDS/rank-N.json.gz), so the final step reads one object per process, not two per shard."""
        files = {}
        for i in shards:
            for path, folder in ((sidecar_path(self.out, i), SHARDS), (error_path(self.out, i), ERRORS_DIR)):
                if (data := _read(path)) is not None:
                    files[f"{folder}/{path.name}"] = data.decode("latin-1")  # any bytes, back as they were
        if files:
            local = self.out / RECORDS / f"rank-{rank:05d}.json.gz"
            local.parent.mkdir(parents=True, exist_ok=True)
            text = json.dumps({"files": files}, sort_keys=True, separators=(",", ":"))
            atomic_write_bytes(local, gzip.compress(text.encode(), compresslevel=1, mtime=0))
            self.remote.put(local, f"{RECORDS}/{local.name}")

    def fetch_records(self, n_shards: int) -> None:
        """Rank 0, once every process is through: every shard's sidecar and error file from the bucket (other nodes
        wrote some). Three listings, then the processes' record objects (`put_records`) at once; a file is taken
        from them where its md5 is the one the listing gives, and requested alone (at once) otherwise. Each tar's
        size is checked against its sidecar."""
        listed = {SHARDS: self.remote.listed(SHARDS), ERRORS_DIR: self.remote.listed(ERRORS_DIR)}
        bundles = self.remote.read_many([f"{RECORDS}/{n}" for n in self.remote.listing(RECORDS)])
        held = {}
        for data in bundles.values():
            with contextlib.suppress(ValueError, TypeError, KeyError, EOFError, OSError, AttributeError):
                held.update(json.loads(gzip.decompress(data or b""))["files"])
        wanted = []
        for i in range(n_shards):
            for local, folder in ((sidecar_path(self.out, i), SHARDS), (error_path(self.out, i), ERRORS_DIR)):
                name = f"{folder}/{local.name}"
                if local.name not in listed[folder]:
                    raise RuntimeError(f"{self.remote.object_url(name)} is missing after all processes finished")
                if local.is_file():  # a file this node put is the object (the same run writes the same bytes)
                    continue
                data = held[name].encode("latin-1") if name in held else None
                if data is not None and hashlib.md5(data).hexdigest() == listed[folder][local.name][1]:
                    self.remote._keep(name, data, fsync=False)
                else:
                    wanted.append(name)
        for name, data in self.remote.read_many(wanted).items():
            if not self.remote._keep(name, data, fsync=False):
                raise RuntimeError(f"{self.remote.object_url(name)} is missing after all processes finished")
        os.sync()  # once for the files above: one fsync each cost more than the requests
        for i in range(n_shards):
            got = listed[SHARDS].get(tar_path(self.out, i).name, (None,))[0]
            if got != _json_field(sidecar_path(self.out, i), "bytes"):
                raise RuntimeError(f"shard {i}'s tar is {got} bytes in the bucket, its sidecar says otherwise")

    def finish(self) -> None:
        """The shard index and errors.jsonl, then the manifest last: its object's presence means the cache is
        complete. Then the index parts the manifest does not name go (one listing)."""
        parts = [e["path"] for e in _json_field(self.out / MANIFEST, "shard_index") or []]
        if isinstance(table := _json_field(self.out / MANIFEST, "shard_table"), dict):
            parts.append(table["path"])
        with ThreadPoolExecutor(min(CONNECTIONS, len(parts) + 1)) as pool:
            list(pool.map(lambda name: self.remote.put(self.out / name, name), [*parts, ERRORS]))
        self.remote.put(self.out / MANIFEST, MANIFEST)
        for name in index.unnamed_parts(self.remote.listing(SHARD_INDEX), parts):
            self.remote.delete(f"{SHARD_INDEX}/{name}")

    def incomplete(self) -> None:
        """A shard is to be (re)done: the cache is not complete any more."""
        self.remote.delete(MANIFEST)


def _lazy(m: dict) -> bool:
    try:
        return sample_index.is_lazy(m)
    except (TypeError, KeyError, AttributeError):
        return False  # load_manifest says what is wrong with it


SHA256_HEX = re.compile("[0-9a-f]{64}")


def _copy_name(sha256: str) -> str:
    """The file name of the node's copy of an index object (REMOTE_INDEX): its sha256, so a rewritten cache never
    reads a stale one."""
    return f"{sha256}{index.SUFFIX}"


def _index_entry(entry: Any) -> tuple[str, int, str] | None:
    """(path, bytes, sha256) of a manifest entry naming an index object, or None where it is not one: a field
    missing or of another type, or a path that leaves the cache (absolute, or through "..")."""
    try:
        path, size, sha256 = entry["path"], entry["bytes"], entry["sha256"]
    except (TypeError, KeyError, IndexError):
        return None
    if not (isinstance(path, str) and isinstance(size, int) and isinstance(sha256, str)):
        return None
    parts = Path(path).parts
    if not parts or Path(path).is_absolute() or ".." in parts or size < 0 or not SHA256_HEX.fullmatch(sha256):
        return None
    return path, size, sha256


def _as_listed(data: bytes | None, entry: dict) -> bytes | None:
    """`data` if it is the object a manifest entry ({path, bytes, sha256}) lists, else None."""
    try:
        ok = data is not None and len(data) == entry["bytes"] and hashlib.sha256(data).hexdigest() == entry["sha256"]
    except (TypeError, KeyError):
        return None
    return data if ok else None


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def _json_field(path: Path, key: str) -> Any:
    try:
        return json.loads(path.read_bytes()).get(key)
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
