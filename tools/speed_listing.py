"""Time and memory of listing a webdataset source (docs/precompute.md, "Scaling").

    python -m tools.speed_listing WORK [--tars 200] [--per-tar 500]

Builds WORK/wds/<j>.tar once (img2dataset-like jpg + txt + json members, tiny payloads: listing reads headers only),
then lists it in fresh processes: first run (scan + index + duplicate check), rerun (index reused), one shard's
entries. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import io
import json
import resource
import subprocess
import sys
import tarfile
import time
from pathlib import Path


def make_source(root: Path, tars: int, per_tar: int) -> str:
    root.mkdir(parents=True, exist_ok=True)
    for j in range(tars):
        path = root / f"{j:05d}.tar"
        if path.exists():
            continue
        with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tf:
            for i in range(per_tar):
                key = f"{j:05d}{i:04d}"
                for member, data in (
                    ("jpg", b"\xff\xd8" + bytes(200)),
                    ("txt", f"a caption {key}".encode()),
                    ("json", json.dumps({"url": f"http://example.com/{key}.jpg"}).encode()),
                ):
                    info = tarfile.TarInfo(f"{key}.{member}")
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))
    return f"{root}/{{00000..{tars - 1:05d}}}.tar"


def measure(pattern: str, index_dir: str, shard_size: int) -> dict:
    """In this process: listing time, RSS growth (peak and held), one shard's entries."""
    from precompute import sources

    rss = lambda: int(next(line for line in open("/proc/self/status") if line.startswith("VmRSS")).split()[1]) / 1024
    peak0, rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, rss()
    t = time.perf_counter()
    listing = sources.open_listing("webdataset", pattern, 0, 0, "p", index_dir=Path(index_dir))
    t_list = time.perf_counter() - t
    held = rss() - rss0
    mid = len(listing) // 2 // shard_size * shard_size
    t = time.perf_counter()
    listing.entries(mid, mid + shard_size)
    return {
        "entries": len(listing),
        "listing_s": round(t_list, 3),
        "held_mib": round(held, 1),
        "peak_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - peak0, 1),
        "shard_entries_ms": round(1000 * (time.perf_counter() - t), 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("work", type=Path)
    p.add_argument("--tars", type=int, default=200)
    p.add_argument("--per-tar", type=int, default=500)
    p.add_argument("--shard-size", type=int, default=512)
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(measure(*args.child, args.shard_size)))
        return 0
    pattern = make_source(args.work / "wds", args.tars, args.per_tar)
    index = args.work / "source-index"
    for f in index.glob("*") if index.exists() else []:
        f.unlink()
    out = {"tars": args.tars, "per_tar": args.per_tar}
    for run in ("first_run", "rerun"):  # fresh processes: what a launch really pays
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                "tools.speed_listing",
                str(args.work),
                "--child",
                pattern,
                str(index),
                "--shard-size",
                str(args.shard_size),
            ],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parents[1],
        )
        out[run] = json.loads(res.stdout)
    out["index_bytes"] = sum(f.stat().st_size for f in index.iterdir())
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
