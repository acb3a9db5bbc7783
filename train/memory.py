"""`python -m train.memory`: moved to `python -m tools.memory_plan`; this alias goes in the next release."""

from theworld.moved import run_moved

if __name__ == "__main__":
    run_moved("train.memory", "tools.memory_plan")
