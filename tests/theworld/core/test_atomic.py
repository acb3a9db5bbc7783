"""theworld.core.atomic: the one atomic writer (files and folders), its partial-name rule and its clean-up."""

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


def test_a_kill_9_leaves_one_partial_that_the_next_writer_removes_and_nothing_trusts(tmp_path):
    from theworld.model import stage_layout

    code = textwrap.dedent(
        """
        import sys, time
        from theworld.core import atomic
        with atomic.folder(sys.argv[1], str) as tmp:
            (tmp / "trainable.safetensors").write_text("half")
            print("writing", flush=True)
            time.sleep(60)
        """
    )
    p = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "out")], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "writing\n"
    assert atomic.remove_stale(tmp_path, "out") == []  # its writer still runs: left to it
    p.kill()
    p.wait(timeout=30)
    partial = tmp_path / f".tmp-out-{p.pid}"
    assert _temps(tmp_path) == [partial.name] and atomic.is_partial(partial.name)
    with pytest.raises(UserError, match=r"an unfinished write .*give the finished folder"):
        stage_layout.resolve(partial)
    (tmp_path / ".tmp-other-1").mkdir()  # another target's partial: not this writer's to remove
    assert atomic.remove_stale(tmp_path, "out") == [str(partial)]
    assert _temps(tmp_path) == [".tmp-other-1"]


def test_files_are_whole_or_absent_and_a_failed_write_leaves_no_partial(tmp_path):
    target = tmp_path / "manifest.json"
    atomic.write_json(target, {"b": 1, "a": [2]})
    assert target.read_text() == '{\n "a": [\n  2\n ],\n "b": 1\n}\n'
    atomic.write_text(target, "second")
    assert target.read_text() == "second" and _temps(tmp_path) == []
    with pytest.raises(RuntimeError), atomic.file(target) as tmp:
        assert tmp.name == f".tmp-manifest.json-{os.getpid()}"
        tmp.write_text("half")
        raise RuntimeError("stopped")
    assert target.read_text() == "second" and _temps(tmp_path) == []


def test_a_folder_moved_aside_comes_back_when_its_replacement_never_arrived(tmp_path):
    final = tmp_path / "final"
    final.mkdir()
    (final / "card").write_text("old")
    new = tmp_path / atomic.partial_name("final")
    new.mkdir()
    (new / "card").write_text("new")
    atomic.replace_folder(new, final)
    assert (final / "card").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["final"]
    # killed between moving final/ aside and the rename: the clean-up (under the run lock) puts it back
    (final).rename(tmp_path / ".old-final-4242")
    (tmp_path / ".tmp-final-4242").mkdir()
    removed = atomic.remove_stale(tmp_path, only_dead=False)
    assert removed == [str(tmp_path / ".tmp-final-4242")] and (final / "card").read_text() == "new"
