"""`python -m precompute.bench_listing`: moved to `python -m tools.speed_listing` (this alias goes next release)."""

from theworld.moved import run_moved

if __name__ == "__main__":
    run_moved("precompute.bench_listing", "tools.speed_listing")
