"""One run per output folder at a time, for training and precompute alike.

A second run started into a folder another run is using (a requeued job whose first copy is still alive, a copied
command) would take that run's unfinished writes for a killed run's leftovers and delete them, then interleave its
files with the other's. So the main process holds an advisory lock on `<folder>/.run.lock` for the run's life.

POSIX record locks (`fcntl.lockf`) belong to the process that took them: forked loader workers do not inherit them,
and the kernel drops them when the process ends, `kill -9` included, so a crashed run never leaves a stale lock. The
file keeps the last holder's pid, host and start time, for the message the next run gives.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from theworld.core import log
from theworld.core.errors import UserError
from theworld.core.paths import REGULAR, path_kind

_log = log.get(__name__)

LOCK_FILE = ".run.lock"


def _holder(fd: int) -> str:
    return os.pread(fd, 512, 0).decode(errors="replace").strip() or "holder unknown"


class InUse(UserError):
    """The folder is locked by another run."""


def _in_use(folder: Path, holder: str, key: str) -> InUse:
    return InUse(
        f"config key '{key}': {folder} is in use by another run ({holder}); wait for it to end or use another {key}"
    )


def check_folder(folder: Path | str, key: str = "output_dir") -> None:
    """A run's folder may be missing (it is created) but not something else."""
    if Path(folder).exists() and not Path(folder).is_dir():
        raise UserError(f"config key '{key}': {folder} is a file, not a folder")


def acquire(folder: Path | str, key: str = "output_dir") -> int | None:
    """Lock `folder` (created if needed) for this process; returns the descriptor that holds the lock, or None on a
    file system without locks (a warning: nothing stops two runs there). A folder locked by another process is a
    UserError naming the holder."""
    folder = Path(folder)
    check_folder(folder, key)
    lock = folder / LOCK_FILE
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"config key '{key}': cannot write {folder} ({e.strerror})") from None
    kind = path_kind(lock)
    if kind not in (None, REGULAR):  # never opened: a FIFO would block, a directory cannot hold the lock
        raise UserError(
            f"config key '{key}': {lock}, the run lock of {folder}, is {kind}, not a file; remove it (no run "
            "holds it) and rerun"
        )
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise UserError(f"config key '{key}': cannot open the run lock {lock} ({e.strerror})") from None
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except (BlockingIOError, PermissionError):  # EAGAIN / EACCES: another process holds it
        holder = _holder(fd)
        os.close(fd)
        raise _in_use(folder, holder, key) from None
    except OSError as e:  # ENOLCK, EOPNOTSUPP: e.g. a network file system mounted without locking
        os.close(fd)
        _log.warning(f"cannot lock {folder / LOCK_FILE} ({e.strerror}): make sure no other run uses {key} {folder}")
        return None
    if not _still_linked(fd, folder / LOCK_FILE):  # a refused run removed the file we opened: lock the new one
        os.close(fd)
        return acquire(folder, key)
    os.ftruncate(fd, 0)
    os.pwrite(
        fd, f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0
    )
    return fd


def _verdict_elsewhere(folder: Path, verdict: int, key: str) -> UserError:
    """The error a non-main process raises when the main process was refused the folder."""
    if verdict == 1:
        try:
            with open(folder / LOCK_FILE, "rb") as f:  # not the holder: closing it releases nothing
                return _in_use(folder, _holder(f.fileno()), key)
        except OSError:
            return _in_use(folder, "holder unknown", key)
    return UserError(f"config key '{key}': {folder} cannot be used (the main process's message says why)")


def _still_linked(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except OSError:
        return False


def _missing_parents(folder: Path) -> list[Path]:
    """`folder` and those of its parents that do not exist yet, innermost first."""
    out = []
    for p in [folder, *folder.parents]:
        if p.exists() or p.is_symlink():
            break
        out.append(p)
    return out


def _only_lock_left(folder: Path) -> bool:
    """Whether `folder` holds nothing but the lock file and empty folders."""
    for p in folder.rglob("*"):
        if p.is_symlink() or (not p.is_dir() and p != folder / LOCK_FILE):
            return False
    return True


def _remove_if_empty(folder: Path, created: list[Path]) -> None:
    """After a run that stopped on an error: a folder it left holding only the lock file and empty folders loses
    them, and goes itself if the run created it (with the parents it created); anything else is kept."""
    try:
        if not _only_lock_left(folder):
            return
        (folder / LOCK_FILE).unlink(missing_ok=True)
        for p in sorted(folder.rglob("*"), key=lambda q: len(q.parts), reverse=True):
            p.rmdir()
        for p in created:
            p.rmdir()
    except OSError:
        pass  # another process wrote there meanwhile: keep it


@contextlib.contextmanager
def hold(folder: Path | str, state, key: str = "output_dir") -> Iterator[None]:
    """Held by the main process of `state` (an accelerate Accelerator or PartialState) while the block runs. Every
    process gets the main process's verdict, so a refused run stops everywhere with the same line."""
    fd, error = None, None
    created = _missing_parents(Path(folder).absolute())
    if state.is_main_process:
        try:
            fd = acquire(folder, key)
        except UserError as e:
            error = e
    if state.num_processes > 1:
        import torch
        from accelerate.utils import broadcast

        verdict = 0 if error is None else 1 if isinstance(error, InUse) else 2
        verdict = int(broadcast(torch.tensor([verdict], dtype=torch.int32, device=state.device), 0).item())
        if verdict and error is None:
            error = _verdict_elsewhere(Path(folder), verdict, key)
    if error is not None:
        raise error
    try:
        yield
    except BaseException:
        if fd is not None:  # a refused or failed run leaves no folder that holds only its lock
            _remove_if_empty(Path(folder), created)
        raise
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock
