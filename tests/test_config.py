"""Strict configs: every mistake names its key, before any model loads."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import pytest

from theworld.config import FreezeConfig, ImageConfig, ModelConfig, WorldConfig, load_config, to_yaml
from theworld.errors import UserError


@dataclass
class Demo:
    model: ModelConfig = field(default_factory=ModelConfig)
    image: ImageConfig = field(default_factory=ImageConfig)
    world: WorldConfig = field(default_factory=WorldConfig)
    freeze: FreezeConfig = field(default_factory=FreezeConfig)
    lr: float = 1e-3
    resume: str | None = None
    seed: int = 0


def write(tmp_path, text: str):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_yaml_and_overrides(tmp_path):
    cfg = load_config(Demo, write(tmp_path, "model:\n  gemma: some/path\nlr: 3\n"),
                      ["world.pool=2", "freeze.vae=false", "resume=auto", "image.resolution=128"])
    assert cfg.model.gemma == "some/path" and cfg.lr == 3.0 and isinstance(cfg.lr, float)
    assert cfg.world.pool == 2 and cfg.freeze.vae is False and cfg.resume == "auto" and cfg.image.resolution == 128
    assert load_config(Demo, None, ["resume=null"]).resume is None


@pytest.mark.parametrize("text,overrides,key", [
    ("modle:\n  gemma: x\n", [], "modle"),
    ("model:\n  gema: x\n", [], "model.gema"),
    ("", ["world.pool=3"], "world.pool"),
    ("", ["world.latent=mode"], "world.latent"),
    ("", ["freeze.vae=maybe"], "freeze.vae"),
    ("", ["seed=1.5"], "seed"),
    ("lr: fast\n", [], "lr"),
    ("image:\n  resolution: 100\n", [], "image.resolution"),
    ("", ["model=3"], "model"),
])
def test_errors_name_the_key(tmp_path, text, overrides, key):
    with pytest.raises(UserError) as e:
        load_config(Demo, write(tmp_path, text), overrides)
    assert f"'{key}'" in str(e.value) or f"{key}:" in str(e.value)
    assert "\n" not in str(e.value)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_config(Demo, tmp_path / "nope.yaml")
    with pytest.raises(UserError, match="not valid YAML"):
        load_config(Demo, write(tmp_path, "a: [1, 2\n"))
    with pytest.raises(UserError, match="key=value"):
        load_config(Demo, None, ["world.pool"])
    with pytest.raises(UserError, match="--set model.gemma: value .* is not valid YAML"):
        load_config(Demo, None, ["model.gemma=a: b: c"])
    # a key that takes text gets it as typed; other keys get the YAML value
    assert [load_config(Demo, None, [f"model.gemma={v}"]).model.gemma for v in ("007", "0x1F", "1e3", "yes")] == \
        ["007", "0x1F", "1e3", "yes"]
    cfg = load_config(Demo, None, ["seed=0x1F", "lr=1e3", "freeze.vae=no", "resume=null"])
    assert (cfg.seed, cfg.lr, cfg.freeze.vae, cfg.resume) == (31, 1000.0, False, None)


@dataclass
class Precision:
    mixed_precision: Literal["no", "bf16"] = "bf16"


def test_a_literal_of_words_takes_yaml_booleans_as_typed():
    assert load_config(Precision, None, ["mixed_precision=no"]).mixed_precision == "no"


def test_yaml_dump_round_trips():
    a = load_config(Demo, None)
    assert "gemma: tiny" in to_yaml(a)
