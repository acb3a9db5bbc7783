"""Activation checkpointing: which layers of which stacks are wrapped, that a wrapped layer recomputes its forward in
the backward only when training with gradients (never with a VAE feature cache), and that the gradients are the
same as without it."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from theworld.model import recompute


class _Counted(nn.Module):
    """A layer that counts its forward calls (a recomputation is a second call)."""

    def __init__(self, seed: int):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        with torch.no_grad():
            g = torch.Generator().manual_seed(seed)
            self.lin.weight.copy_(torch.randn(4, 4, generator=g))
            self.lin.bias.copy_(torch.randn(4, generator=g))
        self.calls = 0

    def forward(self, x, feat_cache=None):
        self.calls += 1
        return torch.tanh(self.lin(x))


def _node(**children) -> nn.Module:
    m = nn.Module()
    for name, child in children.items():
        setattr(m, name, child)
    return m


def _world(vae: bool = True) -> nn.Module:
    """TheWorld's module paths: 4 language layers, 2 SigLIP layers, 2 VAE down blocks and a mid block."""
    language = _node(layers=nn.ModuleList(_Counted(i) for i in range(4)))
    vision = _node(vision_model=_node(encoder=_node(layers=nn.ModuleList(_Counted(10 + i) for i in range(2)))))
    gemma = _node(model=_node(language_model=language, vision_tower=vision))
    encoder = _node(down_blocks=nn.ModuleList(_Counted(20 + i) for i in range(2)), mid_block=_Counted(30))
    world = _node(gemma=gemma)
    world.world_encoder = _node(vae=_node(encoder=encoder)) if vae else None
    return world


def _run(world: nn.Module, x: torch.Tensor) -> torch.Tensor:
    for layer in (y for ys in recompute.stacks(world).values() for y in ys):
        x = layer(x)
    return x


def test_stacks_are_each_parts_layers_in_forward_order():
    world = _world()
    got = recompute.stacks(world)
    assert {k: len(v) for k, v in got.items()} == {"language": 4, "vision": 2, "vae": 3}
    assert got["vae"][-1] is world.world_encoder.vae.encoder.mid_block
    assert "vae" not in recompute.stacks(_world(vae=False))


def test_apply_wraps_every_nth_layer_of_the_chosen_parts_and_none_unwraps():
    world = _world()
    assert recompute.apply(world, "full", every_n=2, parts=["language", "vae"]) == {
        "language": 2,
        "vision": 0,
        "vae": 2,
    }
    layers = recompute.stacks(world)["language"]
    assert ["forward" in layer.__dict__ for layer in layers] == [True, False, True, False]
    assert recompute.apply(world, "none") == {"language": 0, "vision": 0, "vae": 0}
    assert not any("forward" in y.__dict__ for ys in recompute.stacks(world).values() for y in ys)
    with pytest.raises(ValueError, match="activation checkpointing mode 'some': one of"):
        recompute.apply(world, "some")


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_a_wrapped_layer_recomputes_in_the_backward_and_the_gradients_are_unchanged(mode):
    plain, wrapped = _world(), _world()
    recompute.apply(wrapped, mode)
    x = torch.randn(3, 4)
    grads = []
    for world in (plain, wrapped):
        _run(world, x).square().sum().backward()
        grads.append([p.grad for p in world.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert [y.calls for y in recompute.stacks(plain)["language"]] == [1, 1, 1, 1]
    assert [y.calls for y in recompute.stacks(wrapped)["language"]] == [2, 2, 2, 2]


def test_no_recomputation_in_eval_without_gradients_or_with_a_feature_cache():
    world = _world()
    recompute.apply(world, "full", parts=["vae"])
    block = recompute.stacks(world)["vae"][0]
    x = torch.randn(2, 4, requires_grad=True)
    block(x, feat_cache=[None]).sum().backward()  # the cache would be updated twice
    with torch.no_grad():
        block(x)
    block.eval()
    block(x).sum().backward()
    assert block.calls == 3


def test_a_copy_of_a_wrapped_model_runs_its_own_layers():
    world = _world()
    recompute.apply(world, "full")
    twin = copy.deepcopy(world)
    _run(twin, torch.randn(1, 4)).sum().backward()
    assert all(y.calls == 0 for ys in recompute.stacks(world).values() for y in ys)
    assert all(y.calls == 2 for ys in recompute.stacks(twin).values() for y in ys)


class _HFLayer(GradientCheckpointingLayer):
    def __init__(self):
        super().__init__()
        self.inner = _Counted(40)

    def forward(self, x):
        return self.inner(x)


def test_a_transformers_layer_is_checkpointed_through_its_own_wrapper():
    world = _world()
    world.gemma.model.language_model.layers = nn.ModuleList([_HFLayer()])
    layer = world.gemma.model.language_model.layers[0]
    assert recompute.apply(world, "full")["language"] == 1
    assert layer.gradient_checkpointing and "forward" not in layer.__dict__
    _run(world, torch.randn(2, 4)).sum().backward()
    assert layer.inner.calls == 2
    recompute.apply(world, "none")
    assert not layer.gradient_checkpointing
    _run(world, torch.randn(2, 4)).sum().backward()
    assert layer.inner.calls == 3
