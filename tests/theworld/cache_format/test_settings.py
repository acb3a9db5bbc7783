"""The `storage:` section both commands share: its refusals name the key in one line, its folder is the user's, and
training reads it without torch (its config is checked before anything heavy loads)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ENV, ROOT
from theworld.cache_format.settings import DEFAULT_LOCAL_DIR, MOVED, Settings
from theworld.core.errors import UserError


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"local_max_gb": 0}, "config key 'storage.local_max_gb': must be positive, got 0"),
        ({"local_dir": "  "}, "config key 'storage.local_dir': empty; give a folder path"),
        ({"local_dir": "s3://b/x"}, "config key 'storage.local_dir': s3://b/x is a URL; give a local folder"),
        ({"prefetch_shards": -1}, "config key 'storage.prefetch_shards': must be >= 0, got -1"),
        ({"shuffle_window": -2}, "config key 'storage.shuffle_window': must be >= 0, got -2"),
        ({"node_groups": 0}, "config key 'storage.node_groups': must be >= 1, got 0"),
        (
            {"node_groups": 2},
            "config key 'storage.node_groups': 2 splits each window's shards between the nodes, so "
            "storage.shuffle_window (0) must be a positive multiple of it",
        ),
    ],
)
def test_a_bad_value_is_one_line_naming_its_key(kwargs, message):
    with pytest.raises(UserError) as e:
        Settings(**kwargs)
    assert str(e.value) == message


def test_the_folder_and_the_budget_are_the_users_and_earlier_keys_name_the_section():
    assert Settings().folder == Path(DEFAULT_LOCAL_DIR).expanduser() and "~" not in str(Settings().folder)
    assert Settings(local_dir="/x/y").folder == Path("/x/y")
    assert Settings(local_max_gb=2.5).budget == 2.5e9
    assert Settings(local_max_gb=1e300).budget > 10**30  # finite and allowed: no overflow where bytes are compared
    # every storage key of the fifth release's top level names its place in the section (node_groups came later)
    assert set(MOVED.values()) == {f"storage.{f}" for f in Settings.__dataclass_fields__} - {"storage.node_groups"}


def test_the_training_config_loads_with_its_storage_section_without_torch():
    probe = (
        "import sys\n"
        "from train.config import TrainConfig\n"
        "from theworld.core.config import load_config\n"
        "cfg = load_config(TrainConfig, 'configs/stage1.yaml', ['storage.shuffle_window=4'])\n"
        "assert cfg.storage.shuffle_window == 4\n"
        "print(sorted(m for m in ('torch', 'transformers', 'safetensors', 'PIL') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr
