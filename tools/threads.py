"""The speed tools' `--threads`: torch's intra-op thread count for what they time, declared and applied one way
(0 leaves torch's default; anything but a whole number >= 0 is argparse's one-line refusal, exit 2)."""

from __future__ import annotations

import argparse

import torch

HELP = "torch intra-op threads (0: torch's default)"


def _count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"a whole number >= 0 (0: torch's default), not {text!r}")
    return n


def add_threads(parser: argparse.ArgumentParser, help: str = HELP) -> None:
    """Declare `--threads` (default 0) with `help`: what the threads run, and why a count suits."""
    parser.add_argument("--threads", type=_count, default=0, help=help)


def apply_threads(args: argparse.Namespace) -> None:
    """Give torch `args.threads` intra-op threads (0: leave its default)."""
    if args.threads:
        torch.set_num_threads(args.threads)
