"""Caches in object storage (theworld/cache_format/storage.py): a real S3 server (moto's server mode) on 127.0.0.1,
reached by the real s3fs/botocore client through the standard AWS environment, behind a small HTTP proxy of the test's
own that logs every request (the server-side evidence of what was read and written) and can hold one request (to
kill a precompute in the middle of an upload)."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from tests._precompute_helpers import cli_args, make_cfg
from tests.conftest import base_args, fork_command, metrics, run2, train_inproc
from tests.theworld.cache_format.conftest import BUCKET
from theworld import cache_format as cf
from theworld.core.errors import UserError


def url(prefix: str) -> str:
    return f"s3://{BUCKET}/{prefix}"


def local_dir(s3, name: str) -> str:
    return str(s3.local_dir / name)


def members_by_key(reader: cf.CacheReader) -> dict[str, dict[str, bytes]]:
    return {reader.key(i): reader.raw(i) for i in range(len(reader))}


@pytest.fixture(scope="session")
def s3_cache(s3, tmp_path_factory):
    """The same small precompute into a local folder and into s3 (20 samples, 3 shards), with the requests of the
    s3 one."""
    from precompute.pipeline import run

    local = tmp_path_factory.mktemp("pre") / "cache"
    run(make_cfg(local))
    start = len(s3.log)
    run(make_cfg(url("pre"), f"storage.local_dir={local_dir(s3, 'pre')}"))  # type: ignore[arg-type]
    return local, url("pre"), s3.log[start:]


def test_precompute_to_s3_puts_each_shard_once_manifest_last_and_equals_a_local_precompute(s3, s3_cache):
    local, remote, log = s3_cache
    puts = [p for m, p, _ in log if m == "PUT" and p.startswith(f"/{BUCKET}/pre/")]
    names = [p.split("/pre/", 1)[1] for p in puts]
    assert names[-1] == "manifest.json"  # last: its presence means complete
    for i in range(3):
        stem = f"shard-{i:06d}"
        assert names.count(f"shards/{stem}.tar") == 1 and names.count(f"shards/{stem}.json") == 1
        assert names.index(f"shards/{stem}.tar") < names.index(f"shards/{stem}.json")  # the sidecar marks it done
    manifest = json.loads(s3.fs.cat_file(f"{BUCKET}/pre/manifest.json"))
    assert manifest["shard_index"] == cf.load_manifest(local)["shard_index"]  # byte-identical tars and index
    a = members_by_key(cf.CacheReader(local))
    b = members_by_key(cf.CacheReader(remote, settings=cf.Settings(local_dir=local_dir(s3, "read"))))
    assert len(a) == 20 and a == b


def test_a_bucket_cache_written_again_in_fewer_parts_keeps_no_part_its_manifest_does_not_name(s3, monkeypatch):
    """Written in parts of 8 samples (three parts of its 20 samples in shards of 8), then finished again in parts of
    the default span (one part): the bucket keeps the parts the manifest names, and the cache reads the same."""
    from precompute.pipeline import run
    from theworld.cache_format import index

    monkeypatch.setattr(index, "PART_SAMPLES", 8)
    run(make_cfg(url("reparts"), f"storage.local_dir={local_dir(s3, 'reparts')}"))  # type: ignore[arg-type]
    listed = sorted(s3.fs.ls(f"{BUCKET}/reparts/shard-index"))
    assert len([p for p in listed if "/part-" in p]) == 3
    before = members_by_key(cf.CacheReader(url("reparts"), settings=cf.Settings(local_dir=local_dir(s3, "r1"))))
    monkeypatch.undo()
    s3.fs.rm_file(f"{BUCKET}/reparts/shards/shard-000002.json")  # shard 2 to redo: the cache is finished again
    run(make_cfg(url("reparts"), f"storage.local_dir={local_dir(s3, 'reparts')}"))  # type: ignore[arg-type]
    s3.fs.invalidate_cache()
    parts = [p.rsplit("/", 1)[1] for p in s3.fs.ls(f"{BUCKET}/reparts/shard-index") if "/part-" in p]
    assert parts == [index.part_name(0)]
    after = members_by_key(cf.CacheReader(url("reparts"), settings=cf.Settings(local_dir=local_dir(s3, "r2"))))
    assert after == before and len(after) == 20


def test_inspect_summary_and_verify_read_an_s3_cache(s3, s3_cache, capsys):
    from precompute.inspect import main

    _, remote, _ = s3_cache
    sets = ["--set", f"storage.local_dir={local_dir(s3, 'inspect')}"]
    assert main(["verify", remote, *sets]) == 0
    assert f"verify {remote}: OK: 20 samples in 3 shards checked" in capsys.readouterr().out
    assert main(["summary", remote, "--json", *sets]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["cache"] == remote and report["num_samples"] == 20


@pytest.mark.slow
def test_kill_9_during_an_upload_then_rerun_loses_and_duplicates_no_shard(s3, s3_cache, tmp_path, capsys):
    """The proxy holds the PUT of shard 1's tar (the client waits for an answer that never comes) while the process
    is killed; the rerun puts the shard finished locally without encoding it again and completes the cache."""
    from precompute import cosmos_latents

    local, _, _ = s3_cache
    target = url("killed")
    args = cli_args(target, f"storage.local_dir={tmp_path / 'local'}")  # type: ignore[arg-type]
    s3.hold("PUT", r"/killed/shards/shard-000001\.tar")
    p = fork_command("precompute.cosmos_latents", args, s3.env, logs=tmp_path / "forked")  # its imports done already
    try:
        assert s3.held.wait(240), "the upload of shard 1 never started"
        p.send_signal(signal.SIGKILL)
        assert p.wait(30) == -signal.SIGKILL
    finally:
        s3.release()
        if p.poll() is None:
            p.kill()
            p.wait()
    objects = s3.fs.find(f"{BUCKET}/killed")
    assert f"{BUCKET}/killed/shards/shard-000001.tar" not in objects
    assert f"{BUCKET}/killed/manifest.json" not in objects
    start = len(s3.log)
    assert cosmos_latents.main(args) == 0  # the rerun in process: the kill is the forked process's point
    encoded = int(re.search(r"this run encoded (\d+) images", capsys.readouterr().out).group(1))
    assert encoded == 4  # shard 2 only: shard 0 was up, shard 1 finished here and is put, not encoded again
    rerun_puts = [p for m, p, _ in s3.log[start:] if m == "PUT" and "/killed/shards/" in p]
    assert not [p for p in rerun_puts if "shard-000000" in p]
    reader = cf.CacheReader(target, settings=cf.Settings(local_dir=str(tmp_path / "read")))
    reader.check_consistency()  # every shard listed once, keys unique, sizes as the sidecars say
    # the same samples as the in-process precompute (their bytes may differ in the last bits: the killed run had
    # OMP_NUM_THREADS=1), each decoding, shard by shard in order
    got = [(reader.key(i), reader.sample(i).caption) for i in range(len(reader))]
    want = cf.CacheReader(local)
    assert got == [(want.key(i), want.sample(i).caption) for i in range(len(want))]


def _train_args(s3, cache: str, out: Path, steps: int, shard_cache: str, **extra) -> list[str]:
    return base_args(cache, out, steps, **{"storage.local_dir": shard_cache, **extra})  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def s3_train_cache(s3, cache):
    """The shared training cache (96 samples, 3 shards) copied into s3 object by object."""
    return _put_tree(s3, cache, "train")


@pytest.mark.slow
def test_training_from_s3_logs_the_same_losses_resumes_exactly_and_reads_each_shard_once(
    s3, cache, s3_train_cache, tmp_path
):
    """48 training samples (48 of 96 held out), 16 per step: step 4 is in the second epoch. Trained from s3 in two
    runs (2 steps, then resumed to 4), the losses equal those of training from the local copy at every step, and
    each shard's tar is fetched from the server once in all (counted on the server side): the second run and the
    second epoch read the shard cache. Two processes from s3 give the same losses (within float rounding)."""
    held = {"train.eval.samples": 48, "train.eval.captions": 0}  # the final evals sample no caption: none is checked
    assert train_inproc(base_args(cache, tmp_path / "local", 4, **held)) == 0
    start = len(s3.log)
    shard_cache = str(tmp_path / "shards")
    for steps in (2, 4):
        args = _train_args(
            s3, s3_train_cache, tmp_path / "s3", steps, shard_cache, **held, **{"train.checkpoint.every": 2}
        )
        assert train_inproc(args) == 0
    local_losses = {m["step"]: m["loss"] for m in metrics(tmp_path / "local") if "loss" in m}
    s3_losses = {m["step"]: m["loss"] for m in metrics(tmp_path / "s3") if "loss" in m}
    assert sorted(local_losses) == [1, 2, 3, 4] and s3_losses == local_losses
    tar_gets = s3.downloads(start, r"/train/shards/shard-\d+\.tar$")
    assert sorted(tar_gets) == [f"/{BUCKET}/train/shards/shard-{i:06d}.tar" for i in range(3)]
    # two processes on this node (one shard cache, fetched by whichever gets there first) train as one
    start = len(s3.log)
    two = run2(_train_args(s3, s3_train_cache, tmp_path / "two", 4, str(tmp_path / "shards2"), **held), s3.env)
    assert two.returncode == 0, two.stderr[-3000:]
    two_losses = {m["step"]: m["loss"] for m in metrics(tmp_path / "two") if "loss" in m}
    assert sorted(two_losses) == [1, 2, 3, 4]
    assert [two_losses[k] for k in range(1, 5)] == pytest.approx([local_losses[k] for k in range(1, 5)], rel=1e-5)
    tar_gets = s3.downloads(start, r"/train/shards/shard-\d+\.tar$")
    assert sorted(tar_gets) == [f"/{BUCKET}/train/shards/shard-{i:06d}.tar" for i in range(3)]


def test_a_cache_larger_than_the_shard_cache_read_in_the_global_order_gets_a_note_naming_a_window(
    s3, cache, s3_train_cache, tmp_path, capsys
):
    from train.data.cache import window_note

    reader = cf.CacheReader(s3_train_cache, settings=cf.Settings(local_dir=str(tmp_path / "i")))
    total = int(reader.shard_table.bytes.sum())  # 3 shards
    small = {"local_dir": str(tmp_path / "l"), "local_max_gb": total * 2 / 3 / 1e9}  # two shards fit, three do not
    note = window_note(cf.Settings(**small), reader)
    assert note.startswith(f"note: {s3_train_cache} hold(s) {total / 1e9:.3g} GB, more than this node's shard cache")
    assert "--set storage.shuffle_window=1 reads 1 shard(s) at a time" in note  # a quarter of two shards: one
    assert window_note(cf.Settings(**small, shuffle_window=1), reader) == ""
    assert window_note(cf.Settings(**{**small, "local_max_gb": total / 1e9}), reader) == ""  # it fits
    assert window_note(cf.Settings(**small), cf.CacheReader(cache)) == ""  # a local cache is not downloaded
    capsys.readouterr()
    args = _train_args(s3, s3_train_cache, tmp_path / "run", 1, small["local_dir"], **{"train.eval.captions": 0})
    assert train_inproc([*args, "--set", f"storage.local_max_gb={small['local_max_gb']}"]) == 0
    assert note in capsys.readouterr().err  # a start line of the run


def test_a_multi_node_run_is_told_what_each_node_downloads_and_the_node_groups_that_split_it(
    s3, cache, s3_train_cache, tmp_path
):
    """The start line of a run of several nodes reading a cache at a URL in windows: without node groups every node
    downloads every shard (and the setting that splits them is named); with them, how many groups each node reads,
    and a count that does not divide among the nodes is named with what it costs."""
    from tests.conftest import train_config
    from train.data.cache import node_groups_note

    reader = cf.CacheReader(s3_train_cache, settings=cf.Settings(local_dir=str(tmp_path / "i")))

    def note(nodes: int, *sets: str, batch: int = 16, of=reader) -> str:
        cfg = train_config("storage.shuffle_window=4", f"train.global_batch_size={batch}", *sets)
        return node_groups_note(cfg, of, nodes)

    assert note(2) == (
        "note: each of the 2 nodes downloads every shard of each window (the cache 2 times an epoch from the "
        "bucket); --set storage.node_groups=2 gives each node its own 50% of the shards"
    )
    assert note(1) == note(3) == note(2, of=cf.CacheReader(cache)) == ""  # one node; 3 splits no batch; a disk
    assert (
        note(4, "storage.node_groups=4")
        == "order: storage.node_groups 4 over 4 node(s): each node reads 1 group(s) of shards"
    )
    assert (
        note(2, "storage.node_groups=4")
        == "order: storage.node_groups 4 over 2 node(s): each node reads 2 group(s) of shards"
    )
    # 4 groups over 3 nodes of a batch of 12: node 1 holds positions 4-7, parts 1 and 2
    assert note(3, "storage.node_groups=4", batch=12) == (
        "note: storage.node_groups 4 does not divide among 3 nodes: a node reads up to 2 of the 4 groups of shards; a "
        "multiple of 3 gives each node its own"
    )


def test_a_shard_cache_smaller_than_the_data_evicts_the_least_recently_used_and_stays_bounded(
    s3, s3_train_cache, tmp_path
):
    size = int(
        cf.CacheReader(s3_train_cache, settings=cf.Settings(local_dir=str(tmp_path / "i"))).shard_table.bytes.max()
    )
    budget_gb = 1.5 * size / 1e9  # one shard fits, two do not
    settings = cf.Settings(local_dir=str(tmp_path / "local"), local_max_gb=budget_gb)
    reader = cf.CacheReader(s3_train_cache, settings=settings)
    start = len(s3.log)
    for _ in range(2):
        for i in range(len(reader)):
            reader.raw(i)
            staged = list((tmp_path / "local" / "shards").glob("*.tar"))
            assert sum(p.stat().st_size for p in staged) <= budget_gb * 1e9
    gets = [p for m, p, _ in s3.log[start:] if m == "GET" and p.endswith(".tar")]
    assert len(gets) == 6  # every shard once per pass: none fits beside another


def test_bad_inputs_are_one_line_naming_the_url(s3, s3_cache, s3_train_cache, tmp_path, capsys, monkeypatch):
    from precompute.cosmos_latents import main as precompute
    from precompute.inspect import main as inspect

    sets = ["--set", f"storage.local_dir={tmp_path / 'local'}"]

    def one_line(code: int, *words: str) -> str:
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
        for w in words:
            assert w in err, err
        return err

    # a bucket that does not exist: reading and writing
    one_line(inspect(["summary", "s3://no-such-bucket/c", *sets]), "s3://no-such-bucket/c", "does not exist")
    one_line(
        precompute(cli_args("s3://no-such-bucket/c", f"storage.local_dir={tmp_path / 'w'}")),  # type: ignore[arg-type]
        "s3://no-such-bucket/c",
        "bucket no-such-bucket does not exist",
    )
    # a scheme fsspec does not know
    one_line(inspect(["summary", "foo://b/c", *sets]), "foo://b/c", "Protocol not known", "check the URL")
    # a half-written prefix (shards, no manifest) and an empty one
    s3.fs.put_file(str(next(Path(s3_cache[0]).glob("shards/*.tar"))), f"{BUCKET}/half/shards/shard-000000.tar")
    one_line(inspect(["verify", url("half"), *sets]), url("half"), "incomplete", "rerun the precompute command")
    one_line(inspect(["summary", url("empty"), *sets]), f"no cache at {url('empty')}")
    # a prefix holding another cache: precompute with another config, training with another image size
    one_line(
        precompute(cli_args(url("pre"), f"storage.local_dir={tmp_path / 'w2'}", n=24)),  # type: ignore[arg-type]
        f"output_dir {url('pre')} holds a cache built with a different",
    )
    one_line(
        train_inproc(
            _train_args(s3, s3_train_cache, tmp_path / "run", 1, str(tmp_path / "sc"), **{"image.resolution": 32})
        ),
        s3_train_cache,
        "image.resolution",
    )
    # a local shard cache too small for one shard
    one_line(
        inspect(["verify", s3_train_cache, *sets, "--set", "storage.local_max_gb=0.000001"]),
        s3_train_cache,
        "local shard cache",
        "is full",
        "storage.local_max_gb",
    )
    # no credentials
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    fresh = ["--set", "storage.options.skip_instance_cache=true"]
    one_line(inspect(["summary", s3_train_cache, *sets, *fresh]), s3_train_cache, "no credentials", "AWS_ACCESS_KEY_ID")


def test_storage_option_secrets_are_not_shown_or_saved():
    from precompute.config import PrecomputeConfig
    from theworld.core.config import load_config, to_yaml

    cfg = load_config(
        PrecomputeConfig,
        None,
        ["storage.options.secret=s3cr3t", "storage.options.anon=false", "storage.options.client_kwargs.region_name=x"],
    )
    assert cfg.storage.options == {"secret": "s3cr3t", "anon": False, "client_kwargs": {"region_name": "x"}}
    text = to_yaml(cfg)
    assert "s3cr3t" not in text and "<redacted>" in text and "region_name: x" in text


def _put_tree(s3, folder: Path, prefix: str) -> str:
    for p in sorted(folder.rglob("*")):
        if p.is_file() and not p.name.startswith("."):
            s3.fs.put_file(str(p), f"{BUCKET}/{prefix}/{p.relative_to(folder)}")
    return url(prefix)


@pytest.mark.slow
def test_caption_evaluation_reads_the_held_out_split_of_an_s3_cache(
    s3, trained_run, run_copy, tmp_path, capsys, monkeypatch
):
    from theworld.evaluate import main

    monkeypatch.setenv("HOME", str(tmp_path))  # the default storage.local_dir is under it
    remote = _put_tree(s3, trained_run["cache"], "eval")
    records = {}
    for name, data in (("local", str(trained_run["cache"])), ("s3", remote)):
        out = tmp_path / f"{name}.jsonl"
        argv = ["--model", str(run_copy), "--data", data, "--task", "caption", "--json"]
        assert main([*argv, "--max-new-tokens", "4", "--out", str(out)]) == 0
        assert json.loads(capsys.readouterr().out)["n"] == 8
        records[name] = [json.loads(x) for x in out.read_text().splitlines()]
        for r in records[name]:
            assert r.pop("item").startswith(f"{data}:")
    assert records["s3"] == records["local"]
    assert list((tmp_path / ".cache" / "theworld" / "object-store" / "shards").glob("*.tar"))


def test_a_cache_served_over_http_reads_and_verifies_and_is_not_written(s3_cache, tmp_path, capsys):
    """https:// and http:// are read-only: a plain http.server on 127.0.0.1 serving a cache folder."""
    import functools
    from http.server import SimpleHTTPRequestHandler

    from precompute.cosmos_latents import main as precompute
    from precompute.inspect import main as inspect

    local = s3_cache[0]
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(local))
    handler.log_message = lambda *a: None
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        remote = f"http://127.0.0.1:{server.server_address[1]}"
        reader = cf.CacheReader(remote, settings=cf.Settings(local_dir=str(tmp_path / "l")))
        reader.check_consistency()
        assert members_by_key(reader) == members_by_key(cf.CacheReader(local))
        assert inspect(["verify", remote, "--set", f"storage.local_dir={tmp_path / 'l'}"]) == 0
        assert f"verify {remote}: OK" in capsys.readouterr().out
        assert precompute(cli_args(f"{remote}/new", f"storage.local_dir={tmp_path / 'w'}")) == 2  # type: ignore[arg-type]
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"{remote}/new" in err and "read-only" in err, err
    finally:
        server.shutdown()


def test_network_errors_are_retried_by_the_client_then_one_line_naming_the_object(s3, s3_train_cache, tmp_path):
    """One retry layer: botocore's (RetryPolicy.attempts); an HTTP 500 that outlasts it is one line that says it
    failed, never "not found" or a size of 0 bytes."""
    settings = cf.Settings(local_dir=str(tmp_path / "l"))
    reader = cf.CacheReader(s3_train_cache, settings=settings)
    start = len(s3.log)
    s3.fail_next("GET", r"/train/shards/shard-000000\.tar$", cf.storage.POLICY.attempts - 1)
    assert reader.sample(0).caption  # the client's last attempt gets it
    tries = [p for m, p, _ in s3.log[start:] if m == "GET" and p.endswith("shard-000000.tar")]
    assert len(tries) == cf.storage.POLICY.attempts
    s3.fail_next("GET", r"/train/shards/shard-000001\.tar$", 100)
    index = int(reader.samples_in([1])[0])
    start = len(s3.log)
    with pytest.raises(UserError) as e:
        reader.raw(index)
    s3.fail = None
    text = str(e.value)
    assert len(text.splitlines()) == 1 and f"{s3_train_cache}/shards/shard-000001.tar" in text, text
    assert f"failed after {cf.storage.POLICY.attempts} attempts" in text and "not found" not in text, text
    tries = [p for m, p, _ in s3.log[start:] if m == "GET" and p.endswith("shard-000001.tar")]
    assert len(tries) == cf.storage.POLICY.attempts  # no layer retries the client's retries
    s3.fail_next("GET", r"list-type", 100)  # a listing in trouble (precompute's final step lists)
    with pytest.raises(UserError) as e:
        reader.remote.listing(cf.SHARDS)
    s3.fail = None
    assert "not found" not in str(e.value) and "0 bytes" not in str(e.value), str(e.value)


class _Captions:
    def __init__(self, reader: cf.CacheReader):
        self.reader = reader

    def __len__(self) -> int:
        return len(self.reader)

    def __getitem__(self, i: int) -> str:
        return self.reader.sample(i, tensors=False).caption


def test_forked_loader_workers_read_an_s3_cache_the_parent_opened(s3, s3_train_cache, tmp_path):
    from torch.utils.data import DataLoader

    reader = cf.CacheReader(s3_train_cache, settings=cf.Settings(local_dir=str(tmp_path / "l")))
    want = [reader.sample(i, tensors=False).caption for i in range(len(reader))]  # the parent's filesystem in use
    reader.close()
    for p in (tmp_path / "l" / "shards").glob("*.tar"):
        p.unlink()  # the workers fetch the shards again
    loader = DataLoader(_Captions(reader), batch_size=None, num_workers=2, multiprocessing_context="fork")
    assert list(loader) == want


def test_the_caches_of_a_process_share_one_client_with_a_pool_for_what_it_asks_at_once(
    s3, cache, s3_train_cache, tmp_path
):
    """A mixture's caches (same scheme and storage.options) share one filesystem, so one S3 client a process (50 ms
    of CPU each); its pool holds storage.POOL_CONNECTIONS, not botocore's 10. Other options, skip_instance_cache, or
    another endpoint in the environment get their own."""
    from theworld.cache_format import storage

    def fs(url: str, **options):
        return cf.CacheReader(url, settings=cf.Settings(options, local_dir=str(tmp_path / "l"))).remote.fs

    other = _put_tree(s3, cache, "other")
    shared = fs(s3_train_cache)
    assert fs(other) is shared and shared.config_kwargs["max_pool_connections"] == storage.POOL_CONNECTIONS
    assert fs(other, skip_instance_cache=True) is not shared
    assert fs(other, config_kwargs={"read_timeout": 30}) is not shared
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    with pytest.MonkeyPatch.context() as env:  # another endpoint (a server started since): another client
        env.setenv("AWS_ENDPOINT_URL", endpoint + "/")
        assert fs(other) is not shared
    assert fs(other) is shared


@pytest.mark.slow
def test_two_processes_precompute_to_s3_the_shards_of_one(s3, s3_cache, tmp_path):
    """Shard i goes to rank i % 2 on one node (one stand-in folder); rank 0 writes the manifest from both ranks'
    shards: the same shards and samples as one process's (bytes may differ in the last bits: these processes run
    with OMP_NUM_THREADS=1)."""
    target = url("two")
    done = run2(cli_args(target, f"storage.local_dir={tmp_path / 'local'}"), s3.env, module="precompute.cosmos_latents")  # type: ignore[arg-type]
    assert done.returncode == 0, done.stderr[-3000:]
    two = json.loads(s3.fs.cat_file(f"{BUCKET}/two/manifest.json"))
    one = json.loads(s3.fs.cat_file(f"{BUCKET}/pre/manifest.json"))
    assert (two["num_shards"], two["num_samples"]) == (one["num_shards"], one["num_samples"])
    a = cf.CacheReader(target, settings=cf.Settings(local_dir=str(tmp_path / "read")))
    a.check_consistency()
    b = cf.CacheReader(s3_cache[0])
    assert a.shard_table.count.tolist() == b.shard_table.count.tolist()
    assert [(a.key(i), a.sample(i).caption) for i in range(len(a))] == [
        (b.key(i), b.sample(i).caption) for i in range(len(b))
    ]


def _record(s3, prefix: str) -> dict:
    return json.loads(s3.fs.cat_file(f"{BUCKET}/{prefix}/{cf.RUN_FILE}"))


def test_a_second_precompute_into_one_prefix_at_once_is_refused_before_it_writes_a_shard(
    s3, tmp_path, capsys, monkeypatch
):
    """Run B (seed 1) checks the prefix (empty), then run A (seed 0, another node: its own storage.local_dir) claims it
    and finishes before B claims: B's claim (an exclusive create) finds A's record and B stops in one line naming the
    setting, having put no shard; the bucket holds A's cache whole."""
    from precompute import cosmos_latents, identity, pipeline

    target, claim_output = url("race"), identity.claim_output

    def a_claims_first(out, run_id):
        monkeypatch.setattr(identity, "claim_output", claim_output)  # run A claims as usual
        pipeline.run(make_cfg(target, "seed=0", f"storage.local_dir={tmp_path / 'a'}", n=8))  # type: ignore[arg-type]
        capsys.readouterr()
        s3.mark = len(s3.log)
        claim_output(out, run_id)

    monkeypatch.setattr(identity, "claim_output", a_claims_first)
    assert cosmos_latents.main(cli_args(target, "seed=1", f"storage.local_dir={tmp_path / 'b'}", n=8)) == 2  # type: ignore[arg-type]
    err = capsys.readouterr().err.strip()
    assert err == (
        f"error: output_dir {target}: another precompute claimed it while this one ran (its {cf.RUN_FILE} has a "
        "different source.seed); two runs must not write one prefix: give this one another output_dir"
    ), err
    puts = [p for m, p, _ in s3.log[s3.mark :] if m == "PUT" and "/race/" in p]
    assert puts == [f"/{BUCKET}/race/{cf.RUN_FILE}"], puts  # the refused create only: no shard, no manifest
    assert _record(s3, "race")["source"]["seed"] == 0
    manifest = json.loads(s3.fs.cat_file(f"{BUCKET}/race/manifest.json"))
    assert manifest["config"]["seed"] == 0


def test_a_run_record_replaced_during_the_run_is_refused_before_the_manifest(s3, tmp_path, capsys, monkeypatch):
    """A store that ignores exclusive creates lets a second run's record replace this run's after its claim: the
    check before the manifest refuses in one line, and no manifest.json calls the mixed prefix complete."""
    from precompute import cosmos_latents, identity

    target, claim_remote = url("replaced"), identity.claim_remote

    def then_another_run_puts_its_record(remote, out):
        claim_remote(remote, out)
        other = {**_record(s3, "replaced"), "shard_size": 3}
        s3.fs.pipe_file(f"{BUCKET}/replaced/{cf.RUN_FILE}", json.dumps(other).encode())

    monkeypatch.setattr(identity, "claim_remote", then_another_run_puts_its_record)
    assert cosmos_latents.main(cli_args(target, f"storage.local_dir={tmp_path / 'l'}", n=8)) == 2  # type: ignore[arg-type]
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: output_dir {target}: another precompute claimed it while this one ran"), err
    assert "different shard_size" in err[-1]
    assert not s3.fs.exists(f"{BUCKET}/replaced/manifest.json")


def test_opening_an_s3_cache_gets_each_small_object_once_and_lists_nothing(s3, s3_cache):
    """Before a first batch every round trip counts: a small object is one GET (no HEAD for its size first), and
    the start-of-run check lists no shard (a request per 1,000 objects, one after another: minutes at DataComp
    size), so the open's requests do not grow with the cache."""
    _, remote, _ = s3_cache
    start = len(s3.log)
    reader = cf.CacheReader(remote, settings=cf.Settings(local_dir=local_dir(s3, "open")))
    reader.check_consistency()
    log = [(m, p) for m, p, _ in s3.log[start:]]
    assert not [p for m, p in log if m == "HEAD"]
    assert [p for m, p in log if p.endswith("/manifest.json")] == [f"/{BUCKET}/pre/manifest.json"]
    assert not [p for m, p in log if m == "GET" and p.rstrip("/") == f"/{BUCKET}"]  # ListObjects: the bucket's path
    assert len(log) <= 5 and len(reader) == 20  # manifest, errors, run record, the index's first bytes


@pytest.mark.parametrize("workers", [0, 2])
def test_a_shard_deleted_from_the_bucket_stops_training_in_one_line_naming_it(s3, cache, tmp_path, capsys, workers):
    """Not listed at the start, a shard gone from the bucket is found when it is first read (here or in a loader
    worker): one line that names the object and the repair, exit 2."""
    remote = _put_tree(s3, cache, f"deleted{workers}")
    s3.fs.rm_file(f"{BUCKET}/deleted{workers}/shards/shard-000001.tar")
    held = {"train.eval.samples": 48, "train.eval.every": 0, "train.eval.captions": 0}
    held["train.loader.num_workers"] = workers
    code = train_inproc(_train_args(s3, remote, tmp_path / "run", 3, str(tmp_path / "sc"), **held))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert err[-1].startswith(f"error: {remote}/shards/shard-000001.tar: not found"), err[-3:]
    assert "rerun the precompute command" in err[-1] and "Traceback" not in "\n".join(err)


def _node_epoch(s3, local: Path, rank: int, *sets: str) -> tuple[set[str], set[str], str]:
    """One node's epoch (process `rank` of two, its own shard cache `local`) through the training loader, windows of
    2 shards: the shard objects it downloaded and those its samples are in, as '<prefix>/shards/shard-NNNNNN.tar',
    and its mixture's start line."""
    from transformers import AutoProcessor

    from tests.conftest import train_config
    from theworld.model import encoders
    from train.data import cache as data
    from train.data.loader import DataContext, build_train_loader
    from train.data.order import shards_of

    processor = AutoProcessor.from_pretrained(encoders.resolve_gemma("tiny"))
    cfg = train_config(
        *sets,
        f"storage.local_dir={local}",
        "storage.shuffle_window=2",
        "train.global_batch_size=16",
        "train.micro_batch_size=8",
        "train.eval.samples=16",
        "train.loader.num_workers=0",
        "model.dtype=float32",
    )
    reader, inputs = data.open_cache(cfg)
    ctx = DataContext.build(cfg, reader, inputs, processor)
    start = len(s3.log)
    batches = build_train_loader(cfg, ctx, rank, 2, epoch=0)
    assert batches.dataset.read_ahead.shards is not None  # a mixture's shards are read ahead too
    readers = getattr(reader, "readers", [reader])
    firsts = np.cumsum([0] + [len(r.shard_table) for r in readers])
    shards = shards_of(reader, batches.dataset.indices)
    of = np.searchsorted(firsts, shards, side="right") - 1
    read = {
        f"{readers[c].remote.url.split('/', 3)[3]}/shards/shard-{s - firsts[c]:06d}.tar"
        for c, s in zip(of.tolist(), shards.tolist())
    }
    assert sum(1 for _ in batches) == len(batches.dataset.indices) // 8
    got = {p.split("/", 2)[2] for p in s3.downloads(start, r"/shards/shard-\d+\.tar$")}
    return got, read, ctx.describe_mixture(cfg)


def test_with_node_groups_two_nodes_download_disjoint_shards_of_a_cache_in_a_bucket(s3, s3_train_cache, tmp_path):
    """storage.node_groups 2 on two nodes (a process each, each with its own shard cache): each node downloads the
    shards of its part of every batch and no other, so together they download the epoch's shards once; without
    groups each node downloads every shard."""

    def node(rank: int, groups: int) -> tuple[set[str], set[str]]:
        where = f"cache_dir={s3_train_cache}", f"storage.node_groups={groups}"
        return _node_epoch(s3, tmp_path / f"g{groups}-node{rank}", rank, *where)[:2]

    grouped = [node(r, 2) for r in range(2)]
    assert all(got == read for got, read in grouped)  # each node downloads what its part reads, nothing more
    assert not grouped[0][0] & grouped[1][0] and grouped[0][0] and grouped[1][0]
    plain = [node(r, 1)[0] for r in range(2)]
    assert plain[0] == plain[1] == {f"train/shards/shard-{i:06d}.tar" for i in range(3)}


def test_parts_of_a_dataset_in_a_bucket_read_ahead_and_split_between_node_groups(s3, cache, tmp_path):
    """A dataset in two parts (weight `samples` on each) on two nodes with storage.node_groups 2: each node downloads
    the shards of its part of every batch, read ahead, across both parts, and no other."""
    urls = [_put_tree(s3, cache, f"part{i}") for i in range(2)]
    data = "data=[" + ", ".join(f"{{cache: {u}, weight: samples}}" for u in urls) + "]"
    grouped = [_node_epoch(s3, tmp_path / f"node{r}", r, data, "storage.node_groups=2") for r in range(2)]
    assert all(got == read for got, read, _ in grouped), grouped
    assert not grouped[0][0] & grouped[1][0]
    assert {p[:5] for p in grouped[0][0] | grouped[1][0]} == {"part0", "part1"}
    # the caches as the config names them, not their stand-in folders
    # 16 held out of both: a key and its copy have one sha256, so 8 of each
    assert f"; {urls[0]} 88 samples; {urls[1]} 88 samples" in grouped[0][2], grouped[0][2]
