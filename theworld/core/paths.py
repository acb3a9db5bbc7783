"""What a path is, in words, for every message that refuses one (config files, source folders and images, data
files, the metrics log): from its metadata alone, never opened, since reading a FIFO waits forever and /dev/zero
never ends."""

from __future__ import annotations

import errno
import os
import stat

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
    """An output never overwrites an input: `out` may not be any of `inputs` ({what: path}, a file or a folder), a
    file inside an input folder (by its name, a symlink or a hardlink: the same file), nor a folder holding an
    input. Raises a one-line UserError naming both."""
    from theworld.core.errors import UserError

    real = os.path.realpath(out)
    given = {what: path for what, path in inputs.items() if path is not None and os.path.lexists(path)}
    for what, path in given.items():
        if os.path.isdir(out) and os.path.realpath(path).startswith(real.rstrip(os.sep) + os.sep):
            raise UserError(
                f"{flag} {os.fspath(out)} is a folder holding {what} {os.fspath(path)}: {flag} names the file to "
                f"write; give {flag} a new file path"
            )
    out_ids = _file_ids(out) if os.path.exists(out) else set()
    for what, path in given.items():
        if real == os.path.realpath(path) or out_ids & _file_ids(path):
            raise UserError(
                f"{flag} {os.fspath(out)} is {what} {os.fspath(path)} or a file in it (the same file, by its name, a "
                f"symlink or a hardlink): writing there would destroy the input; give {flag} another path"
            )
