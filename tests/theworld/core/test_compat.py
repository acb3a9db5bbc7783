"""theworld/core/compat.py: each compatibility rule has a release, the code follows the rule, and what is past its
window is refused in one line naming what to give instead."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import pytest

from precompute.config import PrecomputeConfig
from theworld.cache_format import migrations as cache_migrations
from theworld.core import compat, log
from theworld.core.config import load_config, to_yaml
from theworld.core.errors import UserError
from train.config import TrainConfig, run_hash
from train.state import migrations as checkpoint_migrations

COMMAND_CONFIGS = (TrainConfig, PrecomputeConfig)


@pytest.mark.parametrize("cls", COMMAND_CONFIGS, ids=lambda c: c.__name__)
def test_every_moved_key_names_its_release_and_is_within_its_window(cls):
    """An entry past its window must leave MOVED (the engine would refuse the key; the run hash keeps its shape)."""
    assert cls.MOVED
    for old, move in cls.MOVED.items():
        assert isinstance(move, compat.Move) and 1 <= move.release <= compat.RELEASE, old
        assert compat.RELEASE <= move.last_read, f"{old}: read through release {move.last_read}; remove it from MOVED"
        assert old != move.new and not move.new.startswith(old + "."), old


def test_the_format_migrations_read_what_the_rule_says():
    for formats, module, newest in (
        (compat.CACHE_FORMATS, cache_migrations, cache_migrations.FORMAT_VERSION),
        (compat.CHECKPOINT_FORMATS, checkpoint_migrations, checkpoint_migrations.SHARDED_VERSION),
    ):
        assert max(formats) == newest, f"{module.__name__}: format {newest} names no release in compat"
        assert tuple(module.READABLE) == compat.readable(formats), module.__name__


def test_a_format_is_read_for_its_window_after_its_successor_then_refused():
    formats = {1: 1, 2: 3, 3: 5}
    assert compat.format_last_read(formats, 1) == 3 + compat.FORMAT_RELEASES
    assert compat.format_last_read(formats, 3) is None  # the newest is written now
    assert compat.readable(formats, release=3 + compat.FORMAT_RELEASES) == (1, 2, 3)
    assert compat.readable(formats, release=4 + compat.FORMAT_RELEASES) == (2, 3)


@dataclass
class _Speed:
    rate: float = 1.0
    size: int = 1


@dataclass
class _Old:
    MOVED: ClassVar[dict[str, compat.Move]] = {
        "rate": compat.Move("speed.rate", compat.RELEASE - compat.KEY_RELEASES - 1),  # past its window
        "size": compat.Move("speed.size", compat.RELEASE),
    }
    speed: _Speed = field(default_factory=_Speed)


def test_a_moved_key_is_read_within_its_window_and_refused_after_it(tmp_path):
    assert load_config(_Old, None, ["size=3"]).speed.size == 3
    expired = rf"^config key 'rate' is 'speed.rate' since release {compat.RELEASE - 3}; .* give speed.rate$"
    with pytest.raises(UserError, match=expired):
        load_config(_Old, None, ["rate=2"])
    (tmp_path / "c.yaml").write_text("rate: 2\n")
    with pytest.raises(UserError, match=expired):
        load_config(_Old, tmp_path / "c.yaml")
    assert load_config(_Old, None, ["speed.rate=2"]).speed.rate == 2.0


STORAGE = (
    "storage_options: {anon: false, secret: s3cr3t}\ncache_local_dir: /tmp/x\ncache_local_max_gb: 3\n"
    "cache_prefetch_shards: 1\ncache_shuffle_window: 4\n"
)


def test_the_earlier_top_level_storage_keys_load_into_the_storage_section_with_one_line(tmp_path, capsys):
    log.configure()
    (tmp_path / "old.yaml").write_text(STORAGE)
    old = load_config(TrainConfig, tmp_path / "old.yaml")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cache_local_dir -> storage.local_dir" in err[0], err
    assert "storage_options -> storage.options" in err[0] and "cache_shuffle_window -> storage.shuffle_window" in err[0]
    s = old.storage
    assert (s.options, s.local_dir, s.local_max_gb, s.prefetch_shards, s.shuffle_window) == (
        {"anon": False, "secret": "s3cr3t"},
        "/tmp/x",
        3.0,
        1,
        4,
    )
    new = load_config(TrainConfig, None, ["storage.shuffle_window=4", "storage.local_dir=/elsewhere"])
    assert capsys.readouterr().err == "" and run_hash(old) == run_hash(new)
    assert "s3cr3t" not in to_yaml(old) and "storage:" in to_yaml(old)
    with pytest.raises(UserError, match=r"'cache_local_dir' and 'storage.local_dir' are one key"):
        load_config(TrainConfig, None, ["cache_local_dir=/a", "storage.local_dir=/b"])
    with pytest.raises(UserError, match=r"^config key 'cache_local_max_gb' \(now 'storage.local_max_gb'\): must"):
        load_config(TrainConfig, None, ["cache_local_max_gb=0"])


def test_precompute_takes_the_storage_section_and_refuses_training_s_reading_keys():
    cfg = load_config(PrecomputeConfig, None, ["cache_local_dir=/tmp/y", "storage.options.anon=true"])
    assert (cfg.storage.local_dir, cfg.storage.options) == ("/tmp/y", {"anon": True})
    for key in ("storage.shuffle_window=2", "cache_prefetch_shards=4"):
        with pytest.raises(UserError, match=r"(shuffle_window|prefetch_shards)'\)?: only read by training"):
            load_config(PrecomputeConfig, None, [key])


def test_the_compatibility_table_lists_every_moved_key_with_its_release():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[3] / "docs" / "training.md").read_text()
    for cls in COMMAND_CONFIGS:
        for old, move in cls.MOVED.items():
            assert f"| `{old}` | `{move.new}` | {move.release} ({move.last_read}) |" in doc, old
