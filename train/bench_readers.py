"""`python -m train.bench_readers`: moved to `python -m tools.speed_readers`; this alias goes in the next release."""

from theworld.moved import run_moved

if __name__ == "__main__":
    run_moved("train.bench_readers", "tools.speed_readers")
