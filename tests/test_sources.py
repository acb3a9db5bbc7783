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
from theworld.errors import UserError


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
    assert reasons == {
        "dead.png": f"not a regular file (a dangling symlink to {src / 'gone.png'})",
        "fifo.jpg": "not a regular file (a FIFO)",
        "sock.png": "not a regular file (a socket)",
        "locked": "cannot list folder: Permission denied",
        "loop.jpg": "not a regular file (a symlink loop)",
        "zz": "cannot list folder: Input/output error",
    }
    assert result["num_samples"] == 41 and result["num_errors"] == 6
    sock.close()


def test_a_fifo_named_in_captions_jsonl_is_refused_without_opening_it(tmp_path, no_hang):
    src = tmp_path / "src"
    src.mkdir()
    os.mkfifo(src / "pipe.jpg")
    (src / "ok.png").write_bytes(png_bytes(gradient(20, 20)))
    (src / "captions.jsonl").write_text(
        "\n".join(json.dumps({"image": i, "caption": "c"}) for i in ("pipe.jpg", "ok.png"))
    )
    assert _outcomes(_listing("folder", src, tmp_path)) == {
        "pipe_jpg": "error: not a regular file (a FIFO)",
        "ok_png": "c",
    }


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
    assert (
        got["huge_png"] == f"error: image file too large: {content.MAX_IMAGE_BYTES + 1} bytes "
        f"(> {content.MAX_IMAGE_BYTES})"
    )
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
    tar = _tar(
        tmp_path / "00000.tar",
        [
            ("a", "jpg", img),
            ("a", "txt", b"first a"),
            ("b", "jpg", img),
            ("b", "txt", b"b"),
            ("a", "jpg", img),
            ("a", "txt", b"second a"),
            ("c", "jpg", img),
            ("c", "txt", b"c1"),
            ("c", "txt", b"c2"),
        ],
    )
    listing = _listing("webdataset", tar, tmp_path)
    entries = listing.entries(0, len(listing))
    assert [(e.source, e.error) for e in entries] == [
        ("00000.tar:a", None),
        ("00000.tar:b", None),
        ("00000.tar:a", "duplicate key: 'a' (first used by 00000.tar:a)"),
        ("00000.tar:c", None),
        ("00000.tar:c", "duplicate key: 'c' (first used by 00000.tar:c)"),
    ]
    assert listing.load(entries[0]).caption == "first a" and listing.load(entries[3]).caption == "c1"
    # webdataset's own reader starts a new sample where the key changes, as the listing does (a member repeated
    # within a sample, like c.txt above, is an error there)
    import webdataset as wds

    tar = _tar(
        tmp_path / "00001.tar",
        [
            ("a", "jpg", img),
            ("a", "txt", b"first a"),
            ("b", "jpg", img),
            ("b", "txt", b"b"),
            ("a", "jpg", img),
            ("a", "txt", b"second a"),
        ],
    )
    assert [s["txt"] for s in wds.WebDataset(str(tar), shardshuffle=False)] == [b"first a", b"b", b"second a"]


def test_webdataset_path_may_be_a_folder_of_tars(tmp_path):
    from _precompute_helpers import wds_source

    wds_source(tmp_path / "w", tars=3, per_tar=2)
    (tmp_path / "w" / "notes.txt").write_text("not a shard")
    listing = _listing("webdataset", tmp_path / "w", tmp_path)
    assert [e.source for e in listing.entries(0, 6)] == [
        f"{j:05d}.tar:{j:05d}{i:04d}" for j in range(3) for i in range(2)
    ]


def test_deeply_nested_json_is_an_error_for_that_entry_only(tmp_path):
    img = jpeg_bytes(gradient(20, 20))
    deep = b"[" * 100_000 + b"]" * 100_000
    tar = _tar(
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
    listing = _listing("webdataset", tar, tmp_path)
    assert _outcomes(listing) == {"a": "error: json member nested too deeply", "b": "b"}
    assert listing.load(listing.entries(1, 2)[0]).meta == {"url": "u"}
    src = tmp_path / "src"
    _txt_folder(src, 1)
    (src / "captions.jsonl").write_text("[" * 100_000 + "\n" + json.dumps({"image": "img000.png", "caption": "x"}))
    assert _outcomes(_listing("folder", src, tmp_path)) == {
        "line-1": "error: bad caption line: JSON nested too deeply",
        "img000_png": "x",
    }


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
    tar = _tar(
        tmp_path / "00000.tar",
        [(k, m, d) for k in ("bom", "bad", "ok") for m, d in (("png", img), ("txt", (src / f"{k}.txt").read_bytes()))],
    )
    assert _outcomes(_listing("webdataset", tar, tmp_path / "b")) == {k[:-4]: v for k, v in want.items()}
    jsonl = tmp_path / "jsonl"
    jsonl.mkdir()
    (jsonl / "ok.png").write_bytes(img)
    line = json.dumps({"image": "ok.png", "caption": "x"}).encode()
    (jsonl / "captions.jsonl").write_bytes(b"\xef\xbb\xbf" + line + b"\n" + line[:-3] + b'\xe9"}\n')
    assert _outcomes(_listing("folder", jsonl, tmp_path / "c")) == {
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
    listing = _listing("folder", src, tmp_path)
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


# ----------------------------------------------------------------------------------------------------------------------
# Sources as the real tools lay them out


def test_img2dataset_files_layout_keeps_url_and_uid(tmp_path, fake_vae):
    """img2dataset output_format=files: <shard>/<key>.jpg + .txt + .json (+ <shard>.parquet and _stats.json beside)."""
    src = tmp_path / "dl"
    (src / "00000").mkdir(parents=True)
    for i in range(3):
        key = f"{i:09d}"
        (src / "00000" / f"{key}.jpg").write_bytes(jpeg_bytes(gradient(30, 24)))
        (src / "00000" / f"{key}.txt").write_text(f"photo {i}")
        (src / "00000" / f"{key}.json").write_text(
            json.dumps(
                {
                    "url": f"http://img/{i}.jpg",
                    "key": key,
                    "status": "success",
                    "error_message": None,
                    "width": 30,
                    "height": 24,
                    "original_width": 300,
                    "original_height": 240,
                    "exif": "{}",
                    "sha256": "ab" * 32,
                    "uid": f"{i:032x}",
                    "caption": f"photo {i}",
                }
            )
        )
    (src / "00000_stats.json").write_text(json.dumps({"count": 3, "successes": 3}))
    (src / "00000.parquet").write_bytes(b"PAR1")  # beside the folder, not an image: ignored
    out = tmp_path / "c"
    cosmos_latents.run(make_cfg(out, "source.type=folder", f"source.path={src}"))
    samples = read_cache_plain(out)
    assert list(samples) == [f"00000_{i:09d}_jpg" for i in range(3)]
    meta = json.loads(samples["00000_000000002_jpg"]["json"])
    assert (meta["url"], meta["uid"], meta["key"]) == ("http://img/2.jpg", f"{2:032x}", "000000002")
    assert samples["00000_000000002_jpg"]["txt"] == b"photo 2"


def _chat_item(i: int, human: str = "Provide a brief description of the given image.\n<image>", **kw) -> dict:
    return {
        "id": f"GCC_train_{i:09d}",
        "image": f"GCC_train_{i:09d}.jpg",
        "conversations": [{"from": "human", "value": human}, {"from": "gpt", "value": f"a caption {i} ."}],
        **kw,
    }


def test_llava_chat_json(tmp_path, fake_vae):
    """LLaVA-CC3M-Pretrain-595K: chat.json beside images/ (the extracted images.zip); LLaVA-Instruct's multi-turn
    conversations keep every turn."""
    root = tmp_path / "LLaVA-CC3M-Pretrain-595K"
    (root / "images").mkdir(parents=True)
    for i in (0, 1, 2, 3, 6, 7):  # not 5: an item whose image is missing
        (root / "images" / f"GCC_train_{i:09d}.jpg").write_bytes(jpeg_bytes(gradient(30 + i, 24)))
    items = [
        _chat_item(0),
        _chat_item(1, human="<image>\nWhat is in the photo?"),
        _chat_item(2),
        _chat_item(3),
        {"id": "text-only", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
        _chat_item(5),
        _chat_item(6),
        _chat_item(7),
    ]
    items[2]["conversations"] += [{"from": "human", "value": " more?"}, {"from": "gpt", "value": "no "}]
    items[2]["conversations"][0]["value"] = "Look: <image> what is it?"
    items[6]["conversations"] += [{"from": "human", "value": "<image>\nand?"}, {"from": "gpt", "value": "no"}]
    items[7]["conversations"] += [{"from": "human", "value": "and?"}]
    (root / "chat.json").write_text(json.dumps(items, indent=2))
    out = tmp_path / "c"
    result = cosmos_latents.run(
        make_cfg(
            out,
            "source.type=llava",
            f"source.path={root}/chat.json",
            f"source.image_root={root}/images",
            "num_workers=1",
        )
    )
    samples = read_cache_plain(out)
    assert list(samples) == [f"GCC_train_{i:09d}" for i in range(4)]
    s1 = samples["GCC_train_000000001"]
    assert s1["txt"] == b"a caption 1 ." and json.loads(s1["json"])["prompt"] == "What is in the photo?"
    assert (
        json.loads(samples["GCC_train_000000000"]["json"])["prompt"]
        == "Provide a brief description of the given image."
    )
    assert cf.TURNS not in json.loads(s1["json"])
    reader = cf.CacheReader(out)
    conv = reader.sample(reader.keys().index("GCC_train_000000002"), tensors=False)
    assert conv.turns == [("Look: what is it?", "a caption 2 ."), ("more?", "no")]
    assert reader.sample(reader.keys().index("GCC_train_000000001"), tensors=False).turns == [
        ("What is in the photo?", "a caption 1 .")
    ]
    reasons = {e["key"]: e["reason"] for e in cf.read_errors(out)}
    assert reasons == {
        "text-only": "bad item: no 'image' (a text-only item)",
        "GCC_train_000000006": "bad item: <image> outside the first human turn (a sample has one image, in its "
        "first turn)",
        "GCC_train_000000007": "bad item: conversation does not alternate human, gpt turns (starting with human, "
        "ending with gpt)",
        "GCC_train_000000005": reasons["GCC_train_000000005"],
    }
    assert reasons["GCC_train_000000005"].startswith("cannot read: FileNotFoundError")
    assert result["num_errors"] == 4
    # image_root defaults to the JSON's folder; a chat.json that changed is refused on resume
    (root / "images" / "chat.json").write_text(json.dumps([_chat_item(3)]))
    listing = _listing("llava", root / "images" / "chat.json", tmp_path / "l2")
    assert listing.load(listing.entries(0, 1)[0]).caption == "a caption 3 ."
    (root / "chat.json").write_text(json.dumps(items[:2]))
    with pytest.raises(UserError, match="chat.json changed since"):
        cosmos_latents.run(
            make_cfg(out, "source.type=llava", f"source.path={root}/chat.json", f"source.image_root={root}/images")
        )


def test_llava_cache_of_single_turn_items_is_not_resumed(tmp_path, fake_vae):
    """A llava cache started before conversations were kept (its precompute.json lacks the rule) is refused, not
    completed with samples built another way."""
    (tmp_path / "GCC_train_000000000.jpg").write_bytes(jpeg_bytes(gradient(30, 24)))
    (tmp_path / "chat.json").write_text(json.dumps([_chat_item(0)]))
    out = tmp_path / "c"
    args = (out, "source.type=llava", f"source.path={tmp_path}/chat.json", "num_workers=1")
    cosmos_latents.run(make_cfg(*args))
    run_file = json.loads((out / cf.RUN_FILE).read_text())
    del run_file["source"]["conversations"]
    (out / cf.RUN_FILE).write_text(json.dumps(run_file))
    with pytest.raises(UserError, match="source.conversations"):
        cosmos_latents.run(make_cfg(*args))


def _hf_parquet(path: Path, rows: list[dict], row_group_size: int) -> None:
    """A parquet file as HF `datasets` writes one with an Image feature: image is struct<bytes: binary, path:
    string>, and the features are recorded in the schema's b"huggingface" metadata."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    image_t = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    schema = pa.schema(
        [("image", image_t), ("text", pa.string())],
        metadata={
            b"huggingface": json.dumps(
                {"info": {"features": {"image": {"_type": "Image"}, "text": {"dtype": "string", "_type": "Value"}}}}
            ).encode()
        },
    )
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path, row_group_size=row_group_size)


def test_parquet_hf_datasets_image_struct(tmp_path, fake_vae, monkeypatch):
    from precompute.sources import parquet

    monkeypatch.setattr(parquet, "BATCH_ROWS", 2)  # rows stream in batches of 2 inside row groups of 3
    (tmp_path / "data").mkdir()
    rows = [
        {"image": {"bytes": jpeg_bytes(gradient(30 + i, 24)), "path": f"img{i}.jpg"}, "text": f"text {i}"}
        for i in range(7)
    ]
    rows[4]["image"] = {"bytes": None, "path": "http://x/4.jpg"}
    rows[5]["text"] = "  "
    _hf_parquet(tmp_path / "data" / "train-00000-of-00002.parquet", rows[:5], 3)
    _hf_parquet(tmp_path / "data" / "train-00001-of-00002.parquet", rows[5:], 3)
    out = tmp_path / "c"
    result = cosmos_latents.run(
        make_cfg(out, "source.type=parquet", f"source.path={tmp_path}/data", "num_workers=1", shard=3)
    )  # a worker process: the listing crosses a process boundary
    samples = read_cache_plain(out)
    stem = "train-00000-of-00002"
    assert list(samples) == [f"{stem}-{i:09d}" for i in range(4)] + ["train-00001-of-00002-000000001"]
    assert [m["txt"] for m in samples.values()] == [b"text 0", b"text 1", b"text 2", b"text 3", b"text 6"]
    assert json.loads(samples[f"{stem}-000000002"]["json"])["prompt"] == "Describe the image."
    reasons = {e["source"]: e["reason"] for e in cf.read_errors(out)}
    assert reasons == {
        f"{stem}.parquet:4": "no image bytes (path 'http://x/4.jpg'; nothing is downloaded)",
        "train-00001-of-00002.parquet:0": "empty caption",
    }
    assert result["num_errors"] == 2
    # the listing is kept: a rerun reads no key column again and gives the same shards
    index = (out / "source-index" / "parquet.json").stat().st_mtime_ns
    again = cosmos_latents.run(make_cfg(out, "source.type=parquet", f"source.path={tmp_path}/data", shard=3))
    assert (out / "source-index" / "parquet.json").stat().st_mtime_ns == index
    assert [s["sha256"] for s in again["shards"]] == [s["sha256"] for s in result["shards"]]


def test_parquet_file_changed_since_the_cache_was_started_is_refused(tmp_path, fake_vae, capsys):
    """As a changed folder is: a file whose size or modification time differs, or one added or removed, is named;
    the shards already written stay."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "data").mkdir()
    rows = lambda lo, hi: pa.table(
        {
            "image": pa.array([jpeg_bytes(gradient(20 + i, 20)) for i in range(lo, hi)]),
            "caption": [f"c {i}" for i in range(lo, hi)],
        }
    )
    pq.write_table(rows(0, 4), tmp_path / "data" / "a.parquet")
    pq.write_table(rows(4, 6), tmp_path / "data" / "b.parquet")
    out = tmp_path / "c"
    args = cli_args(out, "source.type=parquet", f"source.path={tmp_path}/data", shard=2)
    assert cosmos_latents.main(args) == 0
    written = {p.name: p.read_bytes() for p in (out / "shards").iterdir()}
    cf.tar_path(out, 1).unlink()  # interrupted: shard 1 is to be redone
    capsys.readouterr()
    pq.write_table(rows(10, 14), tmp_path / "data" / "a.parquet")  # same row count, other rows
    os.utime(tmp_path / "data" / "a.parquet", ns=(1, 1))
    assert cosmos_latents.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "a.parquet changed" in err and "another output_dir" in err
    assert not cf.tar_path(out, 1).exists()
    assert all((out / "shards" / n).read_bytes() == b for n, b in written.items() if n != cf.tar_path(out, 1).name)
    pq.write_table(rows(0, 4), tmp_path / "data" / "a.parquet")
    (tmp_path / "data" / "b.parquet").unlink()
    assert cosmos_latents.main(args) == 2
    assert "b.parquet was removed" in capsys.readouterr().err


def test_parquet_datacomp(tmp_path, fake_vae, capsys):
    """DataComp: the metadata parquet (uid, url, text, ...) carries no images and is refused with one line; the
    img2dataset parquet of it (key, uid, url, caption, status, jpg) is read with source.image_column=jpg."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    meta = {
        "uid": [f"{i:032x}" for i in range(3)],
        "url": [f"http://x/{i}" for i in range(3)],
        "text": ["a", "b", "c"],
        "original_width": [640] * 3,
        "original_height": [480] * 3,
        "clip_b32_similarity_score": [0.3] * 3,
        "face_bboxes": [[[0.1, 0.1, 0.2, 0.2]], [], []],
        "sha256": ["0" * 64] * 3,
    }
    pq.write_table(pa.table(meta), tmp_path / "metadata.parquet")
    assert (
        cosmos_latents.main(cli_args(tmp_path / "m", "source.type=parquet", f"source.path={tmp_path}/metadata.parquet"))
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "source.image_column" in err and "uid, url, text" in err
    (tmp_path / "dl").mkdir()
    table = pa.table(
        {
            "key": [f"{i:09d}" for i in range(4)],
            "uid": [f"{i:032x}" for i in range(4)],
            "url": [f"http://x/{i}" for i in range(4)],
            "caption": ["a", "b", "c", "d"],
            "status": ["success", "success", "failed_to_download", "success"],
            "error_message": [None, None, "timeout", None],
            "jpg": pa.array(
                [jpeg_bytes(gradient(30, 24)), jpeg_bytes(gradient(31, 24)), None, jpeg_bytes(gradient(32, 24))],
                pa.binary(),
            ),
        }
    )
    pq.write_table(table, tmp_path / "dl" / "00000.parquet")
    out = tmp_path / "c"
    cosmos_latents.run(
        make_cfg(out, "source.type=parquet", f"source.path={tmp_path}/dl/*.parquet", "source.image_column=jpg")
    )
    samples = read_cache_plain(out)
    assert list(samples) == ["000000000", "000000001", "000000003"]
    assert json.loads(samples["000000003"]["json"])["url"] == "http://x/3"
    assert json.loads(samples["000000003"]["json"])["uid"] == f"{3:032x}" and samples["000000003"]["txt"] == b"d"
    assert [e["reason"] for e in cf.read_errors(out)] == ["no image bytes"]


def test_parquet_columns_and_prompt_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    img = jpeg_bytes(gradient(20, 20))
    pq.write_table(
        pa.table(
            {
                "id": [7, 8, 7],
                "image": pa.array([img] * 3, pa.binary()),
                "caption": ["x", "y", "z"],
                "question": ["Q?", None, "R?"],
            }
        ),
        tmp_path / "a.parquet",
    )
    listing = sources.open_listing(
        "parquet",
        str(tmp_path / "a.parquet"),
        None,
        0,
        "Default?",
        index_dir=tmp_path / "idx",
        columns={"image": None, "caption": None, "prompt": "question"},
    )
    entries = listing.entries(0, 3)
    assert [(e.key, e.error) for e in entries] == [
        ("7", None),
        ("8", None),
        ("7", "duplicate key: '7' (first used by a.parquet:0)"),
    ]
    assert [listing.load(e).prompt for e in entries[:2]] == ["Q?", "Default?"]
    with pytest.raises(UserError, match="source.caption_column.*no column 'nope'"):
        sources.open_listing(
            "parquet",
            str(tmp_path / "a.parquet"),
            None,
            0,
            "p",
            index_dir=tmp_path / "i2",
            columns={"image": None, "caption": "nope", "prompt": None},
        )


def test_num_samples_keeps_the_first_n_usable_entries_of_any_source(tmp_path):
    src = tmp_path / "src"
    _txt_folder(src, 5)
    lines = [
        "{bad",
        json.dumps({"image": "img000.png", "caption": "a"}),
        json.dumps({"image": "x.png"}),
        json.dumps({"image": "img001.png", "caption": "b"}),
        json.dumps({"image": "img002.png", "caption": "c"}),
    ]
    (src / "captions.jsonl").write_text("\n".join(lines))
    listing = sources.open_listing("folder", str(src), 2, 0, "p", index_dir=tmp_path / "i")
    assert [(e.key, e.error is None) for e in listing.entries(0, 10)] == [
        ("line-1", False),
        ("img000_png", True),
        ("line-3", False),
        ("img001_png", True),
    ]
    from _precompute_helpers import wds_source

    wds_source(tmp_path / "w", tars=3, per_tar=2, no_caption=(0, 1))
    listing = sources.open_listing("webdataset", str(tmp_path / "w"), 3, 0, "p", index_dir=tmp_path / "j")
    assert [e.key for e in listing.entries(0, 10)] == ["000000000", "000000001", "000010000", "000010001"]
    assert len(sources.open_listing("webdataset", str(tmp_path / "w"), 100, 0, "p", index_dir=tmp_path / "j")) == 6


def test_num_samples_counts_what_loads_in_every_source(tmp_path, fake_vae, monkeypatch):
    """Rows without image bytes, missing or empty captions, control strings, zero-byte or non-image files are not
    counted: N usable entries give N samples (pixel decoding aside); the cut is recorded and reused."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    img = jpeg_bytes(gradient(20, 20))
    images = [None, img, b"", img, b"not an image", img, img, img]
    captions = ["a", "b", "c", " ", "e", "f <end_of_turn>", "g", "h"]
    pq.write_table(pa.table({"image": pa.array(images, pa.binary()), "caption": captions}), tmp_path / "p.parquet")
    out = tmp_path / "c"
    result = cosmos_latents.run(make_cfg(out, "source.type=parquet", f"source.path={tmp_path}/p.parquet", n=2))
    assert result["num_samples"] == 2 and result["num_errors"] == 5  # rows 1 and 6 kept; 0, 2-5 recorded
    assert list(read_cache_plain(out)) == ["p-000000001", "p-000000006"]
    # a folder: an image without its .txt, a blank caption, a zero-byte image
    src = tmp_path / "src"
    _txt_folder(src, 6)
    (src / "img000.txt").unlink()
    (src / "img001.txt").write_text("  ")
    (src / "img002.png").write_bytes(b"")
    listing = sources.open_listing("folder", str(src), 2, 0, "p", index_dir=tmp_path / "i")
    assert len(listing) == 5  # img003 and img004
    loads = []
    monkeypatch.setattr(sources.Listing, "usable", lambda self, e: loads.append(e) or True)
    again = sources.open_listing("folder", str(src), 2, 0, "p", index_dir=tmp_path / "i")
    assert len(again) == 5 and loads == []  # the recorded cut


def test_a_caption_or_prompt_over_the_length_limit_is_an_error_entry(tmp_path):
    src = tmp_path / "src"
    _txt_folder(src, 3)
    (src / "img001.txt").write_text("word " * content.MAX_TEXT_CHARS)
    lines = [
        json.dumps({"image": "img000.png", "caption": "fine", "prompt": "x" * (content.MAX_TEXT_CHARS + 1)}),
        json.dumps({"image": "img002.png", "caption": "y" * content.MAX_TEXT_CHARS}),
    ]
    got = _outcomes(_listing("folder", src, tmp_path))
    assert got["img001_png"].startswith("error: caption too long: ")
    (src / "captions.jsonl").write_text("\n".join(lines))
    got = _outcomes(_listing("folder", src, tmp_path / "j"))
    assert got["img000_png"].startswith("error: prompt too long") and got["img002_png"] == "y" * content.MAX_TEXT_CHARS


def test_llava_and_parquet_listings_split_across_ranks(tmp_path):
    """Two ranks (threads meeting at a barrier): rank 0 writes the listing once, both read the same order."""
    import threading

    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "chat.json").write_text(json.dumps([_chat_item(i) for i in range(5)] + [_chat_item(2)]))
    img = jpeg_bytes(gradient(20, 20))
    pq.write_table(
        pa.table(
            {"uid": ["a", "b", "a", "c"], "image": pa.array([img] * 4, pa.binary()), "text": ["1", "2", "3", "4"]}
        ),
        tmp_path / "p.parquet",
        row_group_size=2,
    )
    for kind, path in (("llava", tmp_path / "chat.json"), ("parquet", tmp_path / "p.parquet")):
        reference = sources.list_entries(kind, str(path), None, 0, "p")
        listings, barrier, writes = {}, threading.Barrier(2), []
        real = cf.atomic_write_bytes  # every listing file goes through it (atomic_write_json included)
        recording = lambda p, data: (writes.append((threading.current_thread().name, p.name)), real(p, data))[1]
        cf.atomic_write_bytes = cf.layout.atomic_write_bytes = recording
        try:

            def rank(r: int) -> None:
                listings[r] = sources.open_listing(
                    kind,
                    str(path),
                    None,
                    0,
                    "p",
                    index_dir=tmp_path / f"idx-{kind}",
                    rank=r,
                    world=2,
                    barrier=barrier.wait,
                )

            threads = [threading.Thread(target=rank, args=(r,), name=f"rank{r}") for r in (0, 1)]
            [t.start() for t in threads], [t.join() for t in threads]
        finally:
            cf.atomic_write_bytes = cf.layout.atomic_write_bytes = real
        assert writes and all(name == "rank0" for name, _ in writes)
        assert sum(e.error is not None for e in reference) == 1
        for listing in listings.values():
            assert [(e.key, e.source, e.error) for e in listing.entries(0, 10)] == [
                (e.key, e.source, e.error) for e in reference
            ]


def test_a_file_that_is_not_parquet_is_refused_naming_it(tmp_path, fake_vae, capsys):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.parquet").write_bytes(b"PAR1 not really")
    assert cosmos_latents.main(cli_args(tmp_path / "c", "source.type=parquet", f"source.path={tmp_path}/d")) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"{tmp_path}/d/a.parquet is not a readable parquet file" in err


def test_an_unreadable_file_is_recorded_and_the_rest_encoded(tmp_path, fake_vae, monkeypatch):
    """Tests run as root, where chmod 000 does not stop a read: the file's open fails as it would for a user."""
    src = tmp_path / "src"
    _txt_folder(src, 3)
    locked = str(src / "img001.png")

    def fake_open(path, *a, **k):
        if str(path) == locked:
            raise PermissionError(errno.EACCES, "Permission denied", locked)
        return open(path, *a, **k)

    monkeypatch.setattr(content, "open", fake_open, raising=False)
    out = tmp_path / "c"
    cosmos_latents.run(make_cfg(out, "source.type=folder", f"source.path={src}"))
    assert list(read_cache_plain(out)) == ["img000_png", "img002_png"]
    assert [(e["key"], e["reason"]) for e in cf.read_errors(out)] == [
        ("img001_png", f"cannot read: PermissionError: [Errno 13] Permission denied: '{locked}'")
    ]


def test_a_source_path_of_the_wrong_kind_is_named(tmp_path, capsys):
    (tmp_path / "f.txt").write_text("x")
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    for kind, path, words in [
        ("folder", tmp_path / "f.txt", "is a file, not a folder"),
        ("llava", tmp_path, "is a folder, not a file"),
        ("folder", tmp_path / "loop1", f"folder not found: {tmp_path / 'loop1'} (a symlink loop)"),
        ("folder", tmp_path / ("x" * 5000), "(File name too long)"),
    ]:
        assert cosmos_latents.main(cli_args(tmp_path / "c", f"source.type={kind}", f"source.path={path}")) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and words in err, err
