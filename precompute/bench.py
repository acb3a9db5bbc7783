"""`python -m precompute.bench`: moved to `python -m tools.speed_precompute`; this alias goes in the next release."""

from theworld.moved import run_moved

if __name__ == "__main__":
    run_moved("precompute.bench", "tools.speed_precompute")
