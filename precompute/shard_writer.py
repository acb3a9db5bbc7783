"""The writer thread: finished shards become tars (and their error files) while encoding goes on."""

from __future__ import annotations

import errno
import json
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path

from theworld import cache_format as cf
from theworld.core import atomic


class ShardWriter:
    """Writes finished shards on a background thread; errors surface in the main thread at the next call."""

    def __init__(self, cache_dir: Path, dtype: str, publish: Callable[[int], None] | None = None):
        self.cache_dir, self.dtype = cache_dir, dtype
        self.publish = publish  # a remote output_dir: puts each finished shard (storage.RemoteWriter.publish)
        self.queue: queue.Queue = queue.Queue(maxsize=2)
        self.failure: BaseException | None = None
        self.bytes_written = 0
        self.write_seconds = 0.0  # serialising and writing, on this thread
        self.thread = threading.Thread(target=self._loop, name="shard-writer", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while (job := self.queue.get()) is not None:
            if self.failure is None:
                t = time.perf_counter()
                try:
                    self.write(*job)
                except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
                    self.failure = e
                self.write_seconds += time.perf_counter() - t

    def write(self, index: int, samples: list[cf.Sample], errors: list[dict]) -> None:
        """One shard: its error file, then its tar and sidecar (the sidecar last: it marks the shard done).

        A failed write leaves no file a rerun would trust (temporary names only, removed here when the disk is full,
        to give the space back; a killed run's are removed by the next run's claim_output)."""
        try:
            # Errors first: when the shard counts as done, its error file is already in place.
            body = "".join(json.dumps(e, sort_keys=True) + "\n" for e in errors).encode()
            cf.atomic_write_bytes(cf.error_path(self.cache_dir, index), body)
            side = cf.write_shard(self.cache_dir, index, ((s.key, cf.encode_sample(s, self.dtype)) for s in samples))
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            tar = cf.tar_path(self.cache_dir, index)
            for path in (tar, cf.sidecar_path(self.cache_dir, index), cf.error_path(self.cache_dir, index)):
                atomic.remove_stale(path.parent, path.name, only_dead=False)  # the space back: this shard's partials
            raise OSError(errno.ENOSPC, "No space left on device", str(tar)) from None
        self.bytes_written += side["bytes"]
        if self.publish is not None:
            self.publish(index)

    def put(self, index: int, samples: list[cf.Sample], errors: list[dict]) -> None:
        self._check()
        self.queue.put((index, samples, errors))

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join()
        self._check()

    def _check(self) -> None:
        if self.failure is not None:
            raise self.failure
