"""Print img2dataset's requirements that `source.type: urls` needs, one per line, without the pins that conflict.

img2dataset 1.47.0 pins webdataset<0.3 and pandas<3 (this project reads and writes shards with webdataset 1.x; its
venv has pandas 3) and opencv-python-headless<5, and lists the `dataclasses` backport (Python 3.6). pip cannot
install it beside them, so `make install` installs it with `--no-deps` and then these: the same requirements minus
webdataset, pandas and dataclasses, and opencv without its upper bound. Its download path (img2dataset.download with
webdataset output, as precompute/sources/urls.py calls it) runs with webdataset 1.0.2, pandas 3.1.1 and opencv 5.0:
tests/test_source_urls.py runs it end to end against a local HTTP server.
"""

from __future__ import annotations

import sys
from importlib.metadata import requires
from pathlib import Path

from packaging.requirements import Requirement

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lock import LEFT_UNMET  # noqa: E402

NO_UPPER_BOUND = {"opencv-python-headless"}
LEFT_OUT = LEFT_UNMET["img2dataset"] - NO_UPPER_BOUND

if __name__ == "__main__":
    for line in requires("img2dataset") or []:
        req = Requirement(line)
        if req.name.lower() in LEFT_OUT or req.marker is not None:
            continue
        if req.name.lower() in NO_UPPER_BOUND:
            req.specifier = type(req.specifier)(",".join(str(s) for s in req.specifier if s.operator.startswith(">")))
        print(str(req))
