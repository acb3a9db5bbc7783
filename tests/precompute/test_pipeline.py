"""precompute.pipeline (the run behind python -m precompute.cosmos_latents): contents, sources, bad input, crash
safety, process-count independence."""

from __future__ import annotations

import errno
import json
import math
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load as st_load

from precompute import cosmos_latents, pipeline
from tests._precompute_helpers import (
    BUCKET_SIZES,
    bucket_folder,
    cli_args,
    gradient,
    image_zoo,
    jpeg_bytes,
    latents,
    make_cfg,
    read_cache_plain,
    single_threaded_run,
)
from tests.conftest import fork_command, free_port, run2
from theworld import cache_format as cf
from theworld.core import atomic
from theworld.core.errors import UserError
from theworld.embedded import synthetic
from theworld.model import images

ROOT = Path(__file__).resolve().parents[2]


def test_synthetic_cache_contents_and_idempotent_rerun(tmp_path, fake_vae):
    out = tmp_path / "c"
    result = pipeline.run(make_cfg(out, n=20, shard=8))
    assert result["num_samples"] == 20 and result["num_errors"] == 0 and result["num_shards"] == 3
    assert cf.shard_table(out, result).count.tolist() == [8, 8, 4]
    assert result["latent_shape"] == [16, 1, 4, 4] and result["summary"]["encoded_this_run"] == 20
    samples = read_cache_plain(out)
    assert list(samples) == [f"synthetic-0-{i:08d}" for i in range(20)]  # fixed order, stable keys
    m = samples["synthetic-0-00000007"]
    assert set(m) == {"latent.safetensors", "txt", "json", "image"}
    img, caption = synthetic.scene(0, 7, size=32)
    assert m["txt"].decode() == caption
    meta = json.loads(m["json"])
    assert meta["prompt"] == synthetic.PROMPT and meta["source"] == "synthetic:7" and meta["flip"] is False
    t = st_load(m["latent.safetensors"])
    pixels, _ = images.load_for_vae(m["image"], 32)
    want = fake_vae.encode((pixels.float() / 127.5 - 1)[None, :, None]).latent_dist
    torch.testing.assert_close(t["mean"], want.mean[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(t["logvar"], want.logvar[0], rtol=0, atol=1e-6)
    again = pipeline.run(make_cfg(out, n=20, shard=8))  # everything done: nothing re-encoded, same bytes
    assert again["summary"]["encoded_this_run"] == 0 and again["shard_index"] == result["shard_index"]


def test_optional_members_flip_no_images_bf16(tmp_path, fake_vae):
    out = tmp_path / "c"
    result = pipeline.run(make_cfg(out, "cache.flip=true", "cache.images=false", "cache.dtype=bfloat16", n=4))
    assert result["contents"] == {"images": False, "siglip": False, "flip": True}
    assert result["latent_dtype"] == "bfloat16"
    for key, m in read_cache_plain(out).items():
        assert set(m) == {"latent.safetensors", "latent_flip.safetensors", "txt", "json"}
        i = int(key.rsplit("-", 1)[1])
        pixels = images.to_uint8_tensor(synthetic.scene(0, i, size=32)[0]).flip(-1)
        want = fake_vae.encode((pixels.float() / 127.5 - 1)[None, :, None]).latent_dist.mean[0]
        got = st_load(m["latent_flip.safetensors"])["mean"]
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.to(torch.bfloat16).float(), rtol=0, atol=0)


def test_siglip_features_match_gemma(tmp_path, fake_vae):
    from theworld.model import encoders

    out = tmp_path / "c"
    result = pipeline.run(make_cfg(out, "cache.siglip=true", n=3))
    assert result["contents"]["siglip"] and result["fingerprint"]["siglip"]["model"] == "tiny"
    gemma, processor = encoders.load_gemma("tiny", "float32")
    for m in read_cache_plain(out).values():
        feats = st_load(m["siglip.safetensors"])["features"]
        pv = processor.image_processor(images=[images.decode(m["image"])], return_tensors="pt")["pixel_values"]
        with torch.no_grad():
            want = gemma.model.get_image_features(pixel_values=pv).pooler_output[0]
        assert feats.shape == (gemma.config.mm_tokens_per_image, gemma.config.text_config.hidden_size)
        assert feats.abs().max() > 0
        torch.testing.assert_close(feats, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("compile", [False, True])
def test_cached_latents_equal_direct_wan_encode(tmp_path, compile):
    """The real (tiny) AutoencoderKLWan, float32: cache == AutoencoderKLWan.encode of the same image in [-1, 1],
    also through the compiled encoder, whose last batch (2 of 4) is padded to the compiled shape."""
    from diffusers import AutoencoderKLWan

    from theworld.embedded import tiny

    out = tmp_path / "c"
    result = pipeline.run(make_cfg(out, f"compile={str(compile).lower()}", n=6, shard=6, res=32))
    assert result["num_samples"] == 6 and (result["summary"]["compile_seconds"] > 0) == compile
    vae = AutoencoderKLWan.from_pretrained(tiny.ensure(tiny.TINY_VAE_DIR), torch_dtype=torch.float32).eval()
    samples = read_cache_plain(out)
    pixels = torch.stack([images.load_for_vae(m["image"], 32)[0] for m in samples.values()])
    with torch.no_grad():
        dist = vae.encode((pixels.float() / 127.5 - 1.0).unsqueeze(2)).latent_dist
    for j, m in enumerate(samples.values()):
        t = st_load(m["latent.safetensors"])
        torch.testing.assert_close(t["mean"], dist.mean[j], rtol=0, atol=1e-4 if compile else 1e-5)
        torch.testing.assert_close(t["logvar"], dist.logvar[j], rtol=0, atol=1e-4 if compile else 1e-5)


def test_folder_with_corrupt_and_unusual_images(tmp_path, fake_vae):
    src = tmp_path / "src"
    records, bad = image_zoo(src)
    out = tmp_path / "c"
    result = pipeline.run(make_cfg(out, "source.type=folder", f"source.path={src}", "num_workers=1", shard=5))
    good = [cf.safe_key(r["image"]) for r in records if cf.safe_key(r["image"]) not in bad]
    samples = read_cache_plain(out)
    assert list(samples) == good  # captions.jsonl order, bad ones skipped
    assert set(good) == {
        "cmyk_jpg",
        "gray_png",
        "gray16_png",
        "palette_png",
        "rgb_jpg",
        "rgba_png",
        "rotated_jpg",
        "sub_pic_bmp",
    }
    errors = cf.read_errors(out)
    assert result["num_errors"] == len(errors) == len(bad)
    by_key = {}
    for e in errors:
        by_key.setdefault(e["key"], []).append(e)
    for key, word in bad.items():
        key = key.split("#")[0]
        assert any(word in e["reason"] for e in by_key[key]), (key, by_key.get(key))
    line_keys = sorted(k for k in bad if k.startswith("line-"))  # bad lines: keyed and sourced by line number
    assert [by_key[k][0]["source"] for k in line_keys] == [f"captions.jsonl:{k[5:]}" for k in line_keys]
    rot = json.loads(samples["rotated_jpg"]["json"])
    assert rot["original_size"] == [40, 48]  # EXIF orientation applied
    g16 = images.load_for_vae(samples["gray16_png"]["image"], 32)[0]
    assert g16.float().std() > 20  # 16-bit scaled, not clipped to white
    assert cf.image_bytes_hint(samples["sub_pic_bmp"]["image"]) == "png"  # bmp kept as PNG
    assert json.loads(samples["cmyk_jpg"]["json"])["prompt"] == "what is this ?"
    assert json.loads(samples["rgb_jpg"]["json"])["prompt"] == "Describe the image."
    assert samples["rgb_jpg"]["txt"] == b"caption of rgb.jpg"


def test_folder_with_txt_captions(tmp_path, fake_vae):
    from tests._precompute_helpers import png_bytes

    src = tmp_path / "src"
    src.mkdir()
    for name in ("b", "a", "c"):
        (src / f"{name}.png").write_bytes(png_bytes(gradient(40, 40)))
    (src / "a.txt").write_text("first\n")
    (src / "b.txt").write_text("second")
    result = pipeline.run(make_cfg(tmp_path / "c", "source.type=folder", f"source.path={src}"))
    samples = read_cache_plain(tmp_path / "c")
    assert list(samples) == ["a_png", "b_png"] and samples["a_png"]["txt"] == b"first"
    assert result["num_errors"] == 1 and "missing caption" in cf.read_errors(tmp_path / "c")[0]["reason"]


def test_folder_walk_lists_what_rglob_lists(tmp_path):
    """image_paths replaced Path.rglob + is_file (a stat per image); the stat calls saved are measured with strace
    in docs/precompute.md, the listing must be the same."""
    from precompute.sources.folder import IMAGE_SUFFIXES, image_paths

    root = tmp_path / "src"
    for rel in [
        "a.jpg",
        "b.JPEG",
        "c.txt",
        ".hidden.png",
        ".jpg",
        "noext",
        "x.tar.webp",
        "d/e.png",
        "d/f/g.tiff",
        "d/f/h.gif.txt",
        ".dot/i.bmp",
        "sp ace/j k.jpg",
        "caf\u00e9/\u6771.png",
    ]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"x")
    (root / "dir.jpg").mkdir()  # a folder named like an image
    (root / "link.jpg").symlink_to(root / "a.jpg")  # a symlinked file counts
    (root / "dead.png").symlink_to(root / "gone.png")  # a dangling one does not
    (root / "linked-dir").symlink_to(root / "d")  # a symlinked folder is not entered
    bad = os.fsencode(root) + b"/bad-\xff.jpg"  # a name that is not UTF-8
    open(bad, "wb").close()
    reference = sorted(
        p.relative_to(root).as_posix().encode(errors="surrogateescape")
        for p in root.rglob("*")
        if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file()
    )
    assert image_paths(root) == reference
    assert b"bad-\xff.jpg" in reference and b"link.jpg" in reference and b"linked-dir/e.png" not in reference
    assert len(reference) == 11  # every image above, the symlinked file included


def test_a_source_with_no_usable_sample_is_an_error_that_keeps_its_reasons(tmp_path, capsys, fake_vae):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.png").write_bytes(b"not a png")
    (src / "a.txt").write_text("caption")
    (src / "b.png").write_bytes(b"")
    (src / "b.txt").write_text("caption")
    assert cosmos_latents.main(cli_args(tmp_path / "c", "source.type=folder", f"source.path={src}")) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert "no usable sample" in err[-1] and "all 2 inputs failed" in err[-1]
    assert "all 2 inputs failed (1 unreadable image, 1 empty file; each in " in err[-1]
    assert [e["key"] for e in cf.read_errors(tmp_path / "c")] == ["a_png", "b_png"]
    # nothing that looks like a finished cache: no manifest, no "0.0 MB in 1 shards" summary
    assert not (tmp_path / "c" / cf.MANIFEST).exists() and "MB in" not in captured.out
    with pytest.raises(UserError, match="holds no samples, so it is not a cache"):
        cf.load_manifest(tmp_path / "c")


def test_webdataset_source(tmp_path, fake_vae):
    import webdataset as wds

    src = tmp_path / "wds"
    src.mkdir()
    for s in range(2):
        with wds.TarWriter(str(src / f"{s:05d}.tar")) as w:
            for i in range(3):
                key = f"{s:05d}{i:04d}"
                sample = {
                    "__key__": key,
                    "jpg": jpeg_bytes(gradient(40 + i, 36)),
                    "json": json.dumps({"url": f"http://x/{key}", "key": key}).encode(),
                }
                if (s, i) != (1, 1):
                    sample["txt"] = f"text {key}".encode()
                w.write(sample)
    result = pipeline.run(
        make_cfg(tmp_path / "c", "source.type=webdataset", f"source.path={src}/{{00000..00001}}.tar", shard=4)
    )
    samples = read_cache_plain(tmp_path / "c")
    assert list(samples) == ["000000000", "000000001", "000000002", "000010000", "000010002"]
    assert (
        samples["000010002"]["txt"] == b"text 000010002" and cf.image_bytes_hint(samples["000010002"]["image"]) == "jpg"
    )
    assert json.loads(samples["000000001"]["json"])["url"] == "http://x/000000001"
    assert result["num_errors"] == 1 and cf.read_errors(tmp_path / "c")[0]["key"] == "000010001"
    # a tar cut short in the middle of its last sample's caption: that sample is dropped, not kept with half a caption
    with wds.TarWriter(str(src / "00002.tar")) as w:
        for i in range(2):
            w.write({"__key__": f"0000200{i:02d}", "jpg": jpeg_bytes(gradient(40, 36)), "txt": b"x" * 3000})
    data = (src / "00002.tar").read_bytes()
    cut = data.rindex(b"x" * 3000) + 1500
    (src / "00002.tar").write_bytes(data[:cut])
    pipeline.run(make_cfg(tmp_path / "d", "source.type=webdataset", f"source.path={src}/{{00000..00002}}.tar", shard=4))
    assert "000020000" in read_cache_plain(tmp_path / "d") and "000020001" not in read_cache_plain(tmp_path / "d")
    assert any(e["reason"].startswith("broken tar: truncated") for e in cf.read_errors(tmp_path / "d"))


def test_a_cache_is_a_webdataset_source(tmp_path, fake_vae):
    """A cache's shards feed another precompute run (another resolution, say): its `image` member is the image."""
    pipeline.run(make_cfg(tmp_path / "a", n=6, shard=3, res=32))
    pipeline.run(make_cfg(tmp_path / "b", "source.type=webdataset", f"source.path={tmp_path}/a/shards/*.tar", res=48))
    a, b = read_cache_plain(tmp_path / "a"), read_cache_plain(tmp_path / "b")
    assert list(b) == list(a) and [s["image"] for s in b.values()] == [s["image"] for s in a.values()]
    assert [s["txt"] for s in b.values()] == [s["txt"] for s in a.values()]
    assert cf.load_manifest(tmp_path / "b")["latent_shape"] == [16, 1, 6, 6]


def test_time_breakdown_names_a_slow_writer(tmp_path, fake_vae, monkeypatch):
    """The summary says where the main loop waited: a writer that takes 0.3 s a shard (a slow disk) shows up as the
    writer's time, not as encoding or decoding."""
    from precompute import shard_writer

    write = shard_writer.ShardWriter.write
    monkeypatch.setattr(shard_writer.ShardWriter, "write", lambda self, *job: (time.sleep(0.3), write(self, *job))[1])
    summary = pipeline.run(make_cfg(tmp_path / "c", n=12, shard=2))["summary"]
    sec = summary["seconds_rank0"]
    assert set(sec) == {"wait_for_batches", "encode", "wait_for_writer", "writer_thread_busy"}
    assert sec["writer_thread_busy"] >= 6 * 0.3
    # the writer's queue holds two shards, so at least the last one is waited for (lower bounds only: on a shared
    # machine any measured duration can be longer, never shorter than a sleep)
    assert sec["wait_for_writer"] >= 0.3
    assert sum(v for k, v in sec.items() if k != "writer_thread_busy") <= summary["encode_seconds"] + 0.05


def _env(**extra) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), **extra}
    return env


@pytest.mark.slow
def test_kill_9_and_rerun(tmp_path, capsys):
    out = tmp_path / "c"
    args = cli_args(out, n=40, shard=4, res=32)
    # 0.4 s a shard, in a process of its own forked with its imports done: the kill is the point, not the interpreter
    proc = fork_command("tests._slow_writer", ["0.4", *args], logs=tmp_path / "forked")
    deadline = time.time() + 90
    writing = []  # a shard's tar written under its temporary name, not yet renamed: the kill lands mid-write
    while not writing and time.time() < deadline and proc.poll() is None:
        if len(list((out / "shards").glob("shard-*.json"))) >= 3:
            writing = list((out / "shards").glob(".tmp-shard-*.tar-*"))
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert writing, "the run ended before a kill could land inside a shard's write"
    done = len(list((out / "shards").glob("shard-*.json")))
    assert 3 <= done < 10 and not (out / "manifest.json").exists()
    assert cosmos_latents.main(args) == 0  # the rerun in process
    rerun = capsys.readouterr().out
    assert "40 samples, 0 errors" in rerun and f"encoded {40 - 4 * done} images" in rerun
    keys = list(read_cache_plain(out))
    assert keys == [f"synthetic-0-{i:08d}" for i in range(40)]
    assert not list((out / "shards").glob(".*tmp*"))  # the killed write's temporary tar is gone
    from precompute import inspect

    assert inspect.main(["verify", str(out)]) == 0


def _launch_two_processes(args: list[str]) -> subprocess.CompletedProcess:
    """Two real CPU processes (gloo) with the environment `accelerate launch --multi_gpu --num_processes 2` gives
    them, forked with their imports done (conftest.run2): the launcher is not what these tests check."""
    res = run2(args, module="precompute.cosmos_latents")
    assert res.returncode == 0, res.stderr[-3000:]
    return res


@pytest.mark.slow
def test_two_processes_give_the_same_cache(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    m1 = single_threaded_run(make_cfg(one, n=18, shard=4, res=32))
    res = _launch_two_processes(cli_args(two, n=18, shard=4, res=32))
    assert "encoded 18 images" in res.stdout and "on 2 process(es)" in res.stdout
    m2 = json.loads((two / "manifest.json").read_text())
    assert m2["num_samples"] == 18
    assert m2["shard_index"] == m1["shard_index"]  # byte-identical shards
    l1, l2 = latents(one), latents(two)
    assert list(l1) == list(l2) and all(torch.equal(l1[k], l2[k]) for k in l1)


@pytest.mark.slow
def test_a_second_run_into_a_busy_output_dir_is_refused_by_every_process(tmp_path):
    """Each of two processes (gloo, the environment a two-process launch gives them), forked with their imports done
    (tools/ranks.py: the launcher is not what this checks), exits by itself with the one line: none waits at a
    barrier for a peer that has stopped."""
    from theworld.core import run_lock
    from tools import ranks

    out = tmp_path / "c"
    fd = run_lock.acquire(out)  # this process stands for a run writing shards
    try:
        logs, port = tmp_path / "logs", free_port()
        logs.mkdir()
        env = _env(ACCELERATE_USE_CPU="true")
        procs = [
            ranks.start(
                "precompute.cosmos_latents",
                cli_args(out, n=8, shard=4),
                {**env, **ranks.launcher_env(rank, port)},
                ROOT,
                str(logs / f"{rank}.out"),
                str(logs / f"{rank}.err"),
            )
            for rank in range(ranks.RANKS)
        ]
        for proc in procs:
            proc.join(120)
        codes = [proc.exitcode for proc in procs]
        for proc in procs:
            if proc.exitcode is None:
                proc.kill()
                proc.join()
        per_rank = {rank: (logs / f"{rank}.err").read_text() for rank in range(ranks.RANKS)}
        assert all(code not in (None, 0) for code in codes), (codes, per_rank)
        for rank, err in per_rank.items():  # every process stops with the same one line, none waits at a barrier
            refusals = [line for line in err.splitlines() if line.startswith("error: ")]
            assert len(refusals) == 1 and "in use by another run" in refusals[0], (rank, err[-2000:])
            assert f"pid {os.getpid()} " in refusals[0]
            assert str(ROOT / "theworld") not in err and str(ROOT / "precompute") not in err
        assert [p.name for p in out.iterdir()] == [".run.lock"]  # nothing listed, claimed or written
    finally:
        os.close(fd)


def _spy_listing(monkeypatch) -> tuple[list, list]:
    """Record every tar header scan and every range of Entry objects built through Listing.entries."""
    from precompute import sources
    from precompute.sources import webdataset

    scans, ranges = [], []
    scan, entries = webdataset._tar_samples, sources.Listing.entries
    monkeypatch.setattr(webdataset, "_tar_samples", lambda path: (scans.append(Path(path).name), scan(path))[1])
    monkeypatch.setattr(
        sources.Listing, "entries", lambda self, lo, hi: (ranges.append((lo, hi)), entries(self, lo, hi))[1]
    )
    return scans, ranges


def test_webdataset_listing_is_indexed_once_and_built_per_shard(tmp_path, fake_vae, monkeypatch):
    from tests._precompute_helpers import wds_source

    wds_source(tmp_path / "wds", tars=5, per_tar=3, dup=(3, 1), no_caption=(1, 2))
    scans, ranges = _spy_listing(monkeypatch)
    out = tmp_path / "c"
    cfg = lambda: make_cfg(out, "source.type=webdataset", f"source.path={tmp_path}/wds/{{00000..00004}}.tar", shard=4)
    first = pipeline.run(cfg())
    assert sorted(scans) == [f"{j:05d}.tar" for j in range(5)]  # each tar's headers read once
    assert sorted(ranges) == [(0, 4), (4, 8), (8, 12), (12, 16)]  # entries built shard by shard, never all at once
    assert first["num_samples"] == 13 and first["num_errors"] == 2
    reasons = {e["key"]: e["reason"] for e in cf.read_errors(out)}
    assert reasons["000010002"].startswith("missing caption")
    assert reasons["000000000"] == "duplicate key: '000000000' (first used by 00000.tar:000000000)"
    assert list(read_cache_plain(out))[:4] == ["000000000", "000000001", "000000002", "000010000"]
    index = {p.name: p.stat().st_mtime_ns for p in (out / "source-index").iterdir()}
    per_tar = sorted(f"tar-{j:06d}{x}" for j in range(5) for x in (".json", ".keys.json"))
    assert sorted(index) == ["listing.json"] + per_tar

    # Rerun after losing shard 2: no tar is read again, only shard 2's entries are built, same bytes.
    cf.tar_path(out, 2).unlink()
    scans.clear(), ranges.clear()
    again = pipeline.run(cfg())
    assert scans == [] and ranges == [(8, 12)] and again["summary"]["encoded_this_run"] == 3
    assert {p.name: p.stat().st_mtime_ns for p in (out / "source-index").iterdir()} == index
    assert again["shard_index"] == first["shard_index"]

    # A tar that changed (size/mtime) since the cache was started is refused: the shards follow the old listing.
    tar = tmp_path / "wds" / "00004.tar"
    tar.write_bytes(tar.read_bytes())
    os.utime(tar, ns=(1, 1))
    scans.clear()
    from precompute import sources
    from theworld.core.errors import UserError

    with pytest.raises(UserError, match=r"00004.tar changed \(modification time\) since the cache"):
        pipeline.run(cfg())
    assert scans == []
    # Listing cut short before listing.json was written (a crash): only the tar that changed is scanned again.
    (out / "source-index" / "listing.json").unlink()
    sources.open_listing("webdataset", f"{tmp_path}/wds/*.tar", 0, 0, "p", index_dir=out / "source-index")
    assert scans == ["00004.tar"]


def test_webdataset_listing_split_across_ranks(tmp_path, monkeypatch):
    """Two ranks (threads meeting at a barrier) scan disjoint tars (j % world) and end up with the same order,
    equal to listing everything in one process."""
    import threading

    from precompute import sources
    from tests._precompute_helpers import wds_source

    wds_source(tmp_path / "wds", tars=5, per_tar=4, dup=(2, 3))
    pattern = f"{tmp_path}/wds/*.tar"
    reference = sources.list_entries("webdataset", pattern, 0, 0, "p")
    from precompute.sources import webdataset

    scans, scan = [], webdataset._tar_samples
    monkeypatch.setattr(
        webdataset,
        "_tar_samples",
        lambda path: (scans.append((threading.current_thread().name, Path(path).name)), scan(path))[1],
    )
    listings, barrier = {}, threading.Barrier(2)

    def rank(r: int) -> None:
        listings[r] = sources.open_listing(
            "webdataset", pattern, 0, 0, "p", index_dir=tmp_path / "idx", rank=r, world=2, barrier=barrier.wait
        )

    threads = [threading.Thread(target=rank, args=(r,), name=f"rank{r}") for r in (0, 1)]
    [t.start() for t in threads], [t.join() for t in threads]
    assert sorted(scans) == [(f"rank{j % 2}", f"{j:05d}.tar") for j in sorted(range(5), key=lambda j: (j % 2, j))]
    for listing in listings.values():
        got = listing.entries(0, 12) + listing.entries(12, 20)
        assert [(e.key, e.source, e.error, e.loc) for e in got] == [
            (e.key, e.source, e.error, e.loc) for e in reference
        ]
    assert sum(e.error is not None for e in reference) == 1


@pytest.mark.slow
def test_two_processes_webdataset_source(tmp_path):
    """accelerate with 2 processes on a multi-tar source: each tar listed once, same shards as one process."""
    from tests._precompute_helpers import wds_source

    wds_source(tmp_path / "wds", tars=4, per_tar=3, dup=(2, 0))
    src = ["source.type=webdataset", f"source.path={tmp_path}/wds/*.tar"]
    m1 = single_threaded_run(make_cfg(tmp_path / "one", *src, shard=5, res=32))
    _launch_two_processes(cli_args(tmp_path / "two", *src, shard=5, res=32))
    m2 = json.loads((tmp_path / "two" / "manifest.json").read_text())
    assert m1["num_samples"] == m2["num_samples"] == 11 and m2["num_errors"] == 1
    assert m2["shard_index"] == m1["shard_index"]
    index = json.loads((tmp_path / "two" / "source-index" / "listing.json").read_text())
    assert index["counts"] == [3, 3, 3, 3] and list(index["duplicates"]) == ["6"]


def test_a_slow_run_shows_its_rate_and_small_images_are_counted_as_upscaled(tmp_path, fake_vae, capsys):
    from PIL import Image

    from tests._precompute_helpers import png_bytes

    assert pipeline.images_per_s(1, 30.0) == 0.0333 and pipeline.images_per_s(1234, 1.0) == 1230.0
    assert pipeline.images_per_s(0, 5.0) == 0.0
    src = tmp_path / "src"
    src.mkdir()
    sizes = {"tiny": (16, 16), "narrow": (20, 64), "exact": (32, 32), "big": (64, 48)}
    for name, size in sizes.items():
        (src / f"{name}.png").write_bytes(png_bytes(Image.new("RGB", size, (200, 10, 10))))
        (src / f"{name}.txt").write_text(f"a {name} red square")
    m = pipeline.run(make_cfg(tmp_path / "c", "source.type=folder", f"source.path={src}"))
    assert m["summary"]["upscaled_this_run"] == 2  # tiny, and narrow (its 20 px side is cropped to 20 x 20)
    assert "(2 smaller than 32 px, upscaled)" in capsys.readouterr().out


# A full disk (moved from tests/test_sources.py)


def test_a_full_disk_is_one_line_and_the_rerun_is_bit_exact(tmp_path, fake_vae, monkeypatch, capsys):
    from precompute import shard_writer

    reference = pipeline.run(make_cfg(tmp_path / "ref", n=12, shard=4))
    out = tmp_path / "c"
    write_shard = cf.write_shard

    def full_disk(cache_dir, index, samples):
        if index == 1:
            tmp = cf.tar_path(cache_dir, index)
            atomic.partial_path(tmp).write_bytes(b"partial")  # what a real write leaves
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
    assert cf.load_manifest(out)["shard_index"] == reference["shard_index"]


def test_a_refused_precompute_into_a_new_folder_leaves_nothing(tmp_path, capsys, fake_vae):
    from precompute import cosmos_latents
    from tests._precompute_helpers import cli_args

    (tmp_path / "empty").mkdir()
    out = tmp_path / "out" / "cache"
    rc = cosmos_latents.main(cli_args(out, "source.type=folder", f"source.path={tmp_path / 'empty'}"))
    assert rc == 2 and "no samples found" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_bucketed_precompute_records_each_samples_latent_shape(tmp_path, fake_vae):
    from precompute import inspect
    from precompute.pipeline import run
    from theworld import cache_format as cf
    from theworld.model.images import bucket_for

    src = bucket_folder(tmp_path / "src", 18)
    out = tmp_path / "cache"
    run(
        make_cfg(
            out, "source.type=folder", f"source.path={src}", "image.resize=bucket", "cache.flip=true", res=128, shard=8
        )
    )
    manifest = json.loads((out / "manifest.json").read_text())
    expected = {}
    for i in range(18):
        w, h = BUCKET_SIZES[i % len(BUCKET_SIZES)]
        bw, bh = bucket_for(w + i % 7, h, 128)
        expected[f"img{i:03d}_jpg"] = [16, 1, bh // 8, bw // 8]
    assert manifest["latent_shape"] is None
    counts = {}
    for shape in expected.values():
        counts[tuple(shape)] = counts.get(tuple(shape), 0) + 1
    assert manifest["latent_shapes"] == [{"shape": list(k), "num_samples": v} for k, v in sorted(counts.items())]
    assert len(counts) == 5
    reader = cf.CacheReader(out)
    for i in range(3):
        for e in cf.read_sidecar(out, i)["samples"]:
            assert e["latent_shape"] == expected[e["key"]]
    for j in range(len(reader)):
        s = reader[j]
        shape = expected[s.key]
        assert list(s.mean.shape) == list(s.logvar.shape) == list(s.flip_mean.shape) == shape
        assert reader.latent_hw[j].tolist() == shape[2:]
        box = s.meta["crop_box"]
        assert (box[2] - box[0]) / (box[3] - box[1]) == pytest.approx(shape[3] / shape[2], rel=0.05)
    args = type(
        "A",
        (),
        {
            "config": None,
            "overrides": [],
            "n": 18,
            "seed": 0,
            "batch_size": 8,
            "tol": 1e-5,
            "out": str(tmp_path / "sheet.png"),
        },
    )()
    report, code, _ = inspect.verify(out, args)
    assert code == 0 and report["ok"]
    # stored images re-encoded at their bucket size reproduce the cached latents; decode draws every shape
    report, code, _ = inspect.compare_live(out, args)
    assert code == 0 and report["n"] == 18 and report["max_abs_diff"] < 1e-5
    report, code, _ = inspect.decode(out, args)
    assert code == 0 and report["n"] == 18 and Image.open(tmp_path / "sheet.png").size[0] > 0


def test_a_mean_only_cache_halves_the_latent_bytes(tmp_path, fake_vae):
    from precompute import inspect
    from precompute.pipeline import run
    from theworld import cache_format as cf

    sizes = {}
    for kind in ("posterior", "mean"):
        out = tmp_path / kind
        run(make_cfg(out, f"cache.latents={kind}", "cache.flip=true", res=64, n=8))
        reader = cf.CacheReader(out)
        s = reader[0]
        assert (s.logvar is None) == (s.flip_logvar is None) == (kind == "mean")
        assert cf.latents_stored(cf.load_manifest(out)) == kind
        assert cf.load_manifest(out)["contents"].get("latents") == ("mean" if kind == "mean" else None)
        sizes[kind] = cf.read_sidecar(out, 0)["samples"][0]["members"][cf.LATENT][1]
        report, code, _ = inspect.verify(out, type("A", (), {"config": None, "overrides": []})())
        assert code == 0 and report["ok"]
    assert 0.49 < sizes["mean"] / sizes["posterior"] < 0.52


def test_bucketed_precompute_encodes_each_shards_buckets_in_full_batches(tmp_path, fake_vae, monkeypatch):
    """A shard's samples are grouped by bucket before batching: one encoder call per batch_size samples of a shape
    in a shard; the cache's key -> latent is what one-sample batches give, and a resumed run writes the same bytes."""
    from collections import Counter

    from precompute.pipeline import run
    from tests._precompute_helpers import latents
    from theworld import cache_format as cf
    from theworld.model.images import bucket_for

    src = bucket_folder(tmp_path / "src", 24)
    calls = []
    encode = fake_vae.encode
    monkeypatch.setattr(fake_vae, "encode", lambda x: (calls.append(tuple(x.shape)), encode(x))[1])
    cfg = lambda out, batch: make_cfg(
        out,
        "source.type=folder",
        f"source.path={src}",
        "image.resize=bucket",
        f"batch_size={batch}",
        n=24,
        res=128,
        shard=12,
    )
    first = run(cfg(tmp_path / "a", 4))

    def bucket(i: int) -> tuple[int, int]:
        w, h = BUCKET_SIZES[i % len(BUCKET_SIZES)]
        return bucket_for(w + i % 7, h, 128)

    per_shard = [Counter(bucket(i) for i in range(lo, lo + 12)) for lo in (0, 12)]
    assert len(calls) == sum(
        math.ceil(n / 4) for c in per_shard for n in c.values()
    )  # 10; splitting each loader batch by shape made 20
    assert all(n <= 4 for n, *_ in calls)
    assert {(w, h) for *_, h, w in calls} == {s for c in per_shard for s in c}
    one = run(cfg(tmp_path / "b", 1))
    assert first["num_samples"] == one["num_samples"] == 24
    got, want = latents(tmp_path / "a"), latents(tmp_path / "b")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    # resume: a lost shard is rebuilt byte for byte
    cf.tar_path(tmp_path / "a", 1).unlink()
    again = run(cfg(tmp_path / "a", 4))
    assert again["summary"]["encoded_this_run"] == 12
    assert again["shard_index"] == first["shard_index"]
