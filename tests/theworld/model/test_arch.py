"""theworld/model/arch.py is the one place for the model's facts: the config keys, the freeze flags and the optimiser
groups
follow its parts map, and every parameter of TheWorld belongs to exactly one part."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from theworld.model import arch
from theworld.model.config import FreezeConfig, WorldConfig
from train.config import LrMultipliers


def test_config_keys_follow_the_parts_map():
    assert [f.name for f in dataclasses.fields(LrMultipliers)] == list(arch.PARTS)
    assert [f.name for f in dataclasses.fields(FreezeConfig)] == list(arch.FREEZABLE)
    assert typing.get_args(typing.get_type_hints(WorldConfig)["pool"]) == arch.POOLS


@pytest.mark.parametrize(
    "name, part",
    [
        ("projector.sow", "projector"),
        ("projector.net.0.weight", "projector"),
        ("gemma.model.vision_tower.vision_model.embeddings.patch_embedding.weight", "vision"),
        ("gemma.model.multi_modal_projector.mm_soft_emb_norm.weight", "vision"),
        ("gemma.lm_head.weight", "language"),
        ("gemma.model.language_model.layers.0.mlp.up_proj.weight", "language"),
        ("world_encoder.vae.encoder.conv_in.weight", "vae"),
    ],
)
def test_part_of(name, part):
    assert arch.part_of(name) == part


def test_a_name_outside_every_part_is_refused():
    with pytest.raises(ValueError, match="no part"):
        arch.part_of("projectorx.weight")  # a prefix of a path is not the path


def test_every_parameter_has_a_part_and_freeze_flags_act_on_their_part():
    """On the tiny model's shapes (meta device): each freeze flag turned off makes exactly its part's parameters
    trainable (less the ones no forward reaches, TheWorld.OFF_PATH), the projector always trains."""
    from theworld.core.config import load_config
    from theworld.model.world import TheWorld
    from tools.memory_plan import build_world
    from train.config import TrainConfig

    for off in arch.FREEZABLE:
        cfg = load_config(TrainConfig, None, [f"freeze.{off}=false"])
        model = build_world(cfg)
        for name, p in model.named_parameters():
            part = arch.part_of(name)
            expected = part in ("projector", off) and not TheWorld.OFF_PATH.match(name)
            assert p.requires_grad == expected, (off, name)


def test_the_world_token_count_is_the_projectors():
    import torch

    from theworld.model.projector import WorldProjector

    side = arch.latent_side(512)
    assert side == 64
    for pool in arch.POOLS:
        proj = WorldProjector(8, torch.zeros(16), torch.ones(16), pool=pool)
        assert proj.num_tokens(side, side) == (side // pool) ** 2 + 2
