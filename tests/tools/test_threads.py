"""tools/threads.py: every speed tool's --threads, refused in one line below 0."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("tool", ["speed_precompute", "speed_train", "speed_eval", "speed_generate", "speed_packing"])
@pytest.mark.parametrize("threads", ["-1", "two"])
def test_a_bad_thread_count_is_one_line_exit_2(tool, threads, capsys):
    """Every speed tool's --threads is tools/threads.py's: a count below 0 is refused before anything runs (torch
    raised a traceback from set_num_threads(-1) before)."""
    import importlib

    main = importlib.import_module(f"tools.{tool}").main
    with pytest.raises(SystemExit) as e:
        main(["--threads", threads])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err[-1].startswith(f"tools.{tool}: error: argument --threads"), err
    assert "whole number >= 0" in err[-1] or "invalid" in err[-1]
