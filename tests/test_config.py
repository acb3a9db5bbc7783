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


# ----------------------------------------------------------------------------------------------------------------------
# Hostile values and files: one line naming the key or file, for both commands (exit 2)

_BOTH = [("train.loop", "train.lr=.inf", "train.lr"), ("train.loop", "train.weight_decay=.nan", "train.weight_decay"),
         ("train.loop", "train.grad_clip=.nan", "train.grad_clip"), ("train.loop", "train.lr=1e400", "train.lr"),
         ("train.loop", "train.ema=.nan", "train.ema"), ("train.loop", "train.betas=[.nan, 0.9]", "train.betas"),
         ("train.loop", "train.grad_norm_warn=-1", "train.grad_norm_warn"),
         ("train.loop", f"train.max_steps={10**30}", "train.max_steps"), ("train.loop", f"seed={-10**20}", "seed"),
         ("train.loop", "image.resolution=1048576", "image.resolution"),
         ("precompute.cosmos_latents", f"shard_size={2**64}", "shard_size"),
         ("precompute.cosmos_latents", "batch_size=-4", "batch_size")]


@pytest.mark.parametrize("module,override,key", _BOTH)
def test_non_finite_absurd_or_huge_numbers_name_the_key(module, override, key, capsys):
    import importlib

    main = importlib.import_module(module).main
    assert main(["--set", override, "--print-config"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and (f"'{key}" in err[0] or f"{key}:" in err[0]), err


def test_a_config_file_that_is_not_utf8_or_not_a_file_is_one_line(tmp_path, capsys):
    from train.loop import main

    bad = tmp_path / "latin1.yaml"
    bad.write_bytes("train:\n  lr: 0.01  # caf\xe9\n".encode("latin-1"))
    deep = tmp_path / "deep.yaml"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    for path, words in [(bad, ["not UTF-8", "latin1.yaml"]), (tmp_path, ["is a directory"]),
                        (deep, ["deep.yaml"])]:
        assert main(["--config", str(path), "--print-config"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and all(w in err[0] for w in words), err


def test_a_bare_config_name_resolves_to_configs_and_says_so(tmp_path, monkeypatch, capsys):
    from pathlib import Path

    from train.loop import main

    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)  # the design's `accelerate launch -m train.loop --config stage1.yaml`, from the root
    assert main(["--config", "stage1.yaml", "--print-config"]) == 0
    out, err = capsys.readouterr()
    assert "using configs/stage1.yaml" in err
    assert "output_dir: runs/stage1" in out
    monkeypatch.chdir(tmp_path)  # elsewhere: this checkout's configs/
    assert main(["--config", "stage2.yaml", "--print-config"]) == 0
    assert str(root / "configs" / "stage2.yaml") in capsys.readouterr().err
    (tmp_path / "stage2.yaml").write_text("seed: 5\n")  # a file in the cwd wins, silently
    assert main(["--config", "stage2.yaml", "--print-config"]) == 0
    out, err = capsys.readouterr()
    assert "seed: 5" in out and "using" not in err
    assert main(["--config", "nowhere.yaml"]) == 2
    assert "config file not found: nowhere.yaml" in capsys.readouterr().err


@pytest.mark.parametrize("cli,key", [("precompute.cosmos_latents", "output_dir"), ("train.loop", "output_dir"),
                                     ("train.loop", "cache_dir")])
def test_a_blank_folder_path_is_refused_not_taken_as_the_current_directory(cli, key, capsys, tmp_path, monkeypatch):
    import importlib

    monkeypatch.chdir(tmp_path)
    for value in ("", "'  '", "null"):
        assert importlib.import_module(cli).main(["--set", f"{key}={value}"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"'{key}'" in err, err
    assert list(tmp_path.iterdir()) == []  # nothing written where the command ran
