"""The trainer does not trust the cache: start-of-run consistency checks, per-member crc32 on every read, damaged files
as one-line errors (also from inside a loader worker), the documented repair, inspect verify against the tar."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zlib
from contextlib import closing
from pathlib import Path

import pytest

from precompute import cosmos_latents, inspect
from tests._precompute_helpers import make_cfg, rewrite_manifest
from tests.theworld.cache_format.conftest import as_format_3
from theworld import cache_format as cf
from theworld.core.errors import CacheDamaged, UserError

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def cache(tmp_path, fake_vae):
    out = tmp_path / "cache"
    cosmos_latents.run(make_cfg(out, n=10, shard=4, res=32))
    return out


def _side(cache: Path, i: int) -> dict:
    return json.loads(cf.sidecar_path(cache, i).read_text())


def _flip_byte(cache: Path, shard: int, sample: int, member: str, at: int = 0) -> str:
    """Flip one byte inside a member's data (found through the sidecar); returns the sample's key."""
    entry = _side(cache, shard)["samples"][sample]
    offset, size = entry["members"][member]
    tar = cf.tar_path(cache, shard)
    data = bytearray(tar.read_bytes())
    data[offset + (at % size)] ^= 0x40
    tar.write_bytes(bytes(data))
    return entry["key"]


def _strip_checksums(cache: Path) -> None:
    """What a cache written before member checksums looks like (format 3: its reader reads the sidecars)."""
    as_format_3(cache)
    for i in range(len(json.loads((cache / cf.MANIFEST).read_text())["shards"])):
        side = _side(cache, i)
        for s in side["samples"]:
            s.pop(cf.CHECKSUMS)
        cf.atomic_write_json(cf.sidecar_path(cache, i), side)


def _one_line(capsys, *words: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and all(w in err[0] for w in words), err
    assert " at 0x" not in err[0]
    return err[0]


def test_the_writer_records_a_crc32_per_member_and_every_read_checks_it(cache):
    side = _side(cache, 1)
    tar = cf.tar_path(cache, 1).read_bytes()
    for s in side["samples"]:
        assert s[cf.CHECKSUMS].keys() == s["members"].keys()
        for name, (offset, size) in s["members"].items():
            assert s[cf.CHECKSUMS][name] == zlib.crc32(tar[offset : offset + size])
    reader = cf.CacheReader(cache)
    reader.check_consistency()
    assert reader.checksummed and len(reader) == 10
    key = _flip_byte(cache, 1, 2, cf.LATENT, at=200)  # tensor data: safetensors would load it without complaint
    index = reader.keys().index(key)
    reader.check_consistency()  # same size: only reading the member shows it
    with pytest.raises(CacheDamaged) as e:
        reader.raw(index)
    msg = str(e.value)
    assert "shard-000001.tar" in msg and key in msg and "latent.safetensors" in msg and "crc32" in msg
    assert f"delete {cf.sidecar_path(cache, 1)}" in msg and "rerun the precompute command" in msg
    reader.raw(reader.keys().index(_side(cache, 0)["samples"][0]["key"]))  # other shards still read
    # the reader that skips the damaged member does not see it
    with closing(cf.CacheReader(cache, members=(cf.CAPTION,))) as captions_only:
        assert captions_only.raw(index)[cf.CAPTION]


def test_a_cache_without_checksums_still_reads(cache):
    _strip_checksums(cache)
    reader = cf.CacheReader(cache)
    reader.check_consistency()
    assert not reader.checksummed
    assert all(reader[i].mean is not None for i in range(len(reader)))


@pytest.mark.parametrize(
    "damage,words",
    [
        ("truncate", ["shard-000001.tar", "bytes on disk", "delete"]),
        ("delete", ["shard-000001.tar", "missing", "delete"]),
        ("swap_with_sidecar", ["shard-000001.tar", "what manifest.json lists for shard-000000.tar", "copied over it"]),
        ("swap_pairs", ["shard-000000.tar", "shard-000001.tar holds this shard's: the two were swapped"]),
        ("edit_sidecar", ["shard-000001.tar", "(count 1 vs ", "sidecar vs manifest", "delete"]),
        ("manifest_lists_fewer", ["shard-000002.tar", "manifest.json lists 2 shards", "rerun the precompute"]),
        ("duplicate_keys", ["occurs twice", "shard-000000.tar", "shard-000001.tar"]),
        ("offset_outside", ["outside the tar", "shard-000002.tar"]),
    ],
)
def test_start_of_run_checks_catch_damage_without_reading_data(cache, damage, words):
    tar1 = cf.tar_path(cache, 1)
    if damage not in ("truncate", "delete"):  # sidecars and the manifest's shard list: what a format-3 cache reads
        as_format_3(cache)
    manifest = json.loads((cache / cf.MANIFEST).read_text())
    if damage == "truncate":
        tar1.write_bytes(tar1.read_bytes()[:3000])
    elif damage == "delete":
        tar1.unlink()
    elif damage == "swap_with_sidecar":  # shard 1 replaced by a copy of shard 0, sidecar and all
        shutil.copy(cf.tar_path(cache, 0), tar1)
        shutil.copy(cf.sidecar_path(cache, 0), cf.sidecar_path(cache, 1))
    elif damage == "swap_pairs":  # shards 0 and 1 trade places, each with its own sidecar
        for suffix in (cf.tar_path, cf.sidecar_path):
            a, b = suffix(cache, 0), suffix(cache, 1)
            a.rename(a.with_name("x"))
            b.rename(a)
            a.with_name("x").rename(b)
    elif damage == "edit_sidecar":
        side = _side(cache, 1)
        side["count"] = 1
        cf.atomic_write_json(cf.sidecar_path(cache, 1), side)
    elif damage == "manifest_lists_fewer":
        manifest["shards"] = manifest["shards"][:2]
        manifest["num_samples"] = sum(s["num_samples"] for s in manifest["shards"])
        cf.atomic_write_json(cache / cf.MANIFEST, manifest)
    elif damage == "duplicate_keys":  # the copy and a manifest rewritten from the sidecars: only the keys tell
        shutil.copy(cf.tar_path(cache, 0), tar1)
        shutil.copy(cf.sidecar_path(cache, 0), cf.sidecar_path(cache, 1))
        manifest["shards"][1] = {**manifest["shards"][0], "path": "shards/shard-000001.tar"}
        cf.atomic_write_json(cache / cf.MANIFEST, manifest)
    elif damage == "offset_outside":
        side = _side(cache, 2)
        side["samples"][-1]["members"][cf.LATENT][0] = side["bytes"]
        cf.atomic_write_json(cf.sidecar_path(cache, 2), side)
    with pytest.raises(CacheDamaged) as e, closing(cf.CacheReader(cache)) as reader:
        reader.check_consistency()
    assert all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.parametrize(
    "sidecar",
    [
        b"{not json",
        b"[1, 2]",
        b'{"samples": 3}',
        b'{"samples": [{"key": "a", "members": {"txt": "x"}}]}',
        b'{"samples": [{"key": 1, "members": {}}]}',
    ],
)
def test_a_malformed_sidecar_is_one_line_naming_it(cache, sidecar):
    as_format_3(cache)  # a format-4 reader reads the shard index, not the sidecars
    cf.sidecar_path(cache, 1).write_bytes(sidecar)
    with pytest.raises(CacheDamaged) as e:
        cf.CacheReader(cache)
    assert "shard-000001.json" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "manifest",
    [
        b"[1, 2, 3]",
        b'"a string"',
        b"17",
        b"null",
        b"\xff\xfe not utf-8",
        b'{"format_version": 1, "shards": {"a": 1}}',
        b'{"format_version": 1, "shards": [{"path": "x"}]}',
    ],
)
def test_a_manifest_that_is_not_a_valid_object_is_one_line_in_summary_and_verify(cache, capsys, manifest):
    (cache / cf.MANIFEST).write_bytes(manifest)
    assert inspect.main(["summary", str(cache)]) == 2
    _one_line(capsys, "manifest.json")
    assert inspect.main(["verify", str(cache)]) == 1  # a finding, reported like a bad shard
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "manifest.json" in out[0] and "FAILED" in out[0], out


def test_verify_checks_sidecar_offsets_and_checksums_against_the_tar(cache, capsys):
    assert inspect.main(["verify", str(cache)]) == 0
    capsys.readouterr()
    side = _side(cache, 0)
    side["samples"][1]["members"][cf.CAPTION][0] += 512  # still inside the tar: only the tar's own layout tells
    cf.atomic_write_json(cf.sidecar_path(cache, 0), side)
    assert inspect.main(["verify", str(cache), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["bad_shards"] == ["shards/shard-000000.tar"]
    assert any("sidecar offsets" in p for p in report["shards"][0]["problems"])
    side["samples"][1]["members"][cf.CAPTION][0] -= 512
    side["samples"][1][cf.CHECKSUMS][cf.CAPTION] ^= 1
    cf.atomic_write_json(cf.sidecar_path(cache, 0), side)
    assert inspect.main(["verify", str(cache), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert any("txt fails its crc32" in p for p in report["shards"][0]["problems"])


def test_undecodable_bytes_in_a_cache_without_checksums_name_shard_and_key(cache):
    _strip_checksums(cache)
    key = _side(cache, 2)["samples"][0]["key"]
    offset, size = _side(cache, 2)["samples"][0]["members"][cf.CAPTION]
    tar = cf.tar_path(cache, 2)
    data = bytearray(tar.read_bytes())
    data[offset] = 0xFF  # not UTF-8
    tar.write_bytes(bytes(data))
    reader = cf.CacheReader(cache)
    with pytest.raises(CacheDamaged) as e:
        reader.sample(reader.keys().index(key))
    assert "shard-000002.tar" in str(e.value) and key in str(e.value) and "does not decode" in str(e.value)


# ----------------------------------------------------------------------------------------------------------------------
# Training on a damaged cache (real tiny models: the trainer checks the fingerprint)


@pytest.fixture(scope="module")
def train_cache(tmp_path_factory):
    from precompute.config import load as load_pre
    from precompute.cosmos_latents import run

    out = tmp_path_factory.mktemp("integrity") / "cache"
    run(
        load_pre(
            str(ROOT / "configs" / "precompute.yaml"),
            [
                f"output_dir={out}",
                "source.num_samples=48",
                "shard_size=16",
                "batch_size=16",
                "num_workers=0",
                "cache.siglip=false",
            ],
        )
    )
    return out


def _train(cache: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    from tests.conftest import ENV, base_args

    args = base_args(cache, out, steps=2, **{"train.loader.num_workers": 1}) + [a for e in extra for a in ("--set", e)]
    return subprocess.run(
        [sys.executable, "-m", "train.loop", *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300
    )


def _stderr_line(res: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert res.returncode == 2 and len(lines) == 1, res.stderr[-3000:]
    assert "Traceback" not in res.stderr and "terminate" not in res.stderr, res.stderr[-3000:]
    return lines[0]


@pytest.mark.slow
def test_damaged_latents_stop_training_with_one_line_and_the_documented_repair_rebuilds_that_shard(
    train_cache, tmp_path
):
    cache = tmp_path / "cache"
    shutil.copytree(train_cache, cache)
    keys = [s["key"] for i in range(3) for s in _side(cache, i)["samples"]]
    damaged = [_flip_byte(cache, 1, j, cf.LATENT, at=300) for j in range(16)]  # whichever the first batch reads
    line = _stderr_line(_train(cache, tmp_path / "run"))
    assert "shard-000001.tar" in line and any(k in line for k in damaged) and "crc32" in line, line
    repair = f"delete {cf.sidecar_path(cache, 1)}"
    assert repair in line
    cf.sidecar_path(cache, 1).unlink()  # the repair the line names
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "precompute.cosmos_latents",
            "--config",
            str(ROOT / "configs" / "precompute.yaml"),
            "--set",
            f"output_dir={cache}",
            "--set",
            "source.num_samples=48",
            "--set",
            "shard_size=16",
            "--set",
            "batch_size=16",
            "--set",
            "num_workers=0",
            "--set",
            "cache.siglip=false",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "this run encoded 16 images" in res.stdout  # that shard alone
    assert cf.tar_path(cache, 1).read_bytes() == cf.tar_path(train_cache, 1).read_bytes()
    assert [s["key"] for i in range(3) for s in _side(cache, i)["samples"]] == keys
    ok = _train(cache, tmp_path / "run")
    assert ok.returncode == 0, ok.stderr[-3000:]


@pytest.mark.slow
def test_an_old_cache_trains_with_a_note_and_its_undecodable_bytes_are_one_line(train_cache, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(train_cache, cache)
    _strip_checksums(cache)
    for j in range(16):  # a latent's safetensors header broken: only decoding shows it
        _flip_byte(cache, 0, j, cf.LATENT, at=10)
    res = _train(cache, tmp_path / "run")
    line = _stderr_line(res)
    assert "shard-000000.tar" in line and "does not decode" in line, line
    assert "no per-member checksums" in res.stderr


def test_a_cache_file_changed_before_the_run_is_refused_before_any_model_loads(train_cache, tmp_path, capsys):
    from tests.conftest import base_args
    from train.loop import main

    cache = tmp_path / "cache"
    shutil.copytree(train_cache, cache)
    tar = cf.tar_path(cache, 2)
    tar.write_bytes(tar.read_bytes()[:-1024])
    assert main(base_args(cache, tmp_path / "run")) == 2
    _one_line(capsys, "shard-000002.tar", "delete")
    (cache / cf.MANIFEST).write_text("[]")
    assert main(base_args(cache, tmp_path / "run")) == 2
    _one_line(capsys, "manifest.json")


def _old_shard(cache: Path, shard: int, sample: int, caption: str | None = None, prompt: str | None = None) -> str:
    """Rewrite a shard as precompute did before it refused control strings: sample `sample` gets `caption` and/or
    `prompt`, and the sidecar records no text rule. Returns the sample's key."""
    reader = cf.CacheReader(cache)
    samples = [(reader.key(i), reader.raw(i)) for i in reader.samples_in([shard]).tolist()]
    reader.close()
    members = samples[sample][1]
    if caption is not None:
        members[cf.CAPTION] = caption.encode()
    if prompt is not None:
        members[cf.META] = json.dumps({**json.loads(members[cf.META]), "prompt": prompt}).encode()
    cf.write_shard(cache, shard, samples)
    rewrite_manifest(cache)
    return samples[sample][0]


def test_an_old_cache_with_a_control_string_caption_is_refused_before_any_model_loads(
    cache, tmp_path, capsys, monkeypatch
):
    from tests.conftest import base_args
    from theworld.model.control_text import TEXT_RULE
    from train.data import cache as data
    from train.loop import main

    assert {_side(cache, i)["text_rule"] for i in range(3)} == {TEXT_RULE}  # precompute applied the rule
    key = _old_shard(cache, 1, 2, caption="a red ball <end_of_turn> on grass")
    assert "text_rule" not in _side(cache, 1)
    reads = []
    raw = cf.CacheReader.raw
    monkeypatch.setattr(cf.CacheReader, "raw", lambda self, i: (reads.append(i), raw(self, i))[1])
    monkeypatch.setattr("theworld.model.TheWorld.__init__", lambda *a, **k: pytest.fail("a model was built"))
    assert main(base_args(cache, tmp_path / "run", **{"train.eval.samples": 2})) == 2
    _one_line(
        capsys,
        "1 sample(s)",
        "shard-000001.tar",
        key,
        "caption holds the Gemma control string '<end_of_turn>'",
        f"delete {cf.sidecar_path(cache, 1).name}",
    )
    assert sorted(reads) == cf.CacheReader(cache).samples_in([1]).tolist()  # only the unmarked shard is read
    # the prompt (in the json member) follows the same rule; a clean unmarked shard passes
    _old_shard(cache, 1, 2, caption="a red ball on grass")
    data.check_texts(cf.CacheReader(cache))
    _old_shard(cache, 0, 1, prompt="What is this? <start_of_image>")
    with pytest.raises(UserError, match=r"shard-000000.tar.*prompt holds the Gemma control string '<start_of_image>'"):
        data.check_texts(cf.CacheReader(cache))
