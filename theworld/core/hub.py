"""Hugging Face Hub repo ids wherever a model folder is accepted: `user/name` or `user/name@revision` -> a local folder,
through huggingface_hub's own cache (with HF_HUB_OFFLINE=1, the local cache only). A local path always wins."""

from __future__ import annotations

import os
import re
from pathlib import Path

from theworld.core.errors import UserError

REPO_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")


def parse(ref: str) -> tuple[str, str | None] | None:
    """(repo_id, revision) when `ref` reads as a hub repo id, else None."""
    m = REPO_ID.match(str(ref))
    if m is None or ".." in m["repo"]:
        return None
    return m["repo"], m["revision"]


def check_id(key: str, value: str) -> None:
    if parse(value) is None or "@" in value:
        raise UserError(f"config key '{key}': {value!r} is not a hub repo id (user/name)")


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


# a folder inside a repo: `user/name[@revision]:checkpoint-N` (or `:final`), as `hub.history` uploads them
IN_REPO = re.compile(r"^(?P<ref>[^:]+):(?P<folder>checkpoint-\d+|final)$")


def resolve(ref: str | Path, what: str = "model") -> Path:
    """`ref` itself when it exists locally; a hub repo id's snapshot folder otherwise (downloaded, or taken from the
    local Hugging Face cache when offline), or the named folder inside it (`user/name:checkpoint-N`). Anything else
    is returned unchanged for the caller's own error."""
    path = Path(ref)
    inside = IN_REPO.match(str(ref))
    if not path.exists() and inside and parse(inside["ref"]) is not None:
        return resolve(inside["ref"], what) / inside["folder"]
    parsed = parse(str(ref))
    if path.exists() or parsed is None:
        return path
    repo, revision = parsed
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError
    except ImportError:
        raise UserError(
            f"{what} {ref}: not a local folder; loading it as a hub repo id needs huggingface_hub "
            "(pip install 'theworld[hub]')"
        ) from None
    try:
        return Path(snapshot_download(repo, revision=revision, local_files_only=offline()))
    except LocalEntryNotFoundError:
        raise UserError(
            f"{what} {ref}: not a local folder, and hub repo {repo}"
            f"{'@' + revision if revision else ''} is not in the local Hugging Face cache "
            f"({'HF_HUB_OFFLINE is set' if offline() else 'and the hub cannot be reached'})"
        ) from None
    except RepositoryNotFoundError:
        raise UserError(
            f"{what} {ref}: not a local folder, and no hub repo {repo} (or no access to it: "
            "huggingface-cli login, or HF_TOKEN)"
        ) from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise UserError(
            f"{what} {ref}: not a local folder, and hub repo {repo} could not be fetched: "
            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}"
        ) from None
