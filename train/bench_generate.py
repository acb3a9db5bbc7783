"""`python -m train.bench_generate`: moved to `python -m tools.speed_generate`; this alias goes in the next release."""

from theworld.moved import run_moved

if __name__ == "__main__":
    run_moved("train.bench_generate", "tools.speed_generate")
