"""Where a string points, decided once: a local path, a remote URL (`s3://bucket/key`, `gs://`, `hf://`,
`https://`), a Hugging Face Hub model id with an optional revision (`user/name@rev`), or `tiny` (the embedded
models). Every command and loader asks here instead of testing `"://" in s`, `s == "tiny"` or a regex of its own.

A URL is checked when it is parsed: no bucket, an empty path segment or a bucket name the store refuses is one line
naming the problem, not an AttributeError or "incomplete" later."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from theworld.core.errors import UserError

TINY = "tiny"  # the embedded default's model spec (theworld/embedded/tiny.py)
BUCKET_STORES = ("s3", "s3a", "gs", "gcs")  # the first part of the URL is a bucket
LOCAL_URL = r"(?i)^\s*file:"  # a URL of this machine's disk (file:/x, file:///x), whatever reads it
_URL = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://(.*)$")
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")
# AWS's bucket naming rules (lowercase, digits, dots, hyphens; 3-63 characters); Google's also allow underscores
_BUCKET = {
    "s3": re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$"),
    "gs": re.compile(r"^[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]$"),
}


@dataclass(frozen=True)
class Local:
    path: Path

    def __str__(self) -> str:
        return os.fspath(self.path)


@dataclass(frozen=True)
class Remote:
    url: str  # as given, less a trailing slash
    scheme: str  # lowercase
    bucket: str  # the bucket (s3, gs), host (http, https) or first path part (hf)
    key: str  # the rest, without a leading slash ("" for a bucket's root)

    def __str__(self) -> str:
        return self.url

    @property
    def path(self) -> str:
        """Bucket (or host) and key: the URL without its scheme."""
        return f"{self.bucket}/{self.key}".strip("/")


@dataclass(frozen=True)
class HubId:
    repo: str  # user/name
    revision: str | None  # a branch, tag or commit; None: the default branch

    def __str__(self) -> str:
        return self.repo + (f"@{self.revision}" if self.revision else "")


@dataclass(frozen=True)
class Tiny:
    def __str__(self) -> str:
        return TINY


def is_url(text: object) -> bool:
    """Whether `text` is written as a URL (`scheme://...`); `remote` says whether it is a valid one."""
    return isinstance(text, str) and _URL.match(text) is not None


def is_tiny(spec: object) -> bool:
    return spec == TINY


def remote(text: str, what: str = "location") -> Remote:
    """The URL `text`, checked: a one-line UserError naming `what` and the problem when it cannot name an object."""
    m = _URL.match(text)
    if m is None:
        raise UserError(f"{what} {text!r} is not a URL (scheme://...)")
    scheme, rest = m.group(1).lower(), m.group(2).rstrip("/")
    bucket, _, key = rest.partition("/")
    if scheme == "file":
        return Remote(text.rstrip("/") or text, scheme, "", rest)
    noun = "bucket" if scheme in BUCKET_STORES else "host" if scheme in ("http", "https") else "repository"
    if not bucket:
        raise UserError(f"{what} {text}: no {noun} name after {scheme}://; write {scheme}://{noun.upper()}/PATH")
    if "//" in "/" + key:
        raise UserError(f"{what} {text}: an empty path segment (//) after {noun} {bucket}; name each folder once")
    rule = _BUCKET.get({"s3a": "s3", "gcs": "gs"}.get(scheme, scheme))
    if rule is not None and (rule.match(bucket) is None or ".." in bucket):
        raise UserError(
            f"{what} {text}: {bucket!r} is not a valid {scheme} bucket name (3-63 characters: lowercase letters, "
            "digits, dots and hyphens, starting and ending with a letter or digit)"
        )
    return Remote(f"{m.group(1)}://{rest}", scheme, bucket, key)


def place(text: str | os.PathLike, what: str = "location") -> Local | Remote:
    """Where a cache, an output folder or a data file is: a URL (checked) or a local path."""
    text = os.fspath(text)
    return remote(text, what) if is_url(text) else Local(Path(text))


def hub_id(text: str) -> HubId | None:
    """`user/name` or `user/name@revision` as a HubId, else None (whatever is on disk)."""
    m = _HUB_ID.match(str(text))
    if m is None or ".." in m["repo"]:
        return None
    return HubId(m["repo"], m["revision"])


# a folder inside a repo: `user/name[@revision]:checkpoint-N` (or `:final`), as `hub.history` uploads them
_IN_REPO = re.compile(r"^(?P<ref>[^:]+):(?P<folder>checkpoint-\d+|final)$")


def hub_folder(text: str | os.PathLike) -> tuple[HubId, str] | None:
    """(repo, folder) of `user/name[@revision]:checkpoint-N` when no local path of that name exists, else None."""
    text = os.fspath(text)
    m = _IN_REPO.match(text)
    if m is None or os.path.exists(text) or (repo := hub_id(m["ref"])) is None:
        return None
    return repo, m["folder"]


def model(spec: str | os.PathLike) -> Tiny | Local | HubId:
    """A model spec (`model.gemma`, `model.vae`, `init_from`, `--model`): `tiny`, a local path (one that exists
    always wins, so a folder named like a hub id is the folder), or a hub id; anything else is a Local that is not
    there, for the caller's own "not a folder here" line."""
    text = os.fspath(spec)
    if is_tiny(text):
        return Tiny()
    if os.path.exists(text):
        return Local(Path(text))
    return hub_id(text) or Local(Path(text))
