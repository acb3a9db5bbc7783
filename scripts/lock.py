"""The lock of exact versions that `make install` installs (requirements/lock.txt): written from a virtual environment
that passed the suite, and checked against the one it was installed into.

    python scripts/lock.py write > requirements/lock.txt  # every distribution in this environment, as name==version
    python scripts/lock.py check   # this environment holds the lock's versions, and they meet every requirement
    python scripts/lock.py diff    # what this environment (e.g. make test-latest's) holds that differs from the lock
    python scripts/lock.py requirements PACKAGE  # its requirements less LEFT_UNMET: what goes in beside it when the
                                                 # Makefile installs it with --no-deps

torch is locked by its version alone: any build of it (2.13.0+cpu, 2.13.0+cu128, PyPI's 2.13.0) holds the lock's
`torch==2.13.0`, as the build is the machine's choice (the Makefile installs the CPU build unless told another); the
packages of its CUDA builds are left out. Requirements that the installs deliberately leave unmet are listed in
LEFT_UNMET.
"""

from __future__ import annotations

import sys
import sysconfig
from importlib.metadata import Distribution, distributions
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

LOCK = Path(__file__).resolve().parent.parent / "requirements" / "lock.txt"
PROJECT = "theworld-train"
EXTRAS = ("dev", "eval")  # what `make install` (and so CI) installs
NOT_LOCKED = {"pip", PROJECT}  # the installer, and the project itself (installed editable from the checkout)
TORCH = "torch"  # locked by its public version: the build (+cpu, +cu128) is the machine's
TORCH_BUILD = ("torchvision", "torchaudio", "triton", "nvidia-", "cuda-")  # the packages of a torch build

# Requirements left unmet on purpose (the Makefile's lmms-eval and img2dataset targets install these packages without
# them). lmms-eval: torchvision (and timm, which needs it) would replace a CPU torch with PyPI's CUDA build, and its
# exact wandb pin (for its own logger, which the adapter does not use) would hold our W&B tracker to an old release.
ALL = frozenset({"*"})  # every requirement of the package
LEFT_UNMET = {
    "lmms-eval": {"torchvision", "timm", "wandb"},
    # img2dataset 1.47.0 pins webdataset<0.3 and pandas<3 (this project needs webdataset 1.x), caps opencv below 5
    # (which lmms-eval needs) and lists the dataclasses backport (Python 3.6); its download path runs on the locked
    # versions (tests/precompute/sources/test_urls.py)
    "img2dataset": {"webdataset", "pandas", "opencv-python-headless", "dataclasses"},
    # a peer in tools.speed_readers, read through streaming.base alone (see the Makefile's streaming target)
    "mosaicml-streaming": ALL,
}
# Of LEFT_UNMET, the requirements installed all the same, without their upper bound.
LOWER_BOUND_ONLY = {"img2dataset": {"opencv-python-headless"}}


def _name(dist: Distribution) -> str:
    return canonicalize_name(dist.metadata["Name"])


def locked_name(name: str) -> bool:
    return name not in NOT_LOCKED and not name.startswith(TORCH_BUILD)


def locked_version(name: str, dist: Distribution) -> str:
    """The version the lock records for an installed distribution: torch's without its build (local) label."""
    return Version(dist.version).public if name == TORCH else dist.version


def installed() -> dict[str, Distribution]:
    """The distributions installed into this environment's site-packages. Not sys.path's: importing setuptools puts
    its vendored copies (setuptools/_vendor) on it, and those are setuptools' files, not installed packages."""
    dirs = sorted({sysconfig.get_paths()[k] for k in ("purelib", "platlib")})
    return {_name(d): d for d in distributions(path=dirs)}


def read_lock(path: Path | None = None) -> dict[str, str]:
    path = path or LOCK
    pins = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            req = Requirement(line)
        except InvalidRequirement:  # a stray line (a merge marker, a pasted word): the line, not a traceback
            raise SystemExit(f"{path}:{n}: '{line}' is not an exact pin (name==version), nor any requirement") from None
        spec = list(req.specifier)
        if len(spec) != 1 or spec[0].operator != "==" or req.marker or req.extras:
            raise SystemExit(f"{path}:{n}: '{line}' is not an exact pin (name==version)")
        name = canonicalize_name(req.name)
        if name in pins:
            raise SystemExit(f"{path}:{n}: {name} is pinned twice")
        pins[name] = spec[0].version
    return pins


def unmet(dists: dict[str, Distribution]) -> list[str]:
    """Requirements of the project (with EXTRAS) and of everything installed that the installed versions do not meet."""
    problems = []
    for name, dist in sorted(dists.items()):
        extras = EXTRAS if name == PROJECT else ()
        for line in dist.requires or []:
            req = Requirement(line)
            dep = canonicalize_name(req.name)
            env_ok = req.marker is None or any(req.marker.evaluate({"extra": e}) for e in ("", *extras))
            left = LEFT_UNMET.get(name, set())
            if not env_ok or dep in left or left is ALL or dep.startswith(TORCH_BUILD):
                continue
            if dep not in dists:
                problems.append(f"{name} requires {req}: not installed")
            elif not req.specifier.contains(Version(dists[dep].version), prereleases=True):
                problems.append(f"{name} requires {req}: {dists[dep].version} is installed")
    return problems


def write() -> None:
    print("# Exact versions of everything `make install` installs; torch's holds for any build of it (see README).")
    print("# CI ran the suite on these. Refresh: make lock (make test-latest, then its venv's versions written here).")
    print(f"# Written on Python {sys.version_info.major}.{sys.version_info.minor}.")
    for name, dist in sorted(installed().items()):
        if locked_name(name):
            print(f"{name}=={locked_version(name, dist)}")


def check() -> int:
    dists, pins = installed(), read_lock()
    wrong = [
        f"{n}=={v}: {'not installed' if n not in dists else dists[n].version + ' is installed'}"
        for n, v in pins.items()
        if n not in dists or locked_version(n, dists[n]) != v
    ]
    extra = [n for n in dists if locked_name(n) and n not in pins]
    problems = wrong + [f"{n} is installed but not in the lock" for n in extra] + unmet(dists)
    for p in problems:
        print(f"lock: {p}", file=sys.stderr)
    return 1 if problems else 0


def diff() -> int:
    dists, pins = installed(), read_lock()
    names = sorted({n for n in dists if locked_name(n)} | set(pins))
    changed = [(n, pins.get(n, "-"), locked_version(n, dists[n]) if n in dists else "-") for n in names]
    changed = [c for c in changed if c[1] != c[2]]
    for n, old, new in changed:
        print(f"{n:40} {old:>16} -> {new}")
    print(f"{len(changed)} of {len(names)} differ from {LOCK.name}")
    return 0


def requirements(package: str) -> int:
    """Print `package`'s unconditional requirements, one per line, less those LEFT_UNMET names (kept without their
    upper bound where LOWER_BOUND_ONLY says so)."""
    from importlib.metadata import requires

    name = canonicalize_name(package)
    for line in requires(package) or []:
        req = Requirement(line)
        dep = canonicalize_name(req.name)
        if req.marker is not None:
            continue
        if dep in LOWER_BOUND_ONLY.get(name, set()):
            req.specifier = type(req.specifier)(",".join(str(s) for s in req.specifier if s.operator.startswith(">")))
        elif dep in LEFT_UNMET.get(name, set()):
            continue
        print(str(req))
    return 0


if __name__ == "__main__":
    commands = {"write": write, "check": check, "diff": diff, "requirements": requirements}
    args = sys.argv[2:]
    if len(sys.argv) < 2 or sys.argv[1] not in commands or len(args) != (sys.argv[1] == "requirements"):
        print(f"usage: python scripts/lock.py {{{','.join(commands)}}} [PACKAGE]", file=sys.stderr)
        sys.exit(2)
    sys.exit(commands[sys.argv[1]](*args) or 0)
