"""precompute/sources/folder.py: a folder of images with captions.jsonl or same-stem .txt files (bad directory entries,
FIFOs, paths that leave the folder, a folder changed between runs, img2dataset's files layout). Moved from
tests/test_sources.py."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket

import pytest

from precompute import cosmos_latents, pipeline
from tests._precompute_helpers import cli_args, gradient, jpeg_bytes, make_cfg, png_bytes, read_cache_plain
from tests._source_helpers import listing_of, outcomes, txt_folder
from theworld import cache_format as cf


@pytest.fixture
def no_hang():
    """Fail (instead of hanging the suite) if the code under test blocks, e.g. by opening a FIFO."""
    signal.signal(signal.SIGALRM, lambda *a: pytest.fail("timed out: something blocked"))
    signal.alarm(60)
    yield
    signal.alarm(0)


def test_folder_walk_records_each_bad_entry_and_lists_the_rest(tmp_path, fake_vae, monkeypatch, no_hang):
    src = tmp_path / "src"
    txt_folder(src, 40)
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
    result = pipeline.run(make_cfg(out, "source.type=folder", f"source.path={src}", n=100))
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
    assert outcomes(listing_of("folder", src, tmp_path)) == {
        "pipe_jpg": "error: not a regular file (a FIFO)",
        "ok_png": "c",
    }


def test_resuming_after_the_folder_changed_is_refused_naming_the_change(tmp_path, fake_vae, capsys):
    src, out = tmp_path / "src", tmp_path / "c"
    txt_folder(src, 6)
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
    txt_folder(src2, 2)
    (src2 / "captions.jsonl").write_text(json.dumps({"image": "img000.png", "caption": "a"}) + "\n")
    args2 = cli_args(out2, "source.type=folder", f"source.path={src2}")
    assert cosmos_latents.main(args2) == 0
    (src2 / "captions.jsonl").write_text(json.dumps({"image": "img001.png", "caption": "b"}) + "\n")
    capsys.readouterr()
    assert cosmos_latents.main(args2) == 2
    assert "captions.jsonl changed since the cache" in capsys.readouterr().err


def test_captions_jsonl_paths_that_leave_the_folder_are_refused(tmp_path):
    outside = tmp_path / "outside.png"
    outside.write_bytes(png_bytes(gradient(20, 20)))
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "in.png").write_bytes(outside.read_bytes())
    rels = ["../outside.png", str(outside), "sub/../../outside.png", "sub/../sub/in.png", "sub/in.png"]
    (src / "captions.jsonl").write_text("".join(json.dumps({"image": r, "caption": "c"}) + "\n" for r in rels))
    listing = listing_of("folder", src, tmp_path)
    errors = [e.error for e in listing.entries(0, len(listing))]
    assert errors[:4] == [f"bad caption line: 'image' leaves the source folder: {r!r}" for r in rels[:4]]
    assert errors[4] is None


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
    pipeline.run(make_cfg(out, "source.type=folder", f"source.path={src}"))
    samples = read_cache_plain(out)
    assert list(samples) == [f"00000_{i:09d}_jpg" for i in range(3)]
    meta = json.loads(samples["00000_000000002_jpg"]["json"])
    assert (meta["url"], meta["uid"], meta["key"]) == ("http://img/2.jpg", f"{2:032x}", "000000002")
    assert samples["00000_000000002_jpg"]["txt"] == b"photo 2"
