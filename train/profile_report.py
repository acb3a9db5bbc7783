"""`python -m train.profile_report`: moved to `python -m tools.profile_report`; this alias goes in the next release."""

from theworld.moved import run_moved

if __name__ == "__main__":
    run_moved("train.profile_report", "tools.profile_report")
