"""Strict configs: every mistake names its key, before any model loads."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal

import pytest

from tests.conftest import base_args, one_error_line, train_inproc
from theworld.core.config import load_config, to_yaml
from theworld.core.errors import UserError
from theworld.model.config import FreezeConfig, ImageConfig, ModelConfig, WorldConfig


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
    cfg = load_config(
        Demo,
        write(tmp_path, "model:\n  gemma: some/path\nlr: 3\n"),
        ["world.pool=2", "freeze.vae=false", "resume=auto", "image.resolution=128"],
    )
    assert cfg.model.gemma == "some/path" and cfg.lr == 3.0 and isinstance(cfg.lr, float)
    assert cfg.world.pool == 2 and cfg.freeze.vae is False and cfg.resume == "auto" and cfg.image.resolution == 128
    assert load_config(Demo, None, ["resume=null"]).resume is None


@pytest.mark.parametrize(
    "text,overrides,key",
    [
        ("modle:\n  gemma: x\n", [], "modle"),
        ("model:\n  gema: x\n", [], "model.gema"),
        ("", ["world.pool=3"], "world.pool"),
        ("", ["world.latent=mode"], "world.latent"),
        ("", ["freeze.vae=maybe"], "freeze.vae"),
        ("", ["seed=1.5"], "seed"),
        ("lr: fast\n", [], "lr"),
        ("image:\n  resolution: 100\n", [], "image.resolution"),
        ("", ["model=3"], "model"),
    ],
)
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
    assert [load_config(Demo, None, [f"model.gemma={v}"]).model.gemma for v in ("007", "0x1F", "1e3", "yes")] == [
        "007",
        "0x1F",
        "1e3",
        "yes",
    ]
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

_BOTH = [
    ("train.loop", "train.optimizer.lr=.inf", "train.optimizer.lr"),
    ("train.loop", "train.optimizer.weight_decay=.nan", "train.optimizer.weight_decay"),
    ("train.loop", "train.optimizer.grad_clip=.nan", "train.optimizer.grad_clip"),
    ("train.loop", "train.optimizer.lr=1e400", "train.optimizer.lr"),
    ("train.loop", "train.optimizer.ema=.nan", "train.optimizer.ema"),
    ("train.loop", "train.optimizer.betas=[.nan, 0.9]", "train.optimizer.betas"),
    ("train.loop", "train.optimizer.grad_norm_warn=-1", "train.optimizer.grad_norm_warn"),
    ("train.loop", f"train.max_steps={10**30}", "train.max_steps"),
    ("train.loop", f"seed={-(10**20)}", "seed"),
    ("train.loop", "image.resolution=1048576", "image.resolution"),
    ("precompute.cosmos_latents", f"shard_size={2**64}", "shard_size"),
    ("precompute.cosmos_latents", "batch_size=-4", "batch_size"),
]


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
    for path, words in [(bad, ["not UTF-8", "latin1.yaml"]), (tmp_path, ["is a directory"]), (deep, ["deep.yaml"])]:
        assert main(["--config", str(path), "--print-config"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and all(w in err[0] for w in words), err


def test_a_bare_config_name_resolves_to_configs_and_says_so(tmp_path, monkeypatch, capsys):
    from pathlib import Path

    from train.loop import main

    root = Path(__file__).resolve().parents[3]
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


@pytest.mark.parametrize(
    "cli,key", [("precompute.cosmos_latents", "output_dir"), ("train.loop", "output_dir"), ("train.loop", "cache_dir")]
)
def test_a_blank_folder_path_is_refused_not_taken_as_the_current_directory(cli, key, capsys, tmp_path, monkeypatch):
    import importlib

    monkeypatch.chdir(tmp_path)
    for value in ("", "'  '", "null"):
        assert importlib.import_module(cli).main(["--set", f"{key}={value}"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"'{key}'" in err, err
    assert list(tmp_path.iterdir()) == []  # nothing written where the command ran


# ----------------------------------------------------------------------------------------------------------------------
# Round 3: alias bombs, echoed values, machine-bounded counts, float32, what a config path is

# 9 anchors, each a list of 9 aliases of the one before: 9^9 = 387 million strings from about 300 bytes
_BOMB = (
    "[&a [x, x, x, x, x, x, x, x, x], "
    + ", ".join(f"&{c} [{', '.join([f'*{p}'] * 9)}]" for p, c in zip("abcdefgh", "bcdefghi"))
    + "]"
)


def _only_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "Traceback" not in err[0], err
    return err[0]


def test_a_yaml_alias_bomb_in_a_known_key_is_refused_at_once_in_a_file_and_in_set(tmp_path, capsys):
    import time

    from precompute.cosmos_latents import main as precompute
    from train.loop import main as train

    path = tmp_path / "bomb.yaml"
    for text, cli in ((f"train:\n  benchmarks: {_BOMB}\n", train), (f"model:\n  gemma: {_BOMB}\n", precompute)):
        path.write_text(text)
        t0 = time.time()
        assert cli(["--config", str(path), "--print-config"]) == 2
        line = _only_line(capsys)
        assert "aliases" in line and str(path) in line and len(line) < 300, line
        assert time.time() - t0 < 5
    assert train(["--set", f"train.eval.benchmarks={_BOMB}", "--print-config"]) == 2
    assert "--set train.eval.benchmarks" in _only_line(capsys)


def test_a_recursive_alias_is_refused_not_followed(tmp_path, capsys):
    from train.loop import main

    path = tmp_path / "loop.yaml"
    path.write_text("train:\n  benchmarks: &a [*a]\n")
    assert main(["--config", str(path), "--print-config"]) == 2
    assert "refers to its own anchor" in _only_line(capsys)


def test_no_error_line_echoes_a_value_longer_than_a_line(tmp_path, capsys):
    from train.loop import main

    huge = "y" * 2_000_000
    cases = [
        ["--set", f"train.lr_schedule.decay={huge}"],
        ["--set", f"train.optimizer.lr={huge}"],
        ["--set", f"train.optimizer.betas=[{', '.join(['0.5'] * 50_000)}]"],
        ["--set", f"train.max_steps={'9' * 100_000}"],
        ["--set", f"train.{huge}=1"],
    ]
    for args in cases:
        assert main([*args, "--print-config"]) == 2
        line = _only_line(capsys)
        assert len(line) < 1000 and "y" * 100 not in line and "9" * 100 not in line, line[:300]
        assert args[1].split("=")[0][:20] in line


@pytest.mark.parametrize(
    "module,key",
    [
        ("train.loop", "train.loader.num_workers"),
        ("train.loop", "train.hardware.cpu_threads"),
        ("precompute.cosmos_latents", "num_workers"),
    ],
)
def test_worker_and_thread_counts_are_bounded_by_the_machine(module, key, capsys):
    import importlib

    from theworld.core.config import WORKERS_PER_CORE, usable_cores

    main = importlib.import_module(module).main
    for value in (100_000, 100_000_000):
        assert main(["--set", f"{key}={value}", "--print-config"]) == 2
        line = _only_line(capsys)
        assert f"'{key}'" in line and f"{usable_cores()} usable CPU cores" in line, line
    fits = usable_cores() * (1 if "threads" in key else WORKERS_PER_CORE)
    assert main(["--set", f"{key}={fits}", "--print-config"]) == 0


@pytest.mark.parametrize(
    "override,key",
    [
        ("train.optimizer.lr=1e300", "train.optimizer.lr"),
        ("train.optimizer.lr_multipliers.vision=1e308", "train.optimizer.lr_multipliers.vision"),
        ("train.optimizer.grad_norm_warn=1e39", "train.optimizer.grad_norm_warn"),
        # each fits; their product, the rate AdamW applies, does not
        ("train.optimizer.lr_multipliers.projector=1e30", "train.optimizer.lr_multipliers.projector"),
    ],
)
def test_floats_that_do_not_fit_float32_are_refused_before_loading(override, key, capsys):
    from train.loop import main

    args = ["--set", override] + (["--set", "train.optimizer.lr=1e10"] if override.endswith("=1e30") else [])
    assert main([*args, "--print-config"]) == 2
    line = _only_line(capsys)
    assert f"'{key}'" in line and "float32" in line, line


def test_a_config_path_that_is_no_file_says_what_it_is_without_reading_it(tmp_path, capsys):
    import os

    from train.loop import main

    loop, fifo, dangling = tmp_path / "loop.yaml", tmp_path / "fifo.yaml", tmp_path / "gone.yaml"
    loop.symlink_to(loop)
    os.mkfifo(fifo)  # reading it would block forever
    dangling.symlink_to(tmp_path / "nowhere.yaml")
    for path, words in [
        (loop, "a symlink loop"),
        (fifo, "a FIFO"),
        ("/dev/zero", "a character device"),
        (dangling, f"a dangling symlink to {tmp_path / 'nowhere.yaml'}"),
        (tmp_path, "a directory"),
    ]:
        assert main(["--config", str(path), "--print-config"]) == 2
        line = _only_line(capsys)
        assert str(path) in line and words in line and "not found" not in line, line


def test_memory_plan_refuses_infinite_or_absurd_sizes_in_one_line(capsys):
    from tools.memory_plan import main

    for args in (
        ["--gpu-memory-gib", "inf"],
        ["--gpu-memory-gib", "nan"],
        ["--gpu-memory-gib", "1e300"],
        ["--gpus", str(10**30)],
    ):
        assert main(["--config", "configs/stage1.yaml", *args]) == 2
        assert "--gpu" in _only_line(capsys)


def _tiny_gemma_with(tmp_path, **text_config) -> str:
    """The tiny Gemma's folder with its text_config changed the way a hand edit would."""
    import shutil

    from theworld.embedded import tiny

    folder = shutil.copytree(tiny.ensure(tiny.TINY_GEMMA_DIR), tmp_path / "gemma")
    config = json.loads((folder / "config.json").read_text())
    config["text_config"].update(text_config)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.mark.parametrize(
    "edit,words",
    [
        ({"hidden_size": "x"}, "Field 'hidden_size' expected int, got str"),
        ({"num_hidden_layers": 10**6, "layer_types": None}, "has 1000000 layers in its text_config"),
    ],
)
def test_a_hand_broken_model_config_is_one_line_for_the_memory_plan_and_the_loader(tmp_path, capsys, edit, words):
    from theworld.core.errors import UserError
    from theworld.model.encoders import load_gemma
    from tools.memory_plan import main

    folder = _tiny_gemma_with(tmp_path, **edit)
    assert main(["--config", "configs/stage1.yaml", "--set", f"model.gemma={folder}"]) == 2
    assert words in _only_line(capsys)
    if "hidden_size" in edit:  # what every command that loads the model raises, before any weight is read
        with pytest.raises(UserError, match="model.gemma: cannot load .*expected int, got str"):
            load_gemma(folder)


@pytest.mark.parametrize(
    "text,words",
    [
        ('{"z_dim": "x"}', "cannot build"),
        ('{"base_dim": -3}', "negative dimension"),
        ("[1]", "holding a JSON list"),
        ("x{", "not a valid JSON file"),
    ],
)
def test_a_hand_broken_vae_config_is_one_line_for_the_memory_plan(tmp_path, capsys, text, words):
    from tools.memory_plan import main

    (tmp_path / "config.json").write_text(text)
    assert main(["--config", "configs/stage1.yaml", "--set", f"model.vae={tmp_path}"]) == 2
    line = _only_line(capsys)
    assert line.startswith("error: model.vae: ") and words in line, line


def test_every_size_like_key_has_a_bound_checked_before_any_model_loads(tmp_path, capsys):
    from precompute.config import PrecomputeConfig
    from theworld.core.config import SIZE_LIMITS, load_config
    from train.config import TrainConfig

    extra = {"lora.r": ["lora.parts=[language]"]}
    for key, (limit, _) in SIZE_LIMITS.items():
        cls = TrainConfig if key.split(".")[0] in ("lora", "train", "profile") else PrecomputeConfig
        sets = extra.get(key, []) + [f"{key}={limit + 1}"]
        with pytest.raises(UserError, match=rf"'{key}': {limit + 1} is too large \(at most"):
            load_config(cls, None, sets)
        load_config(cls, None, extra.get(key, []) + [f"{key}={limit}"])  # the bound itself is allowed
    # the CLI: one line, exit 2, before the cache or any model is looked at
    for key in ("lora.r", "train.eval.caption_tokens", "train.eval.captions"):
        args = base_args(tmp_path / "no-cache", tmp_path / "out", **{key: 100_000_000})
        assert train_inproc(args) == 2
        one_error_line(capsys, key, "too large")
        assert not (tmp_path / "out").exists()
