"""The lock of exact versions (requirements/lock.txt, scripts/lock.py): `make install` gives every machine the set CI
ran. The environment the suite runs in holds the lock's versions, they meet every requirement of what is installed, and
the checker names what a lock lacks or pins wrongly."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from tests.conftest import ROOT

spec = importlib.util.spec_from_file_location("lock", ROOT / "scripts" / "lock.py")
lock = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lock)


def test_the_lock_pins_every_package_exactly_once_and_leaves_torch_to_the_user():
    pins = lock.read_lock()
    assert len(pins) > 100  # every transitive dependency, not only the direct ones
    assert not [n for n in pins if not lock.locked_name(n)]  # no torch build, pip or the project itself
    for name in ("transformers", "diffusers", "accelerate", "webdataset", "wandb", "lmms-eval", "peft", "filelock"):
        assert name in pins, name
    assert pins["filelock"].split(".")[:2] < ["4", "3"]  # lmms-eval imports filelock._api (gone in 4.3)


def test_the_environment_holds_the_lock():
    """`make install` installed exactly the lock (make test-latest deselects this: its venv holds newer releases)."""
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "lock.py"), "check"], capture_output=True, text=True, check=False
    )
    assert run.returncode == 0, run.stderr[-3000:]


def test_check_names_a_missing_a_wrong_and_an_unmet_pin(tmp_path, monkeypatch):
    pins = lock.read_lock()
    victim = "safetensors"  # required by transformers, diffusers, accelerate and the project
    lines = [f"{n}=={v}" for n, v in pins.items() if n != victim]
    lines[lines.index(f"tqdm=={pins['tqdm']}")] = "tqdm==0.0.1"
    path = tmp_path / "lock.txt"
    path.write_text("\n".join(lines) + "\n")
    monkeypatch.setattr(lock, "LOCK", path)
    assert lock.check() == 1
    dists = lock.installed()
    del dists[victim]
    assert any(p.startswith("transformers requires safetensors") and "not installed" in p for p in lock.unmet(dists))


@pytest.mark.parametrize(
    "line", ["torch>=2.6", "numpy", "pyyaml==6.0.3 ; python_version < '3.8'", "<<<<<<< HEAD", "tqdm 4.67.1 !"]
)
def test_a_lock_line_that_is_not_an_exact_pin_is_refused(tmp_path, line):
    path = tmp_path / "lock.txt"
    path.write_text(f"tqdm==4.67.1\n{line}\n")
    with pytest.raises(SystemExit, match=":2: .* is not an exact pin"):
        lock.read_lock(path)
