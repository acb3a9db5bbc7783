"""--device-map / --offload-folder: where the offloaded weights go is a folder (or made as one); anything else there is
one line naming it before any weight loads, from the commands and from the library call."""

from __future__ import annotations

import os

import pytest
from torch import nn

from theworld.core.errors import UserError
from theworld.model import device_map


def test_an_offload_folder_that_is_not_a_folder_is_one_line_before_loading(tmp_path, capsys):
    from theworld import describe

    image = tmp_path / "scene.png"
    from PIL import Image

    Image.new("RGB", (8, 8)).save(image)
    weights = tmp_path / "weights.bin"
    weights.write_bytes(b"mine")
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    cases = {  # the offload folder given: the words its line holds
        weights: f"{weights} is a regular file",
        weights / "sub": f"{weights / 'sub'} is unreadable (Not a directory)",
        fifo: f"{fifo} is a FIFO",
    }
    for folder, words in cases.items():
        argv = ["--model", str(tmp_path / "no-run"), "--image", str(image), "--device-map", "disk"]
        assert describe.main([*argv, "--offload-folder", str(folder)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: offload_folder: ") and words in err, err
    assert weights.read_bytes() == b"mine"


def test_dispatch_makes_a_missing_offload_folder_and_refuses_one_it_cannot_make(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    folder = tmp_path / "offload" / "deeper"
    assert device_map.dispatch(model, "disk", folder) == {"0": "disk", "1": "disk"}
    assert folder.is_dir() and any(folder.iterdir())  # the offloaded weights are there
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(UserError, match=r"offload_folder: .*file is a regular file"):
        device_map.dispatch(nn.Linear(2, 2), "disk", blocker)
