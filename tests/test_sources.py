"""precompute.sources: hostile inputs each source meets (bad directory entries, changed folders, repeated keys, text
that is not what it seems, paths that leave the folder, deep JSON, huge files, a full disk)."""
from __future__ import annotations

import errno
import json
import os
import signal
import socket
import tarfile
from pathlib import Path

import pytest

from _precompute_helpers import cli_args, gradient, jpeg_bytes, make_cfg, png_bytes, read_cache_plain
from precompute import cosmos_latents, sources
from precompute.sources import content
from theworld import cache_format as cf


def _listing(kind: str, path, tmp_path: Path, **kw) -> sources.Listing:
    return sources.open_listing(kind, str(path), None, 0, "Describe the image.", index_dir=tmp_path / "idx", **kw)


def _outcomes(listing: sources.Listing) -> dict[str, str]:
    """{key: caption, or 'error: <reason>'} over the whole listing, loading every usable entry."""
    out = {}
    for e in listing.entries(0, len(listing)):
        if e.error is None:
            try:
                out[e.key] = listing.load(e).caption
            except (sources.SourceError, OSError) as err:
                out[e.key] = f"error: {err}"
        else:
            out.setdefault(e.key, f"error: {e.error}")
    return out


def _txt_folder(root: Path, n: int) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (root / f"img{i:03d}.png").write_bytes(png_bytes(gradient(20 + i % 3, 20)))
        (root / f"img{i:03d}.txt").write_text(f"caption {i}")


@pytest.fixture
def no_hang():
    """Fail (instead of hanging the suite) if the code under test blocks, e.g. by opening a FIFO."""
    signal.signal(signal.SIGALRM, lambda *a: pytest.fail("timed out: something blocked"))
    signal.alarm(60)
    yield
    signal.alarm(0)


# ----------------------------------------------------------------------------------------------------------------------
# Folder walk


def test_folder_walk_records_each_bad_entry_and_lists_the_rest(tmp_path, fake_vae, monkeypatch, no_hang):
    src = tmp_path / "src"
    _txt_folder(src, 40)
    (src / "loop.jpg").symlink_to(src / "loop.jpg")  # DirEntry.is_file() raises ELOOP
    (src / "dead.png").symlink_to(src / "gone.png")
    os.mkfifo(src / "fifo.jpg")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(src / "sock.png"))
    (src / "locked").mkdir()
    (src / "locked" / "x.png").write_bytes(png_bytes(gradient(20, 20)))
    (src / "zz").mkdir()  # a folder whose listing breaks off after its first entry
    for name in ("a.png", "b.png"):
        (src / "zz" / name).write_bytes(png_bytes(gradient(20, 20)))
        (src / "zz" / name).with_suffix(".txt").write_text("zz")
    from precompute.sources import folder

    real_scandir = os.scandir

    class Broken:
        """os.scandir of src/zz: yields one entry, then fails as a failing disk would."""

        def __init__(self, path):
            self.it = real_scandir(path)
            self.n = 0

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.it.close()

        def __next__(self):
            self.n += 1
            if self.n > 1:
                raise OSError(errno.EIO, "Input/output error")
            return min(self.it, key=lambda e: e.name)

    def scandir(path):
        name = os.fsdecode(path)
        if name.endswith("/locked"):  # tests run as root, where chmod 000 does not stop a read
            raise PermissionError(errno.EACCES, "Permission denied", name)
        return Broken(path) if name.endswith("/zz") else real_scandir(path)

    monkeypatch.setattr(folder.os, "scandir", scandir)
    out = tmp_path / "c"
    result = cosmos_latents.run(make_cfg(out, "source.type=folder", f"source.path={src}", n=100))
    samples = read_cache_plain(out)
    assert sorted(samples) == [f"img{i:03d}_png" for i in range(40)] + ["zz_a_png"]
    reasons = {e["source"]: e["reason"] for e in cf.read_errors(out)}
    assert reasons == {"dead.png": "dangling symlink", "fifo.jpg": "not a regular file (a FIFO)",
                       "sock.png": "not a regular file (a socket)", "locked": "cannot list folder: Permission denied",
                       "loop.jpg": "cannot stat: Too many levels of symbolic links",
                       "zz": "cannot list folder: Input/output error"}
    assert result["num_samples"] == 41 and result["num_errors"] == 6
    sock.close()


def test_a_fifo_named_in_captions_jsonl_is_refused_without_opening_it(tmp_path, no_hang):
    src = tmp_path / "src"
    src.mkdir()
    os.mkfifo(src / "pipe.jpg")
    (src / "ok.png").write_bytes(png_bytes(gradient(20, 20)))
    (src / "captions.jsonl").write_text("\n".join(json.dumps({"image": i, "caption": "c"})
                                                  for i in ("pipe.jpg", "ok.png")))
    assert _outcomes(_listing("folder", src, tmp_path)) == {"pipe_jpg": "error: not a regular file (a FIFO)",
                                                            "ok_png": "c"}


def test_an_image_file_over_the_size_limit_is_refused_before_reading(tmp_path, monkeypatch):
    src = tmp_path / "src"
    _txt_folder(src, 1)
    with open(src / "huge.png", "wb") as f:  # sparse: no disk space used
        f.truncate(content.MAX_IMAGE_BYTES + 1)
    (src / "huge.txt").write_text("big")
    reads = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda p, *a, **k: (reads.append(str(p)), real_open(p, *a, **k))[1])
    got = _outcomes(_listing("folder", src, tmp_path))
    assert got["huge_png"] == f"error: image file too large: {content.MAX_IMAGE_BYTES + 1} bytes " \
                              f"(> {content.MAX_IMAGE_BYTES})"
    assert str(src / "huge.png") not in reads and got["img000_png"] == "caption 0"
    # a tar member: its size is known from the listing
    tar = _tar(tmp_path / "w.tar", [("a", "jpg", jpeg_bytes(gradient(20, 20))), ("a", "txt", b"x")])
    monkeypatch.setattr(content, "MAX_IMAGE_BYTES", 100)
    assert _outcomes(_listing("webdataset", tar, tmp_path))["a"].startswith("error: image file too large")


# ----------------------------------------------------------------------------------------------------------------------
# A folder that changed between runs


def test_resuming_after_the_folder_changed_is_refused_naming_the_change(tmp_path, fake_vae, capsys):
    src, out = tmp_path / "src", tmp_path / "c"
    _txt_folder(src, 6)
    args = cli_args(out, "source.type=folder", f"source.path={src}", shard=2)
    assert cosmos_latents.main(args) == 0
    assert cosmos_latents.main(args) == 0  # unchanged: resumes (nothing to do)
    capsys.readouterr()
    (src / "img002.png").unlink()
    (src / "new.png").write_bytes(png_bytes(gradient(20, 20)))
    cf.tar_path(out, 2).unlink()  # a shard to redo: mixing the two listings would put new.png into it
    assert cosmos_latents.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "new.png added, img002.png removed" in err and "another output_dir" in err
    assert not cf.tar_path(out, 2).exists()
    # captions.jsonl: the same rule
    src2, out2 = tmp_path / "src2", tmp_path / "c2"
    _txt_folder(src2, 2)
    (src2 / "captions.jsonl").write_text(json.dumps({"image": "img000.png", "caption": "a"}) + "\n")
    args2 = cli_args(out2, "source.type=folder", f"source.path={src2}")
    assert cosmos_latents.main(args2) == 0
    (src2 / "captions.jsonl").write_text(json.dumps({"image": "img001.png", "caption": "b"}) + "\n")
    capsys.readouterr()
    assert cosmos_latents.main(args2) == 2
    assert "captions.jsonl changed since the cache" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------------------------
# Webdataset tars


def _tar(path: Path, members: list[tuple[str, str, bytes]]) -> Path:
    """A tar with members `<key>.<ext>` in the given order (as a tool that does not group them could write it)."""
    import io

    with tarfile.open(path, "w") as tf:
        for key, ext, data in members:
            info = tarfile.TarInfo(f"{key}.{ext}")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def test_a_key_repeated_inside_one_tar_keeps_the_first_sample(tmp_path):
    img = jpeg_bytes(gradient(20, 20))
    tar = _tar(tmp_path / "00000.tar", [("a", "jpg", img), ("a", "txt", b"first a"), ("b", "jpg", img),
                                        ("b", "txt", b"b"), ("a", "jpg", img), ("a", "txt", b"second a"),
                                        ("c", "jpg", img), ("c", "txt", b"c1"), ("c", "txt", b"c2")])
    listing = _listing("webdataset", tar, tmp_path)
    entries = listing.entries(0, len(listing))
    assert [(e.source, e.error) for e in entries] == [
        ("00000.tar:a", None), ("00000.tar:b", None),
        ("00000.tar:a", "duplicate key: 'a' (first used by 00000.tar:a)"), ("00000.tar:c", None),
        ("00000.tar:c", "duplicate key: 'c' (first used by 00000.tar:c)")]
    assert listing.load(entries[0]).caption == "first a" and listing.load(entries[3]).caption == "c1"
    # webdataset's own reader starts a new sample where the key changes, as the listing does (a member repeated
    # within a sample, like c.txt above, is an error there)
    import webdataset as wds

    tar = _tar(tmp_path / "00001.tar", [("a", "jpg", img), ("a", "txt", b"first a"), ("b", "jpg", img),
                                        ("b", "txt", b"b"), ("a", "jpg", img), ("a", "txt", b"second a")])
    assert [s["txt"] for s in wds.WebDataset(str(tar), shardshuffle=False)] == [b"first a", b"b", b"second a"]


def test_webdataset_path_may_be_a_folder_of_tars(tmp_path):
    from _precompute_helpers import wds_source

    wds_source(tmp_path / "w", tars=3, per_tar=2)
    (tmp_path / "w" / "notes.txt").write_text("not a shard")
    listing = _listing("webdataset", tmp_path / "w", tmp_path)
    assert [e.source for e in listing.entries(0, 6)] == [f"{j:05d}.tar:{j:05d}{i:04d}" for j in range(3)
                                                         for i in range(2)]


def test_deeply_nested_json_is_an_error_for_that_entry_only(tmp_path):
    img = jpeg_bytes(gradient(20, 20))
    deep = b"[" * 100_000 + b"]" * 100_000
    tar = _tar(tmp_path / "00000.tar", [("a", "jpg", img), ("a", "txt", b"a"), ("a", "json", deep),
                                        ("b", "jpg", img), ("b", "txt", b"b"), ("b", "json", b'{"url": "u"}')])
    listing = _listing("webdataset", tar, tmp_path)
    assert _outcomes(listing) == {"a": "error: json member nested too deeply", "b": "b"}
    assert listing.load(listing.entries(1, 2)[0]).meta == {"url": "u"}
    src = tmp_path / "src"
    _txt_folder(src, 1)
    (src / "captions.jsonl").write_text("[" * 100_000 + "\n" + json.dumps({"image": "img000.png", "caption": "x"}))
    assert _outcomes(_listing("folder", src, tmp_path)) == {"line-1": "error: bad caption line: JSON nested too "
                                                                      "deeply", "img000_png": "x"}


# ----------------------------------------------------------------------------------------------------------------------
# Caption and prompt text: one rule in every source


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
    tar = _tar(tmp_path / "00000.tar", [("a_png", "png", img), ("a_png", "txt", text.encode())])
    for kind, path in (("folder", src), ("folder", jsonl), ("webdataset", tar)):
        assert _outcomes(_listing(kind, path, tmp_path / kind / path.name)) == {"a_png": "error: empty caption"}


def test_text_is_strict_utf8_without_bom_in_every_source(tmp_path):
    img = png_bytes(gradient(20, 20))
    src = tmp_path / "txt"
    src.mkdir()
    for name, raw in (("bom", b"\xef\xbb\xbfwith a BOM"), ("bad", b"caf\xe9"), ("ok", "caf\u00e9".encode())):
        (src / f"{name}.png").write_bytes(img)
        (src / f"{name}.txt").write_bytes(raw)
    want = {"bom_png": "with a BOM", "bad_png": "error: invalid UTF-8 at byte 3", "ok_png": "caf\u00e9"}
    assert _outcomes(_listing("folder", src, tmp_path / "a")) == want
    tar = _tar(tmp_path / "00000.tar", [(k, m, d) for k in ("bom", "bad", "ok") for m, d in
                                        (("png", img), ("txt", (src / f"{k}.txt").read_bytes()))])
    assert _outcomes(_listing("webdataset", tar, tmp_path / "b")) == {k[:-4]: v for k, v in want.items()}
    jsonl = tmp_path / "jsonl"
    jsonl.mkdir()
    (jsonl / "ok.png").write_bytes(img)
    line = json.dumps({"image": "ok.png", "caption": "x"}).encode()
    (jsonl / "captions.jsonl").write_bytes(b"\xef\xbb\xbf" + line + b"\n" + line[:-3] + b"\xe9\"}\n")
    assert _outcomes(_listing("folder", jsonl, tmp_path / "c")) == {"ok_png": "x",
                                                                    "line-2": "error: bad caption line: invalid UTF-8"}


def test_gemma_control_strings_in_captions_and_prompts_are_refused(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    texts = {"soft": ("a cat <image_soft_token> here", None), "turn": ("fine", "describe<end_of_turn>"),
             "unused": ("x <unused42> y", None), "bos": ("<bos>", None), "html": ("a <table> of <b>bold</b>", None)}
    for k in texts:
        (src / f"{k}.png").write_bytes(png_bytes(gradient(20, 20)))
    (src / "captions.jsonl").write_text("".join(
        json.dumps({"image": f"{k}.png", "caption": c, **({"prompt": p} if p else {})}) + "\n"
        for k, (c, p) in texts.items()))
    listing = _listing("folder", src, tmp_path)
    got = []
    for e in listing.entries(0, len(listing)):
        try:
            got.append(listing.load(e).caption)
        except sources.SourceError as err:
            got.append(str(err))
    assert got == ["caption holds the Gemma control string '<image_soft_token>'",
                   "prompt holds the Gemma control string '<end_of_turn>'",
                   "caption holds the Gemma control string '<unused42>'",
                   "caption holds the Gemma control string '<bos>'", "a <table> of <b>bold</b>"]


def test_control_string_list_covers_the_tokenizers_special_tokens():
    """theworld.control_text is a written list (precompute must not need Gemma's tokenizer): it names every special
    token of the tiny Gemma tokenizer, which is built with the real one's control tokens."""
    from theworld import encoders
    from theworld.control_text import find_control_string

    _, processor = encoders.load_gemma("tiny", "float32")
    tok = processor.tokenizer
    special = set(tok.all_special_tokens) | {t.content for t in tok.added_tokens_decoder.values() if t.special}
    assert {"<start_of_image>", "<end_of_turn>", "<image_soft_token>"} <= special
    assert all(find_control_string(f"a {s} b") == s for s in special)


def test_captions_jsonl_paths_that_leave_the_folder_are_refused(tmp_path):
    outside = tmp_path / "outside.png"
    outside.write_bytes(png_bytes(gradient(20, 20)))
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "in.png").write_bytes(outside.read_bytes())
    rels = ["../outside.png", str(outside), "sub/../../outside.png", "sub/../sub/in.png", "sub/in.png"]
    (src / "captions.jsonl").write_text("".join(json.dumps({"image": r, "caption": "c"}) + "\n" for r in rels))
    listing = _listing("folder", src, tmp_path)
    errors = [e.error for e in listing.entries(0, len(listing))]
    assert errors[:4] == [f"bad caption line: 'image' leaves the source folder: {r!r}" for r in rels[:4]]
    assert errors[4] is None


# ----------------------------------------------------------------------------------------------------------------------
# A full disk


def test_a_full_disk_is_one_line_and_the_rerun_is_bit_exact(tmp_path, fake_vae, monkeypatch, capsys):
    from precompute import shard_writer

    reference = cosmos_latents.run(make_cfg(tmp_path / "ref", n=12, shard=4))
    out = tmp_path / "c"
    write_shard = cf.write_shard

    def full_disk(cache_dir, index, samples):
        if index == 1:
            tmp = cf.tar_path(cache_dir, index)
            (tmp.parent / f".{tmp.name}.tmp{os.getpid()}").write_bytes(b"partial")  # what a real write leaves
            raise OSError(errno.ENOSPC, "No space left on device")
        return write_shard(cache_dir, index, samples)

    monkeypatch.setattr(shard_writer.cf, "write_shard", full_disk)
    assert cosmos_latents.main(cli_args(out, n=12, shard=4)) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if "space" in line or "Error" in line]
    assert len(lines) == 1 and lines[0].startswith("error: no space left on device writing "), lines
    assert str(cf.tar_path(out, 1)) in lines[0]
    assert not (out / "manifest.json").exists() and not cf.shard_is_done(out, 1)
    assert not list((out / "shards").glob(".*tmp*"))
    monkeypatch.setattr(shard_writer.cf, "write_shard", write_shard)
    assert cosmos_latents.main(cli_args(out, n=12, shard=4)) == 0
    assert [s["sha256"] for s in cf.load_manifest(out)["shards"]] == [s["sha256"] for s in reference["shards"]]
