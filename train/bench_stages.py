"""`python -m train.bench_stages`: moved to `python -m tools.speed_stages`; this alias goes in the next release."""

from theworld.moved import run_moved

if __name__ == "__main__":
    run_moved("train.bench_stages", "tools.speed_stages")
