"""What a long-lived command's process loads once (imports, a built model) kept out of the cyclic garbage collector's
passes for the run.

The collector's full pass walks every tracked object. After torch's and transformers' imports those are hundreds of
thousands, and a pass holds the interpreter for tenths of a second. Any burst of allocation starts one: the S3
client parsing its endpoint data while a cache opens, a batch's decoding in a loader worker. Meanwhile every other
thread of the process (the client's event loop, read-ahead's downloads, the progress bar) waits. `gc.freeze` moves
the objects alive now to a generation the collector skips, so a pass walks only what was made since. Forked loader
workers inherit the frozen generation, so their passes skip it too. Frozen objects are still freed when their last
reference goes; only cycles among them wait for the end of `scope`.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


def freeze() -> None:
    """Collect what is garbage now, then keep every object still alive out of the collector's passes. Collecting
    first means no cycle that is already garbage (a model loader's temporary state, say) is kept for the run."""
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def scope() -> Iterator[None]:
    """The body's `freeze` calls hold until it ends. Afterwards every frozen object is the collector's again, so a
    command run in process (a test's `main(argv)`) leaves nothing frozen behind for the next one."""
    try:
        yield
    finally:
        gc.unfreeze()
