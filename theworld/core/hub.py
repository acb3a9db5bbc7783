"""Hugging Face Hub repo ids wherever a model folder is accepted: `user/name` or `user/name@revision` -> a local folder,
through huggingface_hub's own cache (with HF_HUB_OFFLINE=1, the local cache only). A local path always wins."""

from __future__ import annotations

import os
from pathlib import Path

from theworld.core import location
from theworld.core.errors import UserError


def check_id(key: str, value: str) -> None:
    parsed = location.hub_id(value)
    if parsed is None or parsed.revision is not None:
        raise UserError(f"config key '{key}': {value!r} is not a hub repo id (user/name)")


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def resolve(ref: str | Path, what: str = "model") -> Path:
    """`ref` itself when it exists locally; a hub repo id's snapshot folder otherwise (downloaded, or taken from the
    local Hugging Face cache when offline), or the named folder inside it (`user/name:checkpoint-N`). Anything else
    is returned unchanged for the caller's own error."""
    inside = location.hub_folder(ref)
    if inside is not None:
        return resolve(str(inside[0]), what) / inside[1]
    parsed = location.model(ref)
    if not isinstance(parsed, location.HubId):
        return Path(ref)
    repo, revision = parsed.repo, parsed.revision
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
