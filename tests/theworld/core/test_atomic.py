"""theworld.core.atomic.folder: the one way a whole folder (a built Gemma, an export) is put in place."""

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from theworld.core import atomic
from theworld.core.errors import UserError


def _full(tmp: Path) -> str:
    return f"full writing {tmp}"


def _temps(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if p.name.startswith(".tmp-")]


def test_the_filled_folder_replaces_an_empty_out(tmp_path):
    out = tmp_path / "out"
    out.mkdir()  # empty: the callers refuse a full one
    with atomic.folder(out, _full) as tmp:
        assert tmp.parent == tmp_path and tmp.name == f".tmp-out-{os.getpid()}" and tmp.is_dir()
        assert not any(tmp.iterdir())
        (tmp / "weights").write_text("w")
        assert not (out / "weights").exists()  # nothing at out until the block ends
    assert (out / "weights").read_text() == "w" and _temps(tmp_path) == []


def test_a_failed_block_leaves_nothing(tmp_path):
    with pytest.raises(ValueError, match="broken"), atomic.folder(tmp_path / "out", _full) as tmp:
        (tmp / "half").write_text("x")
        raise ValueError("broken")
    assert not (tmp_path / "out").exists() and _temps(tmp_path) == []


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full")
def test_a_full_disk_is_the_callers_one_line_and_other_os_errors_its_other(tmp_path):
    def fill(tmp):
        with open("/dev/full", "w") as f:  # a real ENOSPC from the kernel
            f.write("x")

    with pytest.raises(UserError) as e, atomic.folder(tmp_path / "out", _full) as tmp:
        fill(tmp)
    assert str(e.value) == f"full writing {tmp}" and not (tmp_path / "out").exists() and _temps(tmp_path) == []

    def unwritable(err: OSError, tmp: Path) -> str:
        return f"cannot write {err.filename} ({err.strerror})"

    with pytest.raises(UserError) as e, atomic.folder(tmp_path / "out", _full, unwritable) as tmp:
        (tmp / "no" / "such").write_text("x")
    assert str(e.value) == f"cannot write {tmp / 'no' / 'such'} (No such file or directory)"
    with pytest.raises(FileNotFoundError), atomic.folder(tmp_path / "out", _full) as tmp:
        (tmp / "no" / "such").write_text("x")  # without `unwritable` the error goes on as it is
    assert not (tmp_path / "out").exists() and _temps(tmp_path) == []


def test_a_sigterm_removes_the_temporary_folder(tmp_path):
    code = textwrap.dedent(
        """
        import sys, time
        from theworld.core import atomic
        from theworld.core.errors import sigterm_as_exit
        with sigterm_as_exit(), atomic.folder(sys.argv[1], str) as tmp:
            (tmp / "half").write_text("x")
            print("writing", flush=True)
            time.sleep(60)
        """
    )
    p = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "out")], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "writing\n"
    assert _temps(tmp_path) == [f".tmp-out-{p.pid}"]
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == 128 + signal.SIGTERM
    assert not (tmp_path / "out").exists() and _temps(tmp_path) == []
