"""theworld.core.device: one default device, the GPU when there is one."""

import torch

from theworld.core.device import default_device


def test_the_default_device_is_the_gpu_when_there_is_one_else_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_device() == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert default_device() == torch.device("cuda")
