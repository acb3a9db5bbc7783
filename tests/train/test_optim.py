"""The optimiser's parameter groups and the learning-rate schedule."""

from __future__ import annotations

import math

import pytest
import torch

from theworld.core.config import load_config
from train.config import TrainConfig
from train.optim import lr_factor, param_groups


def _module(**children) -> torch.nn.Module:
    m = torch.nn.Module()
    for name, child in children.items():
        setattr(m, name, child)
    return m


class Toy(torch.nn.Module):
    """Names that follow the model's: a projector with markers, a language-model norm, a linear layer with a bias, a
    frozen part."""

    def __init__(self):
        super().__init__()
        self.projector = _module(
            sow=torch.nn.Parameter(torch.zeros(8)),
            eow=torch.nn.Parameter(torch.zeros(1, 8)),  # 2-D: excluded by name, not by shape
            proj=torch.nn.Linear(4, 8),
        )
        norm = _module(weight=torch.nn.Parameter(torch.ones(8)))
        self.gemma = _module(
            model=_module(language_model=_module(post_norm=norm)), lm_head=torch.nn.Linear(8, 8).requires_grad_(False)
        )


def test_no_decay_for_biases_norms_and_markers_and_none_for_frozen():
    model = Toy()
    groups = param_groups(model, weight_decay=0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    got = {(g["part"], g["weight_decay"]): sorted(names[id(p)] for p in g["params"]) for g in groups}
    assert got == {
        ("projector", 0.1): ["projector.proj.weight"],
        ("projector", 0.0): ["projector.eow", "projector.proj.bias", "projector.sow"],
        ("language", 0.0): ["gemma.model.language_model.post_norm.weight"],
    }


def _factor(*overrides: str):
    cfg = load_config(TrainConfig, None, ["train.max_steps=100", "train.lr_schedule.warmup_steps=10", *overrides])
    return lr_factor(cfg.train.lr_schedule, cfg.train.max_steps)


def test_cosine_schedule_is_a_pure_function_of_the_step():
    f = _factor("train.lr_schedule.decay=cosine")
    assert [f(s) for s in (0, 5, 10)] == pytest.approx([0.0, 0.5, 1.0])
    assert f(55) == pytest.approx(0.5 * (1 + math.cos(math.pi * 45 / 90)))
    assert f(100) == pytest.approx(0.0, abs=1e-12)
    assert [f(s) for s in range(100)] == [_factor("train.lr_schedule.decay=cosine")(s) for s in range(100)]


def test_linear_and_constant_schedules():
    lin, const = _factor("train.lr_schedule.decay=linear"), _factor("train.lr_schedule.decay=constant")
    assert lin(10) == pytest.approx(1.0) and lin(55) == pytest.approx(0.5) and lin(100) == pytest.approx(0.0)
    assert const(5) == pytest.approx(0.5) and const(10) == const(99) == pytest.approx(1.0)
