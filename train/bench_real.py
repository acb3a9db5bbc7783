"""`python -m train.bench_real`: moved to `python -m tools.speed_real`; this alias goes in the next release."""

from theworld.moved import run_moved

if __name__ == "__main__":
    run_moved("train.bench_real", "tools.speed_real")
