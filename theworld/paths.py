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
