"""The tests mirror the rooms: every tests/<package>/<room>/test_<module>.py names a module that exists, and every
module with logic has its same-name test file. Whole runs live in tests/e2e/, the shipped configs' checks in
tests/configs/, the scripts' in tests/scripts/; checks of the whole repository (this file, the README's) at the top of
tests/.

Today's exceptions are listed with their reasons; an exception that no longer applies fails, so the lists only shrink.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
PACKAGES = ("theworld", "train", "precompute", "tools", "scripts")
FREE_ROOMS = ("e2e", "configs", "scripts")  # tests/<room>/ whose files need not name a module

# Test files that name no module yet: what each guards, and what stands in the way of its split
UNNAMED_TESTS = {
    "theworld/cache_format/test_read_ahead.py": "storage.py's read-ahead and ranged reads; it joins test_storage.py "
    "once the cache builder it shares with test_index.py (which imports test_storage.py) moves to the conftest",
}

# Modules with logic but no same-name test file: where they are tested today
UNTESTED_MODULES = {
    "theworld/embedded/tiny.py": "every test that loads the tiny models (tests/conftest.py); no test of its own yet",
    "theworld/infer/card.py": "tests/train/state/test_model_card.py and test_final.py",
    "theworld/model/config.py": "the model's sections through the engine: tests/theworld/core/test_config.py",
    "theworld/model/recompute.py": "train.hardware.activation_checkpointing: tests/train/test_config.py, "
    "tests/tools/test_memory_plan.py",
    "train/components.py": "tests/train/test_step.py and test_sharding.py",
    "train/loop.py": "the command: the runs in tests/e2e/",
    "train/meta_model.py": "train.loop --plan: tests/train/test_plan.py",
    "train/params.py": "tests/e2e/test_train_options.py",
    "train/state/states.py": "tests/train/state/test_checkpoint.py and test_migrations.py",
    "precompute/entry_dataset.py": "the loader's worker side: tests/precompute/test_cosmos_latents.py",
    "precompute/identity.py": "tests/precompute/sources/test_urls.py and tests/theworld/cache_format/test_storage.py",
    "precompute/shard_writer.py": "tests/precompute/test_cosmos_latents.py",
    "precompute/sources/arrow_files.py": "save_to_disk folders: tests/precompute/sources/test_parquet.py",
    "precompute/sources/synthetic.py": "tests/precompute/sources/test_listing.py",
    "tools/speed_checkpoint.py": "no smoke run yet",
}


def _test_files() -> list[str]:
    """tests/<package>/.../test_*.py outside the free rooms, relative to tests/."""
    files = sorted(p.relative_to(TESTS) for p in TESTS.rglob("test_*.py"))
    return [str(p) for p in files if len(p.parts) > 1 and p.parts[0] not in FREE_ROOMS]


def _module_of(test: str) -> Path:
    p = Path(test)
    return ROOT / p.parent / f"{p.stem.removeprefix('test_')}.py"


def _has_logic(module: Path) -> bool:
    return any(isinstance(n, (ast.FunctionDef, ast.ClassDef)) for n in ast.parse(module.read_text()).body)


def _modules_with_logic() -> list[str]:
    found = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if p.name != "__init__.py" and _has_logic(p)]
    return sorted(str(p.relative_to(ROOT)) for p in found)


def test_every_test_file_names_a_module():
    unnamed = [t for t in _test_files() if not _module_of(t).is_file()]
    assert sorted(set(unnamed) - set(UNNAMED_TESTS)) == [], "name the test file after the module it guards"
    assert sorted(set(UNNAMED_TESTS) - set(unnamed)) == [], "split or renamed: take it off UNNAMED_TESTS"


def test_every_module_with_logic_has_a_same_name_test_file():
    untested = [m for m in _modules_with_logic() if not (TESTS / Path(m).parent / f"test_{Path(m).name}").is_file()]
    assert sorted(set(untested) - set(UNTESTED_MODULES)) == [], "add tests/<package>/<room>/test_<module>.py"
    assert sorted(set(UNTESTED_MODULES) - set(untested)) == [], "it has its test file now: take it off UNTESTED_MODULES"
