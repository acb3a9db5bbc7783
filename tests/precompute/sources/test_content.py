"""precompute/sources/content.py: what every source's entries go through (image size and readability, caption and prompt
text: blank, UTF-8, Gemma control strings, length, nested JSON). Moved from tests/test_sources.py."""

from __future__ import annotations

import errno
import json

import pytest

from precompute import pipeline, sources
from precompute.sources import content
from tests._precompute_helpers import gradient, jpeg_bytes, make_cfg, png_bytes, read_cache_plain
from tests._source_helpers import listing_of, outcomes, txt_folder, write_tar
from theworld import cache_format as cf


def test_an_image_file_over_the_size_limit_is_refused_before_reading(tmp_path, monkeypatch):
    src = tmp_path / "src"
    txt_folder(src, 1)
    with open(src / "huge.png", "wb") as f:  # sparse: no disk space used
        f.truncate(content.MAX_IMAGE_BYTES + 1)
    (src / "huge.txt").write_text("big")
    reads = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda p, *a, **k: (reads.append(str(p)), real_open(p, *a, **k))[1])
    got = outcomes(listing_of("folder", src, tmp_path))
    assert (
        got["huge_png"] == f"error: image file too large: {content.MAX_IMAGE_BYTES + 1} bytes "
        f"(> {content.MAX_IMAGE_BYTES})"
    )
    assert str(src / "huge.png") not in reads and got["img000_png"] == "caption 0"
    # a tar member: its size is known from the listing
    tar = write_tar(tmp_path / "w.tar", [("a", "jpg", jpeg_bytes(gradient(20, 20))), ("a", "txt", b"x")])
    monkeypatch.setattr(content, "MAX_IMAGE_BYTES", 100)
    assert outcomes(listing_of("webdataset", tar, tmp_path))["a"].startswith("error: image file too large")


def test_deeply_nested_json_is_an_error_for_that_entry_only(tmp_path):
    img = jpeg_bytes(gradient(20, 20))
    deep = b"[" * 100_000 + b"]" * 100_000
    tar = write_tar(
        tmp_path / "00000.tar",
        [
            ("a", "jpg", img),
            ("a", "txt", b"a"),
            ("a", "json", deep),
            ("b", "jpg", img),
            ("b", "txt", b"b"),
            ("b", "json", b'{"url": "u"}'),
        ],
    )
    listing = listing_of("webdataset", tar, tmp_path)
    assert outcomes(listing) == {"a": "error: json member nested too deeply", "b": "b"}
    assert listing.load(listing.entries(1, 2)[0]).meta == {"url": "u"}
    src = tmp_path / "src"
    txt_folder(src, 1)
    (src / "captions.jsonl").write_text("[" * 100_000 + "\n" + json.dumps({"image": "img000.png", "caption": "x"}))
    assert outcomes(listing_of("folder", src, tmp_path)) == {
        "line-1": "error: bad caption line: JSON nested too deeply",
        "img000_png": "x",
    }


@pytest.mark.parametrize("text", ["", "   \n\t "])
def test_blank_captions_are_the_same_error_in_every_source(tmp_path, text):
    img = png_bytes(gradient(20, 20))
    src = tmp_path / "txt"
    src.mkdir()
    (src / "a.png").write_bytes(img)
    (src / "a.txt").write_text(text)
    jsonl = tmp_path / "jsonl"
    jsonl.mkdir()
    (jsonl / "a.png").write_bytes(img)
    (jsonl / "captions.jsonl").write_text(json.dumps({"image": "a.png", "caption": text}))
    tar = write_tar(tmp_path / "00000.tar", [("a_png", "png", img), ("a_png", "txt", text.encode())])
    for kind, path in (("folder", src), ("folder", jsonl), ("webdataset", tar)):
        assert outcomes(listing_of(kind, path, tmp_path / kind / path.name)) == {"a_png": "error: empty caption"}


def test_text_is_strict_utf8_without_bom_in_every_source(tmp_path):
    img = png_bytes(gradient(20, 20))
    src = tmp_path / "txt"
    src.mkdir()
    for name, raw in (("bom", b"\xef\xbb\xbfwith a BOM"), ("bad", b"caf\xe9"), ("ok", "caf\u00e9".encode())):
        (src / f"{name}.png").write_bytes(img)
        (src / f"{name}.txt").write_bytes(raw)
    want = {"bom_png": "with a BOM", "bad_png": "error: invalid UTF-8 at byte 3", "ok_png": "caf\u00e9"}
    assert outcomes(listing_of("folder", src, tmp_path / "a")) == want
    tar = write_tar(
        tmp_path / "00000.tar",
        [(k, m, d) for k in ("bom", "bad", "ok") for m, d in (("png", img), ("txt", (src / f"{k}.txt").read_bytes()))],
    )
    assert outcomes(listing_of("webdataset", tar, tmp_path / "b")) == {k[:-4]: v for k, v in want.items()}
    jsonl = tmp_path / "jsonl"
    jsonl.mkdir()
    (jsonl / "ok.png").write_bytes(img)
    line = json.dumps({"image": "ok.png", "caption": "x"}).encode()
    (jsonl / "captions.jsonl").write_bytes(b"\xef\xbb\xbf" + line + b"\n" + line[:-3] + b'\xe9"}\n')
    assert outcomes(listing_of("folder", jsonl, tmp_path / "c")) == {
        "ok_png": "x",
        "line-2": "error: bad caption line: invalid UTF-8",
    }


def test_gemma_control_strings_in_captions_and_prompts_are_refused(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    texts = {
        "soft": ("a cat <image_soft_token> here", None),
        "turn": ("fine", "describe<end_of_turn>"),
        "unused": ("x <unused42> y", None),
        "bos": ("<bos>", None),
        "html": ("a <table> of <b>bold</b>", None),
    }
    for k in texts:
        (src / f"{k}.png").write_bytes(png_bytes(gradient(20, 20)))
    (src / "captions.jsonl").write_text(
        "".join(
            json.dumps({"image": f"{k}.png", "caption": c, **({"prompt": p} if p else {})}) + "\n"
            for k, (c, p) in texts.items()
        )
    )
    listing = listing_of("folder", src, tmp_path)
    got = []
    for e in listing.entries(0, len(listing)):
        try:
            got.append(listing.load(e).caption)
        except sources.SourceError as err:
            got.append(str(err))
    assert got == [
        "caption holds the Gemma control string '<image_soft_token>'",
        "prompt holds the Gemma control string '<end_of_turn>'",
        "caption holds the Gemma control string '<unused42>'",
        "caption holds the Gemma control string '<bos>'",
        "a <table> of <b>bold</b>",
    ]


def test_a_caption_or_prompt_over_the_length_limit_is_an_error_entry(tmp_path):
    src = tmp_path / "src"
    txt_folder(src, 3)
    (src / "img001.txt").write_text("word " * content.MAX_TEXT_CHARS)
    lines = [
        json.dumps({"image": "img000.png", "caption": "fine", "prompt": "x" * (content.MAX_TEXT_CHARS + 1)}),
        json.dumps({"image": "img002.png", "caption": "y" * content.MAX_TEXT_CHARS}),
    ]
    got = outcomes(listing_of("folder", src, tmp_path))
    assert got["img001_png"].startswith("error: caption too long: ")
    (src / "captions.jsonl").write_text("\n".join(lines))
    got = outcomes(listing_of("folder", src, tmp_path / "j"))
    assert got["img000_png"].startswith("error: prompt too long") and got["img002_png"] == "y" * content.MAX_TEXT_CHARS


def test_an_unreadable_file_is_recorded_and_the_rest_encoded(tmp_path, fake_vae, monkeypatch):
    """Tests run as root, where chmod 000 does not stop a read: the file's open fails as it would for a user."""
    src = tmp_path / "src"
    txt_folder(src, 3)
    locked = str(src / "img001.png")

    def fake_open(path, *a, **k):
        if str(path) == locked:
            raise PermissionError(errno.EACCES, "Permission denied", locked)
        return open(path, *a, **k)

    monkeypatch.setattr(content, "open", fake_open, raising=False)
    out = tmp_path / "c"
    pipeline.run(make_cfg(out, "source.type=folder", f"source.path={src}"))
    assert list(read_cache_plain(out)) == ["img000_png", "img002_png"]
    assert [(e["key"], e["reason"]) for e in cf.read_errors(out)] == [
        ("img001_png", f"cannot read: PermissionError: [Errno 13] Permission denied: '{locked}'")
    ]
