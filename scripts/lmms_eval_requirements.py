"""Print lmms-eval's requirements without those scripts/lock.py leaves unmet (torchvision, timm, wandb), one per line.

`make test-latest` installs lmms-eval with `--no-deps` and then these: PyPI's torchvision builds need PyPI's CUDA
torch (installing them would replace a CPU torch), timm requires torchvision, and lmms-eval's exact wandb pin (for its
own logger) would hold the W&B tracker to an old release. TheWorld's lmms-eval adapter and the tasks it is tested on
use none of them. `make install` takes the same set from requirements/lock.txt.
"""

from __future__ import annotations

import sys
from importlib.metadata import requires
from pathlib import Path

from packaging.requirements import Requirement

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lock import LEFT_UNMET  # noqa: E402

if __name__ == "__main__":
    for line in requires("lmms-eval") or []:
        req = Requirement(line)
        if req.name.lower() not in LEFT_UNMET["lmms-eval"] and req.marker is None:
            print(str(req))
