"""theworld/describe.py: the command's arguments, refused in one line."""

from __future__ import annotations


def test_describe_says_what_an_image_path_is_and_never_opens_a_fifo(tmp_path, capsys):
    import os

    from theworld import describe

    (tmp_path / "folder").mkdir()
    os.mkfifo(tmp_path / "fifo")
    for name, words in (
        ("folder", "a directory, not an image file"),
        ("fifo", "a FIFO, not an image file"),
        ("none.png", "no such file"),
    ):
        assert describe.main(["--model", str(tmp_path), "--image", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert err == f"error: --image {tmp_path / name}: {words}\n", err
    assert (
        describe.main(["--model", str(tmp_path), "--image", str(tmp_path / "none.png"), "--prompt", "x" * 70000]) == 2
    )
    assert "--prompt too long: 70000 characters" in capsys.readouterr().err


def test_describe_refuses_world_steps_on_a_stage_without_rollouts_in_one_line(trained_run, capsys):
    from theworld import describe

    image = sorted((trained_run["mc"].parent / "images").iterdir())[0]
    argv = ["--model", str(trained_run["run"]), "--image", str(image), "--world-steps", "2"]
    assert describe.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "trained without world rollouts" in err[0]
