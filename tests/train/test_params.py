"""Parameter counts per part for the run's start line: whole counts, adapters named, empty parts left out."""

from __future__ import annotations

import pytest
from torch import nn

from train import params


def _linear(i: int, o: int, trains: bool) -> nn.Linear:
    lin = nn.Linear(i, o, bias=False)
    lin.weight.requires_grad_(trains)
    return lin


def _model() -> nn.Module:
    """TheWorld's parameter names: a projector, a LoRA-adapted language layer, a frozen lm_head and VAE, no vision."""
    root, gemma, inner, lm, q = nn.Module(), nn.Module(), nn.Module(), nn.Module(), nn.Module()
    q.base_layer = _linear(10, 100, False)  # 1000
    q.lora_A = nn.ModuleDict({"default": _linear(10, 2, True)})  # 20
    q.lora_B = nn.ModuleDict({"default": _linear(2, 100, True)})  # 200
    lm.q_proj = q
    inner.language_model = lm
    gemma.model, gemma.lm_head = inner, _linear(1000, 2000, False)  # 2,000,000
    root.gemma, root.projector, root.world_encoder = gemma, nn.Linear(3, 4), _linear(5, 5, False)  # 16, 25
    return root


def test_part_counts_are_per_part_in_arch_order_with_adapters_apart():
    counts = params.part_counts(_model())
    assert list(counts) == ["projector", "vision", "language", "vae", "rollout"]
    assert counts["projector"] == {"trainable": 16, "total": 16, "adapter": 0}
    assert counts["language"] == {"trainable": 220, "total": 2_001_220, "adapter": 220}
    assert counts["vae"] == {"trainable": 0, "total": 25, "adapter": 0}
    assert counts["vision"] == counts["rollout"] == {"trainable": 0, "total": 0, "adapter": 0}


def test_describe_names_each_present_part_and_its_lora_share():
    assert params.describe(_model()) == (
        "parameters trainable / total: projector 16 / 16, language 220 / 2.0 M (LoRA 220), vae 0 / 25"
    )


def test_a_parameter_of_no_part_is_refused_by_name():
    m = _model()
    m.stray = nn.Linear(1, 1)
    with pytest.raises(ValueError, match="parameter stray.weight belongs to no part"):
        params.part_counts(m)


@pytest.mark.parametrize(
    ("n", "text"), [(0, "0"), (999, "999"), (1000, "1.0 k"), (6_600_000, "6.6 M"), (4_300_000_000, "4.3 B")]
)
def test_human_counts_take_one_decimal_and_the_largest_unit(n, text):
    assert params.human(n) == text
