"""theworld/model/stage_layout.py: a stage folder's files, and a broken one in one line."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(
    "config,words",
    [
        (b"model: {gemma: tiny}\nx: \xff\xfe\n", "is not UTF-8 text (byte 0xff"),
        (b"[" * 5000 + b"]" * 5000, "nested too deeply"),
        (b"a: [1\n", "is not valid YAML"),
    ],
)
def test_a_model_folders_broken_config_yaml_is_one_line_in_describe_and_evaluate(tmp_path, capsys, config, words):
    from theworld import describe, evaluate
    from theworld.embedded import synthetic
    from theworld.model import stage_layout as checkpoint_layout

    folder = tmp_path / "final"
    folder.mkdir()
    (folder / checkpoint_layout.WEIGHTS).write_bytes(b"")
    (folder / checkpoint_layout.CONFIG).write_bytes(config)
    synthetic.scene(0, 0)[0].save(tmp_path / "a.png")
    (tmp_path / "items.jsonl").write_text('{"image": "a.png", "question": "q", "choices": ["a", "b"], "answer": 0}\n')
    for run in (
        lambda: describe.main(["--model", str(folder), "--image", str(tmp_path / "a.png")]),
        lambda: evaluate.main(["--model", str(folder), "--data", str(tmp_path / "items.jsonl")]),
    ):
        rc, err = run(), capsys.readouterr().err.splitlines()
        assert rc == 2 and err[-1].startswith(f"error: {folder / checkpoint_layout.CONFIG}") and words in err[-1], err
