"""Commands that moved to tools/ (the speed benchmarks, the memory plan, the profile report): the old `python -m` name
runs the new module for this release, after a line naming it."""

from __future__ import annotations

import runpy
import sys

from theworld import log


def run_moved(old: str, new: str) -> None:
    """Run module `new` as `python -m new` would, with this process's arguments."""
    log.configure()
    log.get(__name__).warning(f"python -m {old} is now python -m {new} (the old name goes in the next release)")
    sys.argv[0] = new
    runpy.run_module(new, run_name="__main__", alter_sys=True)
