"""Precompute whose shard writes stall DELAY seconds with the shard's tar complete under its temporary name, just
before the rename that publishes it (a slow disk), so a kill -9 can be landed mid-write:
python tests/_slow_writer.py DELAY [precompute arguments...], or `main([DELAY, ...])` in a process of its own
(conftest.fork_command("tests._slow_writer", ...))."""

import os
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    from precompute import cosmos_latents

    delay, replace = float(argv[0]), os.replace

    def slow_replace(src, dst, *args, **kwargs):
        if str(dst).endswith(".tar"):  # only a shard's tar is published this way
            time.sleep(delay)
        return replace(src, dst, *args, **kwargs)

    os.replace = slow_replace
    return cosmos_latents.main(argv[1:])


if __name__ == "__main__":
    # run as a script, its folder (tests/, whose test packages are named like the code's) would shadow the code
    sys.path[0] = str(Path(__file__).resolve().parent.parent)
    sys.exit(main(sys.argv[1:]))
