"""The one atomic writer: a file or a folder is written under a partial name beside its target, then renamed into
place, so a reader sees all of it or nothing.

One partial-name rule: `.tmp-NAME-PID` is being written (by process PID), `.old-NAME-PID` is a folder moved aside
while its replacement is renamed in. Anything named so is never trusted as the thing itself, and one clean-up
(`remove_stale`) deletes those whose writer is gone (a kill -9 leaves them: a whole model, a checkpoint, a shard)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

PARTIAL = re.compile(r"^\.(tmp|old)-(.+)-(\d+)$")  # kind, the target's name, the writer's pid


def partial_name(name: str, kind: str = "tmp", pid: int | None = None) -> str:
    """The name beside `name` that process `pid` (default: this one) writes it under before the rename
    (`.tmp-NAME-PID`)."""
    return f".{kind}-{name}-{os.getpid() if pid is None else pid}"


def partial_path(path: str | os.PathLike, kind: str = "tmp", pid: int | None = None) -> Path:
    path = Path(path)
    return path.with_name(partial_name(path.name, kind, pid))


def is_partial(name: str) -> bool:
    """Whether a file or folder name is an unfinished write (or a folder moved aside), never a finished one."""
    return PARTIAL.match(name) is not None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, another user's
        return True
    return True


def _remove(path: str | os.PathLike) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.unlink(path)


def remove_stale(
    folder: str | os.PathLike, name: str | None = None, only_dead: bool = True, folders_only: bool = False
) -> list[str]:
    """The one clean-up: delete the partial writes in `folder` (of target `name`, or of every target) left by a
    killed writer. A folder moved aside (`.old-`) whose replacement never arrived is moved back first. With
    `only_dead` a partial of a process that still runs here is left to it; without, the caller holds the folder's
    lock (a training run's output_dir), so every partial is stale. `folders_only`: partial files there are another
    command's (an evaluation's --out into a run folder). Returns the paths deleted, for a line saying so."""
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError:
        return []
    removed = []
    for e in entries:
        m = PARTIAL.match(e.name)
        if m is None or (name is not None and m.group(2) != name):
            continue
        if folders_only and not e.is_dir(follow_symlinks=False):
            continue
        pid = int(m.group(3))
        if only_dead and (pid == os.getpid() or pid_alive(pid)):
            continue
        target = os.path.join(folder, m.group(2))
        if m.group(1) == "old" and not os.path.lexists(target):
            os.replace(e.path, target)
            continue
        _remove(e.path)
        removed.append(e.path)
    return removed


@contextlib.contextmanager
def file(path: str | os.PathLike, fsync: bool = True) -> Iterator[Path]:
    """A partial path beside `path` for the block to write (by any library: PIL, pyarrow, tarfile); renamed over
    `path` when the block ends, deleted when it fails."""
    path = Path(path)
    tmp = partial_path(path)
    try:
        yield tmp
        publish(tmp, path, fsync)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def publish(tmp: str | os.PathLike, path: str | os.PathLike, fsync: bool = True) -> None:
    """Rename the complete file `tmp` (written under `partial_path(path)`) over `path`, its bytes on disk first."""
    if fsync:
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    os.replace(tmp, path)


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """`data` at `path`, whole or not at all (fsynced before the rename)."""
    with file(path) as tmp:
        tmp.write_bytes(data)


def write_text(path: str | os.PathLike, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def write_json(path: str | os.PathLike, obj: Any) -> None:
    write_bytes(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


def replace_folder(tmp: str | os.PathLike, final: str | os.PathLike) -> None:
    """Put the complete folder `tmp` at `final`. A folder already there is moved aside whole (`.old-`) first and
    deleted only after the rename, so a kill at any point loses neither (`remove_stale` moves it back)."""
    final = Path(final)
    old = final.with_name(partial_name(final.name, "old"))
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def folder(
    out: str | os.PathLike,
    full: Callable[[Path], str],
    unwritable: Callable[[OSError, Path], str] | None = None,
) -> Iterator[Path]:
    """A new empty folder beside `out` (its partial name) for the block to fill; when the block ends it is renamed
    to `out` (an empty folder there removed first: the callers refuse a full one). A block that fails, fills the
    disk or is stopped (SystemExit of a SIGTERM, KeyboardInterrupt) leaves nothing at `out` and its partial folder
    is removed at once (after kill -9, by the next writer's `remove_stale`). A full disk or quota raises a UserError
    of `full(TEMP)`; any other OSError, with `unwritable`, one of `unwritable(ERROR, TEMP)`."""
    from theworld.core.errors import UserError, out_of_space

    out = Path(out)
    tmp = partial_path(out)
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        yield tmp
        if out.is_dir():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, Exception) and out_of_space(e, out.parent):
            raise UserError(full(tmp)) from None
        if isinstance(e, OSError) and unwritable is not None:
            raise UserError(unwritable(e, tmp)) from None
        raise
