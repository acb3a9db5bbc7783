"""theworld.core.paths.check_not_input: an output that would destroy an input is one line that says how."""

import os

import pytest

from theworld.core import paths
from theworld.core.errors import UserError


def test_an_output_that_is_an_input_a_file_in_it_or_a_folder_holding_it_is_refused_in_words(tmp_path):
    cache = tmp_path / "runs" / "cache"
    cache.mkdir(parents=True)
    (cache / "manifest.json").write_text("{}")
    os.link(cache / "manifest.json", tmp_path / "hardlink.json")
    cases = {
        tmp_path / "runs": f"--out {tmp_path / 'runs'} is a folder holding the cache {cache}: --out names the file",
        cache: f"--out {cache} is the cache {cache} or a file in it",
        tmp_path / "hardlink.json": "or a file in it (the same file, by its name, a symlink or a hardlink)",
    }
    for out, words in cases.items():
        with pytest.raises(UserError) as e:
            paths.check_not_input(out, {"the cache": cache})
        assert words in str(e.value) and "\n" not in str(e.value), str(e.value)
    paths.check_not_input(tmp_path / "sheet.png", {"the cache": cache})  # a new file beside it: fine
    paths.check_not_input(tmp_path / "runs", {"the cache": None})
