"""User-facing errors and the one wrapper every command's `main` goes through."""
from __future__ import annotations

import functools
import sys
from typing import Callable


class UserError(Exception):
    """A mistake the user can fix (bad config, bad argument, missing file): one line, exit 2."""


class CacheMismatch(UserError):
    """A cache that does not belong to this config (fingerprint differs)."""


class CacheDamaged(UserError):
    """A cache file that does not hold what its sidecar or manifest says (truncated, swapped, bit rot, malformed)."""


def cli_entry(main: Callable[[list[str] | None], int | None]) -> Callable[[list[str] | None], int]:
    """Run `main`, turning a UserError into one line on stderr and exit code 2 (never a traceback)."""

    @functools.wraps(main)
    def wrapper(argv: list[str] | None = None) -> int:
        try:
            return int(main(argv) or 0)
        except UserError as e:
            msg = str(e)
            if "Original Traceback" in msg:  # raised in a DataLoader worker: its last line is the error itself
                msg = msg.strip().splitlines()[-1].split(": ", 1)[-1]
            print(f"error: {msg}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130

    return wrapper
