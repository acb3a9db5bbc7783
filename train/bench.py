"""`python -m train.bench`: moved to `python -m tools.speed_train`; this alias goes in the next release."""

from theworld.moved import run_moved

if __name__ == "__main__":
    run_moved("train.bench", "tools.speed_train")
