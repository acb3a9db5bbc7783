"""TheWorld from the base models' configs alone, offline: tiny, a local folder, or a known hub id's architecture;
anything else is one line naming model.gemma or model.vae."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import Gemma3Config

from tests.conftest import train_config
from theworld.core.errors import UserError
from train import meta_model


def _tiny(name: str) -> Path:
    """A tiny model's folder (built first when absent)."""
    from theworld.embedded import tiny

    return tiny.ensure(name)


def _folder(tmp_path, name: str, config) -> str:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_gemma_configs_come_from_tiny_a_folder_or_a_known_architecture(tmp_path):
    tiny = meta_model.base_gemma_config("tiny")
    assert isinstance(tiny, Gemma3Config)
    copy = shutil.copytree(_tiny("tiny-gemma3"), tmp_path / "g", ignore=shutil.ignore_patterns("*.safetensors"))
    from_folder = meta_model.base_gemma_config(str(copy))
    assert from_folder.text_config.to_dict() == tiny.text_config.to_dict()
    real = meta_model.base_gemma_config("google/gemma-3-4b-it")  # not in the (empty) Hugging Face cache
    assert real.text_config.hidden_size == 2560 and real.text_config.num_hidden_layers > 30


def test_a_gemma_spec_with_no_usable_config_is_one_line(tmp_path):
    with pytest.raises(UserError, match=r"model.gemma: no config for 'someone/model' offline \(known architectures: "):
        meta_model.base_gemma_config("someone/model")
    bert = _folder(tmp_path, "bert", {"model_type": "bert"})
    with pytest.raises(UserError, match="holds a BertConfig, not a Gemma 3 config"):
        meta_model.base_gemma_config(bert)
    deep = json.loads((_tiny("tiny-gemma3") / "config.json").read_text())
    deep["vision_config"]["num_hidden_layers"] = meta_model.MAX_LAYERS + 1
    with pytest.raises(UserError, match="has 1025 layers in its vision_config, more than any model this estimates"):
        meta_model.base_gemma_config(_folder(tmp_path, "deep", deep))
    with pytest.raises(UserError, match="model.gemma: cannot load"):
        meta_model.base_gemma_config(_folder(tmp_path, "broken", ["not", "a", "config"]))


def test_vae_configs_come_from_tiny_a_folder_or_the_wan_defaults(tmp_path):
    tiny = meta_model.base_vae_config("tiny")
    assert tiny["z_dim"] == 16 and tiny["base_dim"] == 8
    pipeline = tmp_path / "pipe"
    shutil.copytree(_tiny("tiny-wan-vae"), pipeline / "vae", ignore=shutil.ignore_patterns("*.safetensors"))
    assert meta_model.base_vae_config(str(pipeline))["base_dim"] == 8  # a pipeline folder's vae/
    wan = meta_model.base_vae_config("nvidia/Cosmos-Predict2-2B-Video2World")
    assert wan["z_dim"] == 16 and wan["base_dim"] == 96


def test_a_vae_spec_with_no_usable_config_is_one_line(tmp_path):
    with pytest.raises(UserError, match=r"model.vae: no config for 'someone/vae' offline \(known architectures: "):
        meta_model.base_vae_config("someone/vae")
    with pytest.raises(UserError, match="has a config.json holding a JSON list, not a config"):
        meta_model.base_vae_config(_folder(tmp_path, "list", [1, 2]))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="has neither config.json nor vae/config.json"):
        meta_model.base_vae_config(str(tmp_path / "empty"))


def test_the_world_on_meta_holds_shapes_in_the_runs_dtypes(tmp_path):
    model = meta_model.build_world(train_config("model.dtype=bfloat16"))
    params = dict(model.named_parameters())
    assert all(p.is_meta for p in params.values())
    trainable = {n for n, p in params.items() if p.requires_grad}
    assert trainable and all(n.startswith("projector.") for n in trainable)  # the defaults freeze every base part
    assert all(params[n].dtype == torch.float32 for n in trainable)
    assert {p.dtype for n, p in params.items() if n not in trainable} == {torch.bfloat16}


def test_a_config_that_cannot_build_its_model_names_the_key(tmp_path):
    bad = json.loads((_tiny("tiny-wan-vae") / "config.json").read_text()) | {"base_dim": -8}
    with pytest.raises(UserError, match=r"model.vae: cannot build .* from its config.json: "):
        meta_model.build_world(train_config(f"model.vae={_folder(tmp_path, 'bad', bad)}"))
