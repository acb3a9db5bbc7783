"""train.loop whose torch.distributed.checkpoint writes of the checkpoint named in SLOW_SHARDS (e.g. checkpoint-4)
stall SLOW_SHARDS_S seconds before writing (a slow disk), so a kill -9 lands mid-save: its `main(argv)` is
train.loop's, run as `python -m tests._slow_shards [train.loop arguments...]` or on forked ranks."""

import os
import sys
import time

from torch.distributed.checkpoint import FileSystemWriter

from train.loop import main  # noqa: F401  (this module's command)

write = FileSystemWriter.write_data


def slow_write(self, plan, planner):
    if f"{os.environ['SLOW_SHARDS']}-" in str(self.path):  # the temporary folder .tmp-checkpoint-N-<pid>
        time.sleep(float(os.environ["SLOW_SHARDS_S"]))
    return write(self, plan, planner)


FileSystemWriter.write_data = slow_write

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
