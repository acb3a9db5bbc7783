"""A cache location may be a URL: `s3://bucket/prefix` (read and write), `gs://`, `hf://`, `https://` (read), through
fsspec, with credentials and endpoints as those libraries take them (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...) plus the
config's `storage_options`.

A remote cache is used through a local stand-in folder that looks like a cache (its manifest, sidecars, errors and
run record, fetched first), so the cache format's code reads and writes local files as always; only the shards' tars
stay remote. A reader stages whole shards into a bounded per-node shard cache (`cache_local_dir`, at most
`cache_local_max_gb`, least recently used evicted first), so an epoch that fits is downloaded once. A writer finishes
each shard locally and puts it as one object (tar, then sidecar: the sidecar marks it done), the manifest last.

Messages name the URL, not the stand-in: `theworld.core.errors.show_as` maps one to the other. docs/cache-format.md,
"Object
storage".
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from theworld.cache_format.layout import atomic_write_bytes, error_path, sidecar_path, tar_path
from theworld.cache_format.names import ERRORS, ERRORS_DIR, MANIFEST, RUN_FILE, SHARDS
from theworld.core import location, log
from theworld.core.errors import UserError, one_line, show_as
from theworld.core.location import is_url

_log = log.get(__name__)

T = TypeVar("T")
DEFAULT_LOCAL_DIR = "~/.cache/theworld/object-store"
DEFAULT_MAX_GB = 100.0
READ_ONLY = ("http", "https", "hf")  # fsspec reads these; a cache is not written there
RETRIES = 5  # attempts of one network operation before its one-line error
BACKOFF_S = 0.5  # first wait; doubled after each failure


class ShardCacheFull(UserError):
    """The local shard cache cannot hold a shard: a problem of this node's disk, not of the cache."""


@dataclass
class Settings:
    """The config keys of object storage (both commands have them at the top level)."""

    storage_options: dict = field(default_factory=dict)  # passed to the fsspec filesystem
    cache_local_dir: str = DEFAULT_LOCAL_DIR  # per node: stand-in folders and the shard cache
    cache_local_max_gb: float = DEFAULT_MAX_GB  # the shard cache's bound

    @classmethod
    def of(cls, cfg: Any) -> Settings:
        return cls(dict(cfg.storage_options), cfg.cache_local_dir, cfg.cache_local_max_gb)

    def check(self) -> None:
        """What the config loader cannot check by type (called from the configs' __post_init__)."""
        if not self.cache_local_max_gb > 0:
            raise UserError(f"config key 'cache_local_max_gb': must be positive, got {self.cache_local_max_gb}")
        if not self.cache_local_dir.strip():
            raise UserError("config key 'cache_local_dir': empty; give a folder path")
        if is_url(self.cache_local_dir):
            raise UserError(f"config key 'cache_local_dir': {self.cache_local_dir} is a URL; give a local folder")

    @property
    def local_dir(self) -> Path:
        return Path(os.path.expanduser(self.cache_local_dir))


# ----------------------------------------------------------------------------------------------------------------------
# One remote cache


class RemoteCache:
    """The cache at `url`: its stand-in folder (`local`), reads, writes and the shard cache. Picklable: the fsspec
    filesystem is made again in each process (DataLoader workers)."""

    def __init__(self, url: str, settings: Settings):
        where = location.remote(url)  # no bucket, an empty segment or a bad bucket name: one line here
        self.url, self.scheme, rest = where.url, where.scheme, where.path
        self.settings = settings
        self.local = settings.local_dir / "caches" / self.scheme / _safe_path(rest)
        self.shard_dir = settings.local_dir / "shards"
        self._fs, self._pid = None, 0
        self._root = ""

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_fs": None}

    @property
    def fs(self):
        # made again in a forked process (a DataLoader worker): fsspec's async filesystems are not fork-safe
        if self._fs is None or self._pid != os.getpid():
            import fsspec

            self._pid = os.getpid()

            try:
                self._fs, self._root = fsspec.core.url_to_fs(self.url, **self.settings.storage_options)
            except ImportError as e:  # fsspec names the package to install (s3fs, gcsfs)
                raise UserError(f"{self.url}: {one_line(e)}") from None
            except (ValueError, TypeError) as e:
                raise UserError(f"{self.url}: {one_line(e, 200)}; check the URL and storage_options") from None
        return self._fs

    def path(self, name: str) -> str:
        self.fs  # noqa: B018 - sets _root
        return f"{self._root.rstrip('/')}/{name}" if name else self._root

    def object_url(self, name: str) -> str:
        return f"{self.url}/{name}"

    # -- network operations, each retried ----------------------------------------------------------------------------

    def _call(self, what: str, fn: Callable[[], T], missing_ok: bool = False) -> T | None:
        """fn() retried with backoff on errors that may pass; a missing object is None (missing_ok) or an error."""
        wait = BACKOFF_S
        for attempt in range(RETRIES):
            try:
                return fn()
            except FileNotFoundError:
                if missing_ok:
                    return None
                raise UserError(f"{what}: not found; rerun the precompute command that built this cache") from None
            except UserError:
                raise
            except Exception as e:  # noqa: BLE001 - sorted below: what no retry mends is one line at once
                if (line := self._fatal(e)) is not None:
                    raise UserError(f"{what}: {line}") from None
                if attempt == RETRIES - 1:
                    raise UserError(
                        f"{what}: failed {RETRIES} times ({type(e).__name__}: {one_line(e, 200)}); check the "
                        "network and the server, then rerun the same command (finished work is kept)"
                    ) from None
                _log.warning(f"{what}: {type(e).__name__}: {one_line(e, 120)}; retry in {wait:g} s")
                time.sleep(wait)
                wait *= 2
        raise AssertionError("unreachable")

    def _fatal(self, e: Exception) -> str | None:
        """The one-line cause of an error that retrying does not mend, or None."""
        name = type(e).__name__
        if name in ("NoCredentialsError", "PartialCredentialsError") or "Unable to locate credentials" in str(e):
            return (
                "no credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT_URL for a server "
                "other than AWS), or give them in the config's storage_options"
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
        return self._call(self.object_url(name), lambda: self.fs.cat_file(self.path(name)), missing_ok=True)

    def listing(self, folder: str) -> dict[str, int]:
        """{file name: size} of the objects directly under `folder` ({} when there are none)."""
        found = self._call(
            self.object_url(folder), lambda: self.fs.ls(self.path(folder), detail=True, refresh=True), missing_ok=True
        )
        out = {}
        for e in (e for e in found or [] if e["type"] == "file"):
            size = e.get("size")  # an HTTP folder listing names links without their sizes: a HEAD each
            if size is None:
                where = e["name"] if is_url(e["name"]) else self.object_url(e["name"])
                size = self._call(where, lambda e=e: self.fs.size(e["name"]), missing_ok=True)
            out[e["name"].rstrip("/").rsplit("/", 1)[-1]] = int(size or 0)
        return out

    def sizes(self, folder: str, names: list[str]) -> dict[str, int]:
        """{name: size} of the objects under `folder`: its listing, or (a server that lists nothing, e.g. plain
        HTTP without folder pages) each of `names` asked for alone."""
        if found := self.listing(folder):
            return found
        out = {}
        for n in names:
            size = self._call(
                self.object_url(f"{folder}/{n}"), lambda n=n: self.fs.size(self.path(f"{folder}/{n}")), True
            )
            if size is not None:
                out[n] = int(size)
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
        """Fetch the manifest, sidecars and errors into the stand-in folder (sidecars the folder already holds for
        the manifest's shards are kept); a missing manifest leaves none there, so `load_manifest` says why."""
        self.check_access()
        self.local.mkdir(parents=True, exist_ok=True)
        (self.local / SHARDS).mkdir(exist_ok=True)
        for name in (MANIFEST, ERRORS, RUN_FILE):
            self._mirror(name)
        manifest = self.local / MANIFEST
        if not manifest.is_file():  # load_manifest tells a half-written cache (shards, no manifest) from none
            for p in (self.local / SHARDS).glob("*"):
                p.unlink(missing_ok=True)
            if not self.listing(SHARDS):
                (self.local / SHARDS).rmdir()
            return self.local
        try:
            shards = json.loads(manifest.read_bytes()).get("shards") or []
        except (ValueError, AttributeError, RecursionError):
            return self.local  # load_manifest says what is wrong with it
        for i, entry in enumerate(shards):
            have = _json_field(sidecar_path(self.local, i), "sha256")
            if not isinstance(entry, dict) or have is None or have != entry.get("sha256"):
                self._mirror(f"{SHARDS}/{sidecar_path(self.local, i).name}")
        return self.local

    def _mirror(self, name: str) -> bool:
        """Copy object `name` into the stand-in folder (or remove the stand-in's copy when there is none)."""
        data = self.read(name)
        target = self.local / name
        if data is None:
            target.unlink(missing_ok=True)
            return False
        target.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(target, data)
        return True

    # -- the shard cache -----------------------------------------------------------------------------------------------

    def open_tar(self, index: int, size: int, sha256: str) -> int:
        """A read-only descriptor of shard `index`'s tar, staged in the shard cache (downloaded when not there)."""
        for _ in range(3):  # another process may evict it between staging and opening
            path = self.stage(index, size, sha256)
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue
            os.utime(path)  # the least recently used shard goes first
            return fd
        raise UserError(f"{self.url}: the shard cache {self.shard_dir} evicts shards as fast as they come")

    def stage(self, index: int, size: int, sha256: str) -> Path:
        """Shard `index` in the shard cache, by content (its sha256), downloaded once per node: a lock per shard keeps
        two processes from fetching it twice."""
        path = self.shard_dir / f"{sha256}.tar"
        if path.is_file() and path.stat().st_size == size:
            return path
        self.shard_dir.mkdir(parents=True, exist_ok=True)
        with _locked(self.shard_dir / f".{sha256}.lock"):
            if path.is_file() and path.stat().st_size == size:
                return path
            self._make_room(size, index)
            name = f"{SHARDS}/{tar_path(self.local, index).name}"
            self._call(self.object_url(name), lambda: self._download(name, path, size, sha256))
        return path

    def _download(self, name: str, path: Path, size: int, sha256: str) -> None:
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        h = hashlib.sha256()
        try:
            with self.fs.open(self.path(name), "rb", block_size=8 << 20) as src, open(tmp, "wb") as dst:
                while block := src.read(8 << 20):
                    h.update(block)
                    dst.write(block)
            got = os.path.getsize(tmp)
            if got != size or h.hexdigest() != sha256:
                raise UserError(
                    f"{self.object_url(name)}: the object is not the shard the manifest lists ({got} bytes, sha256 "
                    f"{h.hexdigest()[:12]}... vs {size} and {sha256[:12]}...): the cache changed after it was built; "
                    "rerun the precompute command that built it"
                )
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise self._full(f"no space left on device staging {self.object_url(name)}") from None
            raise
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def _make_room(self, size: int, index: int) -> None:
        """Evict the least recently used shards until `size` more bytes fit under cache_local_max_gb."""
        budget = int(self.settings.cache_local_max_gb * 1e9)
        if size > budget:
            raise self._full(
                f"shard {tar_path(self.local, index).name} ({size / 1e9:.3g} GB) is larger than cache_local_max_gb "
                f"{self.settings.cache_local_max_gb:g}"
            )
        with _locked(self.shard_dir / ".evict.lock"):
            files = []
            for p in self.shard_dir.glob("*.tar"):
                with contextlib.suppress(FileNotFoundError):
                    st = p.stat()
                    files.append((st.st_mtime, st.st_size, p))
            used = sum(s for _, s, _ in files)
            for _, s, p in sorted(files):
                if used + size <= budget:
                    break
                p.unlink(missing_ok=True)  # a reader that has it open keeps reading it
                used -= s

    def _full(self, what: str) -> ShardCacheFull:
        return ShardCacheFull(
            f"{self.url}: the local shard cache {self.shard_dir} is full ({what}): raise cache_local_max_gb, free "
            "space there or point cache_local_dir at a larger disk, then rerun the same command"
        )


def _safe_path(rest: str) -> str:
    """A URL's bucket and prefix as a relative local path (no '..', no empty parts)."""
    parts = [re.sub(r"[^A-Za-z0-9._=-]", "_", p) for p in rest.split("/") if p not in ("", ".", "..")]
    return "/".join(parts) or "_"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------------------------------------------------
# Where callers start


def open_cache(location: str | Path, settings: Settings | None = None) -> tuple[Path, RemoteCache | None]:
    """(the folder to read, the remote cache or None): a local path as it is; a URL's stand-in folder, its index
    fetched first."""
    if not is_url(str(location)):
        return Path(location), remote_of(Path(location))  # a stand-in folder opened before is the remote cache
    remote = RemoteCache(str(location), settings or Settings())
    show_as(remote.local, remote.url)
    _OPENED[remote.local] = remote
    return remote.fetch_index(), remote


_OPENED: dict[Path, RemoteCache] = {}


def remote_of(folder: Path) -> RemoteCache | None:
    """The remote cache whose stand-in `folder` is (opened in this process), or None for a local cache."""
    return _OPENED.get(Path(folder))


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
        for folder in (SHARDS, ERRORS_DIR):  # work of another cache once at this URL (deleted from the bucket since)
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

    def fetch_records(self, n_shards: int) -> None:
        """Rank 0, once every process is through: every shard's sidecar and error file from the bucket (other nodes
        wrote some), each tar's size checked against its sidecar."""
        sizes, errors = self.remote.listing(SHARDS), self.remote.listing(ERRORS_DIR)
        for i in range(n_shards):
            side, errs = sidecar_path(self.out, i), error_path(self.out, i)
            for local, name, listed in ((side, SHARDS, sizes), (errs, ERRORS_DIR, errors)):
                # a file this node put is the object (the same run identity writes the same bytes): kept
                if local.name not in listed or not (local.is_file() or self.remote._mirror(f"{name}/{local.name}")):
                    raise RuntimeError(
                        f"{self.remote.object_url(f'{name}/{local.name}')} is missing after all processes finished"
                    )
            got = sizes.get(tar_path(self.out, i).name)
            if got != _json_field(side, "bytes"):
                raise RuntimeError(f"shard {i}'s tar is {got} bytes in the bucket, its sidecar says otherwise")

    def finish(self) -> None:
        """errors.jsonl, then the manifest last: its object's presence means the cache is complete."""
        self.remote.put(self.out / ERRORS, ERRORS)
        self.remote.put(self.out / MANIFEST, MANIFEST)

    def incomplete(self) -> None:
        """A shard is to be (re)done: the cache is not complete any more."""
        self.remote.delete(MANIFEST)


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
