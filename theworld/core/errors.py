"""User-facing errors and the one wrapper every command's `main` goes through."""

from __future__ import annotations

import contextlib
import errno
import functools
import re
import shutil
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from theworld.core import log

_log = log.get(__name__)


class UserError(Exception):
    """A mistake the user can fix (bad config, bad argument, missing file): one line, exit 2."""


class CacheMismatch(UserError):
    """A cache that does not belong to this config (fingerprint differs)."""


class OutOfSpace(UserError):
    """The disk filled up while writing; the rerun after freeing space continues from the last complete save."""


def out_of_space(e: BaseException, folder: str | Path | None = None) -> bool:
    """Whether `e` is a full disk or quota: an OSError saying so, a library error whose text does (safetensors: "No
    space left on device (os error 28)"), or one that says nothing (torch.save: "file write failed") written into a
    `folder` whose file system has under 1 MiB left."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(e)
    if "No space left on device" in text or "os error 28" in text or "Disk quota exceeded" in text:
        return True
    try:
        return folder is not None and shutil.disk_usage(folder).free < (1 << 20)
    except OSError:
        return False


def no_space_message(what: str | Path, resumes: bool = True) -> str:
    """The line for a full disk; `resumes`: the command continues from its last complete save (training,
    precompute), which a command that writes one file (evaluate's --out, an export) does not have."""
    if resumes:
        return (
            f"no space left on device while writing {what}: free some space and rerun the same command (it "
            "continues from the last complete save)"
        )
    return f"no space left on device while writing {what}: the disk holding it is full; free space there and rerun"


class CacheDamaged(UserError):
    """A cache file that does not hold what its sidecar or manifest says (truncated, swapped, bit rot, malformed)."""


_SHOWN_AS: dict[str, str] = {}  # local stand-in folder -> the URL it stands for (theworld.storage)


def show_as(local: str | Path, url: str) -> None:
    """Messages name `url` where they would name the local folder `local` (a remote cache's stand-in)."""
    _SHOWN_AS[str(local)] = url
    _SHOWN_AS[str(Path(local).absolute())] = url


def as_shown(text: str) -> str:
    """`text` with every registered stand-in folder replaced by its URL (longest first)."""
    for local in sorted(_SHOWN_AS, key=len, reverse=True):
        text = text.replace(local, _SHOWN_AS[local])
    return text


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_BREAKS = re.compile(r"\s*[\r\n]+\s*")


def one_line(text: object, limit: int | None = None) -> str:
    """A library's exception text (pyarrow's, a parser's: often several lines) as one line of an error message;
    with `limit`, at most that many characters (the end cut, with an ellipsis)."""
    line = _BREAKS.sub(" / ", str(text).strip())
    return line if limit is None or len(line) <= limit else line[: limit - 3] + "..."


def cli_entry(main: Callable[[list[str] | None], int | None]) -> Callable[[list[str] | None], int]:
    """Run `main`, turning a UserError into one line on stderr and exit code 2 (never a traceback)."""

    @functools.wraps(main)
    def wrapper(argv: list[str] | None = None) -> int:
        log.configure()
        try:
            return int(main(argv) or 0)
        except UserError as e:
            msg = as_shown(str(e))
            if "Original Traceback" in msg:  # raised in a DataLoader worker: its last line is the error itself
                msg = msg.strip().splitlines()[-1].split(": ", 1)[-1]
            # the same mistake gives the same line: no object addresses from a library's repr (the known sources
            # are fixed where they arise, e.g. theworld.model.images._ImageBytes)
            _log.error(one_line(_ADDRESS.sub("", msg)))
            end_process_group()
            return 2
        except KeyboardInterrupt:
            _log.info("interrupted")
            return 130
        except OSError as e:
            if not out_of_space(e):
                raise
            _log.error(no_space_message(e.filename or "a file", resumes=False))
            end_process_group()
            return 2

    return wrapper


def end_process_group() -> None:
    """Destroy this process's torch.distributed group, if it has one, before a refusal's exit 2: a gloo group still
    alive at interpreter exit can abort the process in teardown ("terminate called without an active exception",
    exit 134 instead of 2), and a refusal raised on every process after a collective finds none of them in one.
    Called after the error line is out, so a peer stuck elsewhere cannot hide it."""
    dist = sys.modules.get("torch.distributed")  # not imported: no group (and no torch import for a usage error)
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    try:
        dist.destroy_process_group()
    except RuntimeError as e:  # a broken group: the exit it was going to have anyway
        _log.debug(f"destroying the process group: {one_line(e)}")


def _exit_143(*_) -> None:
    sys.exit(128 + signal.SIGTERM)


@contextlib.contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """While the block runs, SIGTERM (`kill PID`, a scheduler's stop) raises SystemExit in the main thread, so the
    block's `finally` removes what it was writing; the previous handler is restored after."""
    try:
        old = signal.signal(signal.SIGTERM, _exit_143)
    except ValueError:  # not the main thread: signals cannot be handled here
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
