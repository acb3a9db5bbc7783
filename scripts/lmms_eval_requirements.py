"""Print lmms-eval's requirements without torchvision (and timm, which requires it), one per line.

`make install` on a machine whose torch has no matching torchvision (a CPU torch: PyPI's torchvision builds need PyPI's
CUDA torch, and installing them would replace the CPU torch) installs lmms-eval with `--no-deps` and then these.
TheWorld's lmms-eval adapter and the tasks it is tested on use neither package.
"""

from __future__ import annotations

from importlib.metadata import requires

from packaging.requirements import Requirement

LEFT_OUT = {"torchvision", "timm"}

if __name__ == "__main__":
    for line in requires("lmms-eval") or []:
        req = Requirement(line)
        if req.name.lower() not in LEFT_OUT and req.marker is None:
            print(str(req))
