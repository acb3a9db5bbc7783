"""theworld/export.py: a merged export reads only what it may, and cleans up after a killed export."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ENV, one_error_line


def test_another_users_weights_are_one_line(trained_run, tmp_path):
    """trainable.safetensors mode 0600 of another user: one line naming it. Root reads any file, so as root the
    command runs without its capabilities (setpriv), which leaves uid 0 the file's 'other'."""
    final = tmp_path / "final"
    shutil.copytree(trained_run["run"] / "final", final)
    weights = final / "trainable.safetensors"
    prefix = []
    if os.geteuid() == 0:
        if not shutil.which("setpriv"):
            pytest.skip("running as root without setpriv: every file is readable")
        os.chown(weights, 65534, 65534)
        prefix = ["setpriv", "--inh-caps=-all", "--bounding-set=-all"]
    os.chmod(weights, 0o600 if prefix else 0)
    code = "import sys; from theworld.export import main; sys.exit(main(['--merge', '--model', *sys.argv[1:]]))"
    r = subprocess.run(
        [*prefix, sys.executable, "-c", code, str(final), "--out", str(tmp_path / "x")],
        env=ENV,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error")]
    assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "trainable.safetensors" in errors[0] and "Permission denied" in errors[0], errors
    assert not (tmp_path / "x").exists()


def test_an_export_removes_the_folder_a_killed_export_left(run_copy, tmp_path, capsys):
    from theworld import export
    from theworld.model.stage_layout import verify

    stale = tmp_path / ".tmp-x-999999999"  # kill -9 of the export with pid 999999999 (no such process runs)
    (stale / "sub").mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"0" * 1000)
    assert export.main(["--model", str(run_copy), "--merge", "--out", str(tmp_path / "x")]) == 0
    assert f"removed {stale}" in capsys.readouterr().err and not stale.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")] == []
    verify(tmp_path / "x")  # the export records its files' sha256 too
    (tmp_path / "x" / "sha256.json").unlink()
    assert export.main(["--model", str(tmp_path / "x"), "--merge", "--out", str(tmp_path / "y")]) == 2
    one_error_line(capsys, "sha256.json")
