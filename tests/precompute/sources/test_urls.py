"""source.type=urls: url + caption tables downloaded with img2dataset from a local HTTP server on 127.0.0.1 (served
images, 404s, broken files, images too small, an answer slower than the timeout), then encoded."""

from __future__ import annotations

import http.server
import json
import os
import threading
import time
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from precompute import cosmos_latents, pipeline
from tests._precompute_helpers import gradient, jpeg_bytes, make_cfg, png_bytes, read_cache_plain
from theworld import cache_format as cf
from theworld.core.errors import UserError

pytest.importorskip("img2dataset")  # installed by `make install` (scripts/lock.py requirements img2dataset)

SLOW_S = 3  # the slow route answers after this; the runs below time out after 1 s


class _Images(http.server.BaseHTTPRequestHandler):
    """/jpg/N and /png/N: a gradient picture (size from N); /small/N: 8x8; /broken/N: text; /slow/N: a picture after
    SLOW_S seconds; anything else 404. Every request is counted by path."""

    counts: Counter = Counter()
    lock = threading.Lock()

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        with self.lock:
            self.counts[self.path] += 1
        kind, _, n = self.path.split("?")[0].strip("/").partition("/")
        size = 40 + int(n or 0) % 8
        body = {
            "jpg": lambda: jpeg_bytes(gradient(size, 36)),
            "png": lambda: png_bytes(gradient(36, size)),
            "small": lambda: png_bytes(gradient(8, 8)),
            "broken": lambda: b"<html>not an image</html>",
        }.get(kind)
        if kind == "slow":
            time.sleep(SLOW_S)
            body = lambda: jpeg_bytes(gradient(40, 40))
        if body is None:
            self.send_error(404)
            return
        data = body()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        try:
            self.wfile.write(data)
        except OSError:  # the client gave up (the slow route)
            pass

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def _requests(prefix: str) -> int:
    with _Images.lock:
        return sum(n for p, n in _Images.counts.items() if p.startswith(prefix))


def _fast(*overrides: str) -> list[str]:
    return [
        "source.type=urls",
        "source.img2dataset.timeout=1",
        "source.img2dataset.thread_count=8",
        *overrides,
    ]


# rows of a DataComp-style table: (uid, route, caption); the reason each bad one is recorded with
DATACOMP = [
    ("a0", "jpg/0", "a red square"),
    ("a1", "missing/1", "gone"),
    ("a2", "png/2", "a gradient"),
    ("a3", "broken/3", "an html page"),
    ("a4", "slow/4", "too slow"),
    ("a5", "small/5", "a tiny picture"),
    ("a6", "jpg/6", "another one"),
]
REASONS = {
    "a1": "img2dataset failed_to_download: HTTP Error 404: Not Found",
    "a3": "img2dataset failed_to_resize: Image decoding error",
    "a4": "img2dataset failed_to_download:",  # then urllib's "timed out" text
    "a5": "img2dataset failed_to_resize: image too small",
}


@pytest.mark.slow
def test_a_datacomp_table_downloads_encodes_records_failures_and_reruns_without_work(tmp_path, server, fake_vae):
    table = tmp_path / "datacomp.parquet"
    pq.write_table(
        pa.table(
            {
                "uid": [u for u, _, _ in DATACOMP],
                "url": [f"{server}/{r}?{tmp_path.name}" for _, r, _ in DATACOMP],
                "text": [c for _, _, c in DATACOMP],
                "clip_l14_similarity_score": [0.3] * len(DATACOMP),
            }
        ),
        table,
    )
    out = tmp_path / "cache"
    cfg = make_cfg(
        out,
        *_fast(f"source.path={table}", "source.img2dataset.number_sample_per_shard=4"),
        "source.img2dataset.min_image_size=16",
        "source.num_samples=null",
        shard=2,
    )
    result = pipeline.run(cfg)
    assert result["num_samples"] == 3 and result["num_errors"] == 4
    cache = read_cache_plain(out)
    assert list(cache) == ["a0", "a2", "a6"]  # table order, whatever order the downloads finished in
    assert cache["a0"]["txt"] == b"a red square"
    meta = json.loads(cache["a6"]["json"])
    assert meta["uid"] == "a6" and meta["url"] == f"{server}/jpg/6?{tmp_path.name}"
    assert cache["a0"][cf.IMAGE] == jpeg_bytes(gradient(40, 36))  # the served JPEG's bytes, not re-encoded
    errors = {e["key"]: e for e in cf.read_errors(out)}
    assert set(errors) == set(REASONS)
    for key, reason in REASONS.items():
        assert errors[key]["reason"].startswith(reason), errors[key]
    assert "timed out" in errors["a4"]["reason"]
    assert errors["a1"]["reason"].endswith(f"(url {server}/missing/1?{tmp_path.name})")
    assert errors["a1"]["source"] == "datacomp.parquet:1"
    staged = sorted(p.name for p in (out / "staging" / "table-00000").iterdir())
    assert staged == [f"0000{s}{x}" for s in (0, 1) for x in (".parquet", ".tar", "_stats.json")]
    # the objects --plan counts: what the cache holds besides the staging folder, the source's listing and the lock
    from precompute import sizing

    objects = [
        p
        for p in out.rglob("*")
        if p.is_file() and not {"staging", cf.INDEX_DIR} & set(p.relative_to(out).parts) and p.name != ".run.lock"
    ]
    assert len(objects) == sizing.objects(result["num_shards"], cfg.shard_size), "\n".join(
        sorted(str(p.relative_to(out)) for p in objects)
    )

    fetched = _requests("/")
    again = pipeline.run(cfg)
    assert _requests("/") == fetched  # nothing downloaded again
    assert again["summary"]["encoded_this_run"] == 0  # nothing encoded again
    assert read_cache_plain(out) == cache


@pytest.mark.slow
def test_a_laion_jsonl_table_without_ids_keys_rows_by_position_and_num_samples_cuts_rows(tmp_path, server, fake_vae):
    table = tmp_path / "laion.jsonl"
    rows = [{"URL": f"{server}/jpg/{i}?{tmp_path.name}", "TEXT": f"picture {i}", "WIDTH": 40} for i in range(5)]
    table.write_text("".join(json.dumps(r) + "\n" for r in rows))
    staging = f"source.staging_dir={tmp_path / 'staging'}"
    per_shard = "source.img2dataset.number_sample_per_shard=2"
    cfg = make_cfg(tmp_path / "three", *_fast(f"source.path={table}", staging, per_shard), n=3, shard=2)
    result = pipeline.run(cfg)
    assert result["num_samples"] == 3 and result["num_errors"] == 0
    cache = read_cache_plain(tmp_path / "three")
    assert list(cache) == ["laion-000000000", "laion-000000001", "laion-000000002"]
    assert [cache[k]["txt"] for k in cache] == [b"picture 0", b"picture 1", b"picture 2"]
    fetched = [_requests(f"/jpg/{i}?{tmp_path.name}") for i in range(5)]
    assert fetched == [1, 1, 1, 0, 0]  # rows past num_samples are not downloaded

    # all rows, from the same staging folder: the staged shard cut short (row 2 alone) is downloaded again with row 3
    cfg = make_cfg(tmp_path / "all", *_fast(f"source.path={table}", staging, per_shard), n=5, shard=2)
    assert pipeline.run(cfg)["num_samples"] == 5
    assert list(read_cache_plain(tmp_path / "all"))[3:] == ["laion-000000003", "laion-000000004"]
    assert [_requests(f"/jpg/{i}?{tmp_path.name}") for i in range(5)] == [1, 1, 2, 1, 1]


def _table(tmp_path: Path, **columns) -> Path:
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table(columns), path)
    return path


@pytest.mark.parametrize(
    "make, overrides, words",
    [
        (
            lambda p: _table(p, uid=["x"], link=["http://127.0.0.1:9/a"], text=["c"]),
            [],
            ["source.url_column", "no url column", "uid, link, text"],
        ),
        (
            lambda p: _table(p, uid=["x"], url=["http://127.0.0.1:9/a"], alt=["c"]),
            [],
            ["source.caption_column", "uid, url, alt"],
        ),
        (
            lambda p: _table(p, url=["http://127.0.0.1:9/a"], text=["c"]),
            ["source.url_column=URL"],
            ["source.url_column", "no column 'URL'", "url, text"],
        ),
        (
            lambda p: _table(p, url=[1], text=["c"]),
            [],
            ["source.url_column", "not text"],
        ),
        (
            lambda p: (p / "t.parquet").write_bytes(b"PAR1 not really") and p / "t.parquet",
            [],
            ["source.path", "not a readable parquet table"],
        ),
        (
            lambda p: (p / "t.jsonl").write_text('{"url": "a", "text": "b"}\n{oops\n') and p / "t.jsonl",
            [],
            ["source.path", "not a readable jsonl table"],
        ),
        (lambda p: p / "nothing.parquet", [], ["source.path", "table not found"]),
        (  # a picture on this machine's disk, named by a file:// URL among web ones: refused, never read
            lambda p: (
                (p / "secret.png").write_bytes(png_bytes(gradient(40, 40)))
                and _table(p, url=["http://127.0.0.1:9/a", f"FILE://{p / 'secret.png'}"], text=["c", "d"])
            ),
            [],
            ["source.path", "row 1 has a local URL (FILE://", "source.type: folder"],
        ),
        (lambda p: os.mkfifo(p / "t.parquet") or p / "t.parquet", [], ["source.path", "a FIFO"]),
        (lambda p: p, [], ["source.path", "no .parquet or .jsonl tables"]),
    ],
)
def test_a_bad_table_is_one_line_naming_the_cause(tmp_path, make, overrides, words, capsys):
    path = make(tmp_path)
    argv = ["--set", f"output_dir={tmp_path / 'cache'}", "--set", "source.type=urls", "--set", f"source.path={path}"]
    argv += [a for o in overrides for a in ("--set", o)]
    assert cosmos_latents.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ")
    for w in words:
        assert w in err, err
    assert not (tmp_path / "cache" / "staging" / "table-00000").exists()  # nothing downloaded


def test_url_options_belong_to_the_urls_source(tmp_path):
    with pytest.raises(UserError, match="source.url_column.*only used by source.type=urls"):
        make_cfg(tmp_path, "source.type=folder", "source.url_column=URL")
    with pytest.raises(UserError, match="source.img2dataset.timeout.*positive"):
        make_cfg(tmp_path, "source.type=urls", "source.img2dataset.timeout=0")


@pytest.mark.slow
def test_plan_downloads_a_sample_of_rows_and_extrapolates_to_a_table_of_given_size(tmp_path, server, capsys):
    from precompute import sizing

    table = tmp_path / "datacomp.jsonl"
    rows = [{"uid": u, "url": f"{server}/{r}?{tmp_path.name}", "text": c} for u, r, c in DATACOMP]
    table.write_text("".join(json.dumps(r) + "\n" for r in rows))
    n = 1_400_000_000
    argv = ["--plan", "--set", f"output_dir={tmp_path / 'cache'}", "--set", "shard_size=1024"]
    for o in _fast(f"source.path={table}", f"source.num_samples={n}", "source.img2dataset.min_image_size=16"):
        argv += ["--set", o]
    assert cosmos_latents.main(argv) == 0
    text = capsys.readouterr().out
    usable = round(n * 3 / 7)  # 3 of the 7 sampled rows download and decode
    shards = -(-n // 1024)
    assert f"{n} rows (extrapolated from a table of 7), 42.9% usable = {usable} samples" in text
    parts = -(-shards // 4096)  # shard-index parts of 4,096 shards
    assert f"objects: {3 * shards + 4 + parts} ({shards} shards x 3" in text  # + the cache's 4 (its shard table)
    gpu_hours = usable / sizing.IMAGES_PER_S_PER_GPU / 3600
    assert f"encode time: {round(gpu_hours, 1):g} GPU-hours = {round(gpu_hours / 8, 1):g} node-hours" in text
    assert not (tmp_path / "cache").exists()  # a plan writes nothing
    assert _requests(f"/jpg/0?{tmp_path.name}") == 1


def test_a_staging_dir_that_cannot_be_written_is_one_line(tmp_path, capsys):
    table = _table(tmp_path, uid=["x"], url=["http://127.0.0.1:9/a.jpg"], text=["c"])
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    argv = ["--set", f"output_dir={tmp_path / 'cache'}", "--set", "source.type=urls", "--set", f"source.path={table}"]
    argv += ["--set", f"source.staging_dir={blocker / 'staging'}"]
    assert cosmos_latents.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "source.staging_dir" in err and str(blocker) in err, err


def test_download_speed_and_place_do_not_change_what_a_rerun_must_match(tmp_path):
    from precompute.identity import layout_identity

    base = ("source.type=urls", "source.path=t.parquet")
    one = layout_identity(make_cfg(tmp_path, *base, "source.img2dataset.thread_count=3"))
    assert one == layout_identity(
        make_cfg(tmp_path, *base, "source.img2dataset.processes_count=9", f"source.staging_dir={tmp_path}")
    )
    assert one != layout_identity(make_cfg(tmp_path, *base, "source.img2dataset.resize_mode=keep_ratio"))
    # caches of other sources, written before urls existed, recorded no img2dataset section: still resumable
    assert "img2dataset" not in layout_identity(make_cfg(tmp_path))["source"]
