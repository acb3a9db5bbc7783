"""precompute/fonts.py: the decode sheet's font draws what the captions hold and names what no font has."""

from __future__ import annotations


def test_decode_sheet_labels_draw_non_latin_captions_and_name_what_no_font_has(capsys):
    import torch

    from precompute import fonts, inspect

    pair = (torch.zeros(3, 32, 32, dtype=torch.uint8), torch.zeros(3, 32, 32, dtype=torch.uint8))
    labels = ["key-0\nкрасный квадрат", "key-1\n\ue000 private"]  # U+E000: private use, in no font's tables
    sheet = inspect._sheet([pair, pair], labels, "header")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "1 character(s) of the captions ('\\ue000')" in err, err
    font, lacks = fonts.for_text(labels)
    assert lacks == {"\ue000"}  # the Cyrillic is drawn: the chosen font has its glyphs
    assert fonts.missing(font, set("красный")) == set()
    assert sheet.size[0] > 0
