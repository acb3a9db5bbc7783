"""theworld/infer/captions.py: caption sets and their reading rules."""

from __future__ import annotations

import json

import pytest


def test_caption_task_jsonl_keeps_a_raw_line_separator_and_refuses_a_fifo(tmp_path):
    import os

    from theworld.core.errors import UserError
    from theworld.embedded import synthetic
    from theworld.infer import captions

    synthetic.scene(0, 0)[0].save(tmp_path / "a.png")
    line = json.dumps({"image": "a.png", "captions": ["one\u2028two"]}, ensure_ascii=False)
    (tmp_path / "caps.jsonl").write_text(line + "\n" + line + "\n")
    assert len(captions.read(tmp_path / "caps.jsonl")) == 2
    os.mkfifo(tmp_path / "fifo.jsonl")
    with pytest.raises(UserError, match="fifo.jsonl: a FIFO, not a data file"):
        captions.read(tmp_path / "fifo.jsonl")
