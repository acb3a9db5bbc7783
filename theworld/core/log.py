"""What the commands tell the user, through `logging`.

One logger tree ("theworld"), one handler on stderr whose formatter prints the message as it is, after "error: " or
"warning: " for those levels: the lines look as they did when they were prints. The level comes from `--quiet` /
`--verbose` (every command's parser has them) or THEWORLD_LOG_LEVEL. Results a user pipes (JSON, tables, captions) stay
on stdout through `print`; progress bars stay tqdm, and the handler writes through `tqdm.write` so a message never
breaks a bar's line.
"""

from __future__ import annotations

import logging
import os
import sys

ENV = "THEWORLD_LOG_LEVEL"
ROOT = "theworld"
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
_PREFIX = {logging.WARNING: "warning: ", logging.ERROR: "error: ", logging.CRITICAL: "error: "}


def get(name: str) -> logging.Logger:
    """The logger of module `name` (`__name__`), under the one tree whatever package the module is in."""
    return logging.getLogger(name if name.split(".")[0] == ROOT else f"{ROOT}.{name}")


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return _PREFIX.get(record.levelno, "") + record.getMessage()


class _Handler(logging.Handler):
    """stderr as it is when a record comes (a test's or a launcher's redirection included), through tqdm.write."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=sys.stderr)
            sys.stderr.flush()
        except (OSError, ValueError):  # a closed stream at exit: logging's own policy
            self.handleError(record)


def level_from_env() -> tuple[int, str | None]:
    """THEWORLD_LOG_LEVEL (debug, info, warning, error; any case), info when unset; with the line to show when the
    value is none of those (a typo in a variable must not stop a run, nor be ignored silently)."""
    raw = os.environ.get(ENV, "").strip()
    level = LEVELS.get(raw.lower()) if raw else logging.INFO
    if level is None:
        return logging.INFO, f"{ENV}={raw!r} is not one of {', '.join(LEVELS)}; using info"
    return level, None


def configure(level: int | None = None) -> None:
    """Install the handler once and set the tree's level (`level`, else THEWORLD_LOG_LEVEL's)."""
    root = logging.getLogger(ROOT)
    if not any(isinstance(h, _Handler) for h in root.handlers):
        handler = _Handler()
        handler.setFormatter(_Formatter())
        root.addHandler(handler)
        root.propagate = False  # a library's logging.basicConfig must not print our lines twice
    problem = None
    if level is None:
        level, problem = level_from_env()
    root.setLevel(level)
    if problem:
        root.warning(problem)


def set_level(level: int) -> None:
    logging.getLogger(ROOT).setLevel(level)


__all__ = ["ENV", "LEVELS", "configure", "get", "level_from_env", "set_level"]
