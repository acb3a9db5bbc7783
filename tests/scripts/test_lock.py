"""The lock of exact versions (requirements/lock.txt, scripts/lock.py): `make install` gives every machine the set CI
ran. The environment the suite runs in holds the lock's versions, they meet every requirement of what is installed, and
the checker names what a lock lacks or pins wrongly."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

spec = importlib.util.spec_from_file_location("lock", ROOT / "scripts" / "lock.py")
lock = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lock)


def test_the_lock_pins_every_package_exactly_once_and_torch_by_its_version_alone():
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


def test_a_stray_line_is_one_line_naming_it(tmp_path):
    """Not a requirement at all (packaging's own message spans lines, with a caret under the fault)."""
    path = tmp_path / "lock.txt"
    for stray in ("remember to bump numpy!", "<<<<<<< HEAD", "torch==2.13.0 --index-url x"):
        path.write_text(f"tqdm==4.67.1\n# a comment\n{stray}\n")
        with pytest.raises(SystemExit) as e:
            lock.read_lock(path)
        assert str(e.value) == f"{path}:3: '{stray}' is not an exact pin (name==version), nor any requirement"


def test_torch_is_locked_by_its_version_whatever_its_build(tmp_path, monkeypatch, capsys):
    pins = lock.read_lock()
    assert pins["torch"] == "2.13.0" and "+" not in pins["torch"]
    dists = lock.installed()
    assert lock.locked_version("torch", dists["torch"]) == pins["torch"]  # 2.13.0+cpu here, +cu128 on a GPU node
    path = tmp_path / "lock.txt"
    path.write_text("".join(f"{n}=={'2.12.0' if n == 'torch' else v}\n" for n, v in pins.items()))
    monkeypatch.setattr(lock, "LOCK", path)
    assert lock.check() == 1
    assert capsys.readouterr().err.splitlines() == [f"lock: torch==2.12.0: {dists['torch'].version} is installed"]
    path.write_text("".join(f"{n}=={v}\n" for n, v in pins.items() if n != "torch"))
    assert lock.check() == 1 and "lock: torch is installed but not in the lock" in capsys.readouterr().err


FAKE_PY = """#!/bin/sh
# The venv's python for the Makefile's install: records each call; the lock check fails until the lock is installed
# again, torch is at $TORCH_AT (nothing: not installed), PyTorch's index fails when $NO_TORCH_INDEX is set.
echo "$*" >> "$LOG"
case "$*" in
  *"lock.py check"*) [ -e "$LOG.reinstalled" ] && exit 0; echo "lock: tqdm==4.67.1: 4.0 is installed" >&2; exit 1;;
  *"version('torch')"*) [ -n "$TORCH_AT" ] && echo "$TORCH_AT" && exit 0; exit 1;;
  *"--index-url"*) [ -n "$NO_TORCH_INDEX" ] && exit 1; exit 0;;
  *"-r requirements/lock.txt"*) touch "$LOG.reinstalled"; exit 0;;
  *) exit 0;;
esac
"""


def make_install(tmp_path, name: str, **env: str) -> tuple[list[str], str]:
    """`make install` with a venv whose stamp is newer than the lock (so make calls it up to date): the python calls
    it made, and its output."""
    venv = tmp_path / name
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    (venv / "bin" / "python").write_text(FAKE_PY)
    (venv / "bin" / "python").chmod(0o755)
    (venv / ".installed").touch()
    log = tmp_path / f"{name}.log"
    run = subprocess.run(
        ["make", "--no-print-directory", "install", f"VENV={venv}", "PYTHON=false"],
        cwd=ROOT,
        env={**os.environ, "LOG": str(log), "TORCH_AT": "", "NO_TORCH_INDEX": "", **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    calls = log.read_text().splitlines()
    return [c.split("import")[0] + "import torch ..." if "version('torch')" in c else c for c in calls], run.stdout


def test_make_install_rechecks_the_lock_every_time_and_reinstalls_on_drift(tmp_path):
    calls, out = make_install(tmp_path, "drifted", TORCH_AT="2.13.0+cu128")
    reinstall = [
        "-c import torch ...",
        "-m pip install -q --no-deps -r requirements/lock.txt",
        "-m pip install -q --no-deps -e .",
        "scripts/lock.py check",
    ]
    assert calls == ["scripts/lock.py check", *reinstall], calls
    assert "no longer holds requirements/lock.txt" in out and "torch 2.13.0+cu128 kept" in out  # any build of it
    calls, _ = make_install(tmp_path, "drifted", TORCH_AT="2.13.0+cu128")  # now it holds the lock: the check alone
    assert calls[len(reinstall) + 1 :] == ["scripts/lock.py check"]


@pytest.mark.parametrize("index_reachable", [True, False])
def test_make_install_puts_the_cpu_build_of_the_locked_torch_in(tmp_path, index_reachable):
    env = {"TORCH_AT": "2.12.0"} if index_reachable else {"NO_TORCH_INDEX": "1"}  # another version; none at all
    calls, out = make_install(tmp_path, "venv", **env)
    cpu = "-m pip install -q --no-deps --retries 1 --timeout 30 --index-url https://download.pytorch.org/whl/cpu "
    assert calls[2] == cpu + "torch==2.13.0+cpu", calls
    if index_reachable:
        assert calls[3] == "-m pip install -q --no-deps -r requirements/lock.txt"
    else:  # then the version as the machine's pip configuration offers it
        assert calls[3] == "-m pip install -q torch==2.13.0" and "as this machine's pip configuration" in out


def test_only_site_packages_counts_as_installed(tmp_path, monkeypatch):
    """Importing setuptools puts its vendored distributions (setuptools/_vendor) on sys.path; they are not installed."""
    vendored = tmp_path / "_vendor" / "jaraco_text-9.9.9.dist-info"
    vendored.mkdir(parents=True)
    (vendored / "METADATA").write_text("Metadata-Version: 2.1\nName: jaraco.text\nVersion: 9.9.9\n")
    monkeypatch.syspath_prepend(str(tmp_path / "_vendor"))
    from importlib.metadata import distributions

    assert "jaraco.text" in {d.metadata["Name"] for d in distributions()}  # sys.path sees it
    assert "jaraco-text" not in lock.installed()
    assert "safetensors" in lock.installed()
