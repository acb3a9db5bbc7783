"""The one default device: the first GPU when there is one, else the CPU (a command's `--device` or a launcher's
process placement overrides it)."""

from __future__ import annotations

import torch


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
