"""Every shipped config loads as it is, and the run hash that checkpoints record covers what it should."""

from __future__ import annotations

import dataclasses
import keyword
import operator
from pathlib import Path

import pytest

from precompute.config import PrecomputeConfig
from tests.conftest import ROOT
from theworld.core.config import load_config
from theworld.core.errors import UserError
from train.config import RESUME_NEUTRAL, TrainConfig, neutral, neutral_keys, run_hash

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TRAIN_CONFIGS = sorted(CONFIGS.glob("stage[0-9].yaml")) + sorted((CONFIGS / "real").glob("stage[0-9].yaml"))
LORA_CONFIGS = [CONFIGS / "stage3_lora.yaml", CONFIGS / "real" / "stage3_lora.yaml"]
PRECOMPUTE_CONFIGS = [CONFIGS / "precompute.yaml", CONFIGS / "real" / "precompute.yaml"]


def test_the_shipped_set_is_complete():
    assert [p.name for p in TRAIN_CONFIGS] == [f"stage{i}.yaml" for i in (1, 2, 3, 4)] * 2


@pytest.mark.parametrize("path", TRAIN_CONFIGS, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_train_configs_load(path):
    cfg = load_config(TrainConfig, path)
    stage = int(path.stem[-1])
    # stage N+1 starts from stage N's final weights; stage 1 starts from the base models
    assert (cfg.init_from is None) == (stage == 1)
    if stage > 1:
        assert f"stage{stage - 1}" in str(cfg.init_from)
    # progressive unfreezing: stage 2 adds the vision side, stage 3 the language model, stage 4 the VAE
    assert (cfg.freeze.vision, cfg.freeze.language, cfg.freeze.vae) == (stage < 2, stage < 3, stage < 4)


@pytest.mark.parametrize("path", LORA_CONFIGS, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_lora_stage3_configs_load(path):
    """Stage 3 with LoRA: the vision side trains whole, the language model through adapters on frozen weights."""
    cfg = load_config(TrainConfig, path)
    assert "stage2" in str(cfg.init_from) and cfg.lora.parts == ["language"]
    assert (cfg.freeze.vision, cfg.freeze.language, cfg.freeze.vae) == (False, True, True)
    assert cfg.train.hardware.sharding == "ddp"


@pytest.mark.parametrize("path", PRECOMPUTE_CONFIGS, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_precompute_configs_load(path):
    cfg = load_config(PrecomputeConfig, path)
    assert cfg.image.resolution % 8 == 0


def test_real_configs_share_the_cache_they_read():
    """The real stages and the real precompute agree on the models and the resolution the cache is built at."""
    pre = load_config(PrecomputeConfig, CONFIGS / "real" / "precompute.yaml")
    for path in sorted((CONFIGS / "real").glob("stage*.yaml")):
        cfg = load_config(TrainConfig, path)
        assert (cfg.model.gemma, cfg.model.vae, cfg.image.resolution) == (
            pre.model.gemma,
            pre.model.vae,
            pre.image.resolution,
        ), path.name


def _another_value(value):
    """A different value of the same type, written as --set takes it."""
    if isinstance(value, bool):
        return str(not value).lower()
    if isinstance(value, int):  # down where it can: thread and worker counts are bounded by the machine's cores
        return str(value - 1 if value > 1 else value + 1)
    if isinstance(value, float):
        return str(value + 0.5)
    if isinstance(value, list):
        return "[]" if value else "[x.jsonl]"
    if value is None:  # train.hardware.gradient_checkpointing once read: the earlier switch (true: mode full)
        return "true"
    return {"auto": "4", "ddp": "fsdp", "fsdp": "ddp", "none": "full"}.get(value, "x")


SHAPED = {  # neutral keys whose other value is a mapping
    "train.eval.sets": "[{name: v, cache: x}]",
    "train.checkpoint.keep_best": "{metric: eval_loss, mode: max}",
    "train.hardware.activation_checkpointing.parts": "[language]",  # not [] (refused with a mode that recomputes)
}


def test_run_hash_ignores_resume_neutral_keys_and_sees_the_rest(tmp_path):
    base = load_config(TrainConfig, CONFIGS / "stage1.yaml")
    neutral = []
    for k in RESUME_NEUTRAL:
        if k.startswith("train."):
            attribute = ".".join(p + "_" if keyword.iskeyword(p) else p for p in k.removeprefix("train.").split("."))
            value = operator.attrgetter(attribute)(base.train)  # a keyword's field: train.checkpoint.async_
            leaves = vars(value) if dataclasses.is_dataclass(value) else {"": value}  # a section: each of its keys
            for n, v in leaves.items():
                key = f"{k}{'.' + n if n else ''}"
                neutral.append(f"{key}={SHAPED.get(k) or SHAPED.get(key) or _another_value(v)}")
    neutral += ["wandb.project=x", "hub.model_id=someone/x", "hub.strategy=every_save"]
    neutral += [f"output_dir={tmp_path}", "trackers=[]", "resume=null"]
    neutral += [
        "storage.local_dir=/x",
        "storage.local_max_gb=3",
        "storage.prefetch_shards=5",
        "storage.options.anon=true",
    ]
    assert run_hash(load_config(TrainConfig, CONFIGS / "stage1.yaml", neutral)) == run_hash(base)
    changed = ("train.optimizer.lr=0.5", "seed=1", "world.pool=2", "train.max_steps=7", "freeze.vae=false")
    for change in (*changed, "storage.shuffle_window=2"):
        assert run_hash(load_config(TrainConfig, CONFIGS / "stage1.yaml", [change])) != run_hash(base), change


def test_length_grouping_keys_change_the_run_hash_only_when_grouping_is_on():
    base = load_config(TrainConfig, CONFIGS / "stage3.yaml")
    hashed = lambda *sets: run_hash(load_config(TrainConfig, CONFIGS / "stage3.yaml", list(sets)))  # noqa: E731
    assert hashed("train.loader.group_window=3") == run_hash(base)  # grouping off: the window changes nothing
    on = hashed("train.loader.group_by_length=true")
    assert on != run_hash(base) and hashed("train.loader.group_by_length=true", "train.loader.group_window=3") != on
    # packing changes the layout of a step's samples, not which samples: resume-neutral (rounding aside)
    assert hashed("train.loader.packing=true", "train.loader.pack_length=512") == run_hash(base)
    with pytest.raises(UserError, match=r"^config key 'train.loader.packing': .* sdpa or eager .*flex_attention"):
        hashed("train.loader.packing=true", "train.hardware.attention=flex_attention")
    with pytest.raises(UserError, match=r"^config key 'train.loader.pack_length': must be positive, got 0"):
        hashed("train.loader.pack_length=0")


@pytest.mark.parametrize("stage", [1, 2, 3, 4])
def test_real_configs_build_on_the_meta_device_with_the_real_shapes(stage):
    """configs/real at the real architecture's shapes (offline, no weights): 512 px latents of 64 x 64, world tokens
    per pool as docs/training.md gives them (the world block: start marker, tokens, end marker), the projector's output
    at Gemma 3 4B's hidden size."""
    import torch

    from tools.memory_plan import build_world

    cfg = load_config(TrainConfig, CONFIGS / "real" / f"stage{stage}.yaml")
    model = build_world(cfg, device="meta")
    text = model.gemma.config.get_text_config()
    assert (text.hidden_size, text.num_hidden_layers, cfg.image.resolution) == (2560, 34, 512)
    latent = torch.zeros(1, 16, 1, cfg.image.resolution // 8, cfg.image.resolution // 8, device="meta")
    for pool, block in ((1, 4098), (2, 1026), (4, 258)):
        model.projector.pool = pool
        assert tuple(model.projector(latent, latent, "mean", None).shape) == (1, block, 2560), pool
    assert cfg.world.pool == 2


@dataclasses.dataclass
class _Section:
    often: int = neutral(1)
    lr: float = 0.1


@dataclasses.dataclass
class _Config:
    section: _Section = dataclasses.field(default_factory=_Section)
    out: str = neutral("runs")
    seed: int = 0


def test_resume_neutral_keys_are_declared_on_the_fields():
    assert neutral_keys(_Config) == ("section.often", "out")
    assert "train.logging.every" in RESUME_NEUTRAL and "train.optimizer.lr" not in RESUME_NEUTRAL


# The run hash of each shipped training config, as the release with a flat `train` section recorded it in its
# checkpoints' state.json: the sections must not change it, or those checkpoints would no longer resume.
RECORDED_HASHES = {
    "stage1.yaml": "8b616204ca2f2a2c",
    "stage1_rollout.yaml": "515aca59896762ff",
    "stage2.yaml": "62cf53a9800e16ba",
    "stage3.yaml": "acf70ff59b1d4b68",
    "stage3_lora.yaml": "68dca49e5686a654",
    "stage4.yaml": "58f8886cbd356422",
    # changed deliberately (issue 43): the real configs' learning rates square-root scaled to their batch of 256
    # (were 5c52cb59ef17fad8 and 6bb5b70091c455c4 at the plan's rates for a batch of 16)
    "real/stage1.yaml": "735a5e8779ae5f60",
    "real/stage4.yaml": "14f67415e75cb352",
    "real_small/stage1.yaml": "d2e64419277444e3",
}
FLAT = (
    Path(__file__).resolve().parents[1] / "data" / "stage4_flat.yaml"
)  # configs/stage4.yaml as the flat release shipped it


@pytest.mark.parametrize("name", sorted(RECORDED_HASHES))
def test_the_sections_keep_the_recorded_run_hashes(name):
    assert run_hash(load_config(TrainConfig, CONFIGS / name)) == RECORDED_HASHES[name]


def test_a_flat_config_of_the_earlier_release_loads_into_the_sections(capsys):
    from theworld.core import log
    from theworld.core.config import to_dict

    log.configure()
    old = load_config(TrainConfig, FLAT)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: config: keys of an earlier release"), err
    assert "train.lr -> train.optimizer.lr" in err[0] and "train.log_every -> train.logging.every" in err[0]
    assert "train.grad_norm_warn -> train.optimizer.grad_norm_warn" in err[0]
    new = load_config(TrainConfig, CONFIGS / "stage4.yaml")
    assert capsys.readouterr().err == ""  # the shipped configs use the sections
    assert to_dict(old) == to_dict(new)
    assert (old.train.optimizer.lr, old.train.optimizer.grad_norm_warn, old.train.logging.every) == (5e-4, 1000.0, 10)
    assert run_hash(old) == run_hash(new) == RECORDED_HASHES["stage4.yaml"]


def test_earlier_keys_in_a_set_win_over_the_file_and_errors_name_them_as_given():
    from theworld.core.errors import UserError

    cfg = load_config(TrainConfig, CONFIGS / "stage1.yaml", ["train.lr=0.5", "train.lr_multipliers.projector=2"])
    assert cfg.train.optimizer.lr == 0.5 and cfg.train.optimizer.lr_multipliers.projector == 2.0
    cfg = load_config(TrainConfig, FLAT, ["train.optimizer.lr=0.25", "train.samples=3"])  # a new key over a flat file
    assert cfg.train.optimizer.lr == 0.25 and cfg.train.eval.captions == 3
    with pytest.raises(UserError, match=r"config key 'train\.lr' \(now 'train\.optimizer\.lr'\): must be positive"):
        load_config(TrainConfig, None, ["train.lr=-1"])
    with pytest.raises(UserError, match=r"'train\.plateau\.window_evals' \(now 'train\.eval\.plateau\.window_evals'\)"):
        load_config(TrainConfig, None, ["train.plateau.window_evals=-1"])
    with pytest.raises(UserError, match=r"'train\.eval\.every': must be >= 0"):  # a new key is named as it is
        load_config(TrainConfig, None, ["train.eval.every=-1"])


def test_one_key_under_both_names_in_a_file_is_refused(tmp_path):
    from theworld.core.errors import UserError

    both = tmp_path / "both.yaml"
    both.write_text("train:\n  lr: 0.1\n  optimizer:\n    lr: 0.2\n")
    with pytest.raises(UserError, match=r"'train\.lr' and 'train\.optimizer\.lr' are one key .* give only"):
        load_config(TrainConfig, both)
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("train:\n  optimizer:\n    learning_rate: 0.2\n")
    with pytest.raises(UserError, match=r"unknown config key 'train\.optimizer\.learning_rate' \(known here: betas"):
        load_config(TrainConfig, unknown)


def test_one_key_under_both_names_in_two_sets_is_refused_as_in_a_file():
    from theworld.core.errors import UserError

    for sets in (
        ["train.warmup_steps=3", "train.lr_schedule.warmup_steps=7"],
        ["train.eval.plateau.window_evals=2", "train.plateau.window_evals=9"],  # a key under a moved section
    ):
        with pytest.raises(UserError, match=r"are one key .* give only"):
            load_config(TrainConfig, CONFIGS / "stage1.yaml", sets)
    # one name given twice: the last wins, as before; the old name over a file with the new one still wins
    cfg = load_config(TrainConfig, None, ["train.lr_schedule.warmup_steps=3", "train.lr_schedule.warmup_steps=7"])
    assert cfg.train.lr_schedule.warmup_steps == 7


def test_each_section_builds_alone_with_its_own_checks():
    """A builder takes its section alone: each is a dataclass whose checks name the full dotted key."""
    from theworld.core.errors import UserError
    from train.config import CheckpointConfig, EvalConfig, HardwareConfig, LrSchedule, OptimizerConfig

    assert OptimizerConfig(lr=0.1).lr == 0.1 and LrSchedule(decay="linear").warmup_steps == 50
    for build, key in (
        (lambda: OptimizerConfig(betas=[0.9]), "train.optimizer.betas"),
        (lambda: LrSchedule(warmup_steps=-1), "train.lr_schedule.warmup_steps"),
        (lambda: EvalConfig(captions=-1), "train.eval.captions"),
        (lambda: CheckpointConfig(keep_last=0), "train.checkpoint.keep_last"),
        (lambda: HardwareConfig(mixed_precision="fp16"), "train.hardware.mixed_precision"),
    ):
        with pytest.raises(UserError, match=rf"config key '{key}'"):
            build()


def test_earlier_keys_in_the_wrong_shape_are_one_line_errors(tmp_path):
    from theworld.core.errors import UserError

    bad = tmp_path / "bad.yaml"
    for text, sets, words in (
        ("train: {optimizer: 5, lr: 0.1}\n", [], "config key 'train.optimizer': expected a mapping, got 5"),
        (
            None,
            ["train.lr.foo=1"],
            "config key 'train.lr' (now 'train.optimizer.lr'): expected float, got dict {'foo': 1}",
        ),
        (
            "train:\n  schedule: {decay: cosine}\n",
            [],
            "'train.schedule' (now 'train.lr_schedule.decay'): must be one of",
        ),
        (None, ["train.lr_multipliers=3"], "'train.lr_multipliers' (now 'train.optimizer.lr_multipliers'): expected a"),
    ):
        if text is not None:
            bad.write_text(text)
        with pytest.raises(UserError) as e:
            load_config(TrainConfig, bad if text is not None else None, sets)
        assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_the_rollout_configs_load():
    from precompute.config import PrecomputeConfig
    from train.config import TrainConfig

    tiny = load_config(TrainConfig, ROOT / "configs" / "stage1_rollout.yaml")
    real = load_config(TrainConfig, ROOT / "configs" / "real" / "stage1_rollout.yaml")
    for cfg, plain in ((tiny, "stage1.yaml"), (real, "real/stage1.yaml")):
        assert (cfg.world.num_world_steps, cfg.world.max_world_steps) == (2, 16)
        assert "rollout" in cfg.cache_dir and "rollout" in cfg.output_dir
        base = load_config(TrainConfig, ROOT / "configs" / plain)
        # otherwise the stage-1 config: the same models, image, freeze flags and training settings
        assert (cfg.model, cfg.image, cfg.freeze, cfg.train) == (base.model, base.image, base.freeze, base.train)
    pre = load_config(PrecomputeConfig, ROOT / "configs" / "real" / "precompute.yaml")
    assert (real.model.gemma, real.model.vae, real.image.resolution) == (pre.model.gemma, pre.model.vae, 512)
