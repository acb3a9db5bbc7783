"""What a path is, in words, for every message that refuses one (config files, source folders and images, data
files, the metrics log): from its metadata alone, never opened, since reading a FIFO waits forever and /dev/zero
never ends."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

REGULAR = "a regular file"
_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def file_kind(mode: int) -> str:
    """What an `os.stat` mode says the file is ("a FIFO", "a directory", ..., REGULAR)."""
    if stat.S_ISREG(mode):
        return REGULAR
    return next((words for test, words in _KINDS if test(mode)), "not a regular file")


def path_kind(path: str | bytes | os.PathLike) -> str | None:
    """A `file_kind`, or "a symlink loop", "a path through a symlink loop", "a dangling symlink to TARGET",
    "unreadable (REASON)"; None when nothing is there."""
    try:
        return file_kind(os.stat(path).st_mode)
    except OSError as e:
        if os.path.islink(path):
            if e.errno == errno.ELOOP:
                return "a symlink loop"
            return f"a dangling symlink to {os.fsdecode(os.readlink(path))}"
        if e.errno == errno.ELOOP:
            return "a path through a symlink loop"
        return None if e.errno == errno.ENOENT else f"unreadable ({e.strerror})"


def _file_ids(path: str | os.PathLike, limit: int = 100_000) -> set[tuple[int, int]]:
    """(device, inode) of `path` and, for a folder, of every file under it (at most `limit`): what a hardlink or a
    symlink to one of them shares."""
    ids = set()
    try:
        st = os.stat(path)
    except OSError:
        return ids
    ids.add((st.st_dev, st.st_ino))
    if stat.S_ISDIR(st.st_mode):
        for root, dirs, files in os.walk(path):
            for name in dirs + files:
                try:
                    s = os.stat(os.path.join(root, name))
                except OSError:
                    continue
                ids.add((s.st_dev, s.st_ino))
                if len(ids) >= limit:
                    return ids
    return ids


def check_not_input(out: str | os.PathLike, inputs: dict[str, str | os.PathLike | None], flag: str = "--out") -> None:
    """An output never overwrites an input: `out` may not be any of `inputs` ({what: path}, a file or a folder) nor a
    file inside an input folder, by its name, a symlink or a hardlink (the same file). Raises a one-line UserError
    naming both."""
    from theworld.core.errors import UserError

    real = os.path.realpath(out)
    out_ids = _file_ids(out) if os.path.exists(out) else set()
    for what, path in inputs.items():
        if path is None or not os.path.lexists(path):
            continue
        if real == os.path.realpath(path) or out_ids & _file_ids(path):
            raise UserError(
                f"{flag} {os.fspath(out)} is {what} {os.fspath(path)} or a file in it (the same file, by its name, a "
                f"symlink or a hardlink): writing there would destroy the input; give {flag} another path"
            )


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, another user's
        return True
    return True


def partial_name(name: str) -> str:
    """The temporary name beside `name` that a write goes to before its rename (`.tmp-NAME-PID`)."""
    return f".tmp-{name}-{os.getpid()}"


def remove_stale_partials(folder: str | os.PathLike, name: str) -> list[str]:
    """Delete `.tmp-NAME-PID` files or folders in `folder` left by a writer that was killed (its pid no longer runs):
    a killed export leaves a whole model there. Returns the paths removed (for a line saying so)."""
    import re

    pattern = re.compile(rf"^\.tmp-{re.escape(name)}-(\d+)$")
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for e in entries:
        m = pattern.match(e.name)
        if not m or int(m.group(1)) == os.getpid() or pid_alive(int(m.group(1))):
            continue
        if e.is_dir(follow_symlinks=False):
            shutil.rmtree(e.path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(e.path)
        removed.append(e.path)
    return removed


@contextlib.contextmanager
def published_folder(
    out: str | os.PathLike,
    full: Callable[[Path], str],
    unwritable: Callable[[OSError, Path], str] | None = None,
) -> Iterator[Path]:
    """A new empty folder beside `out` (its `partial_name`) for the block to fill; when the block ends it is renamed
    to `out` (an empty folder there removed first: the callers refuse a full one). A block that fails, fills the
    disk or is stopped (SystemExit of a SIGTERM, KeyboardInterrupt) leaves nothing at `out` and its temporary folder
    is removed at once (after kill -9, by the next writer's `remove_stale_partials`). A full disk or quota raises a
    UserError of `full(TEMP)`; any other OSError, with `unwritable`, one of `unwritable(ERROR, TEMP)`."""
    from theworld.core.errors import UserError, out_of_space

    out = Path(out)
    tmp = out.parent / partial_name(out.name)
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
