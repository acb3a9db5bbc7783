"""`python -m train.bench_eval`: moved to `python -m tools.speed_eval`; this alias goes in the next release."""

from theworld.moved import run_moved

if __name__ == "__main__":
    run_moved("train.bench_eval", "tools.speed_eval")
