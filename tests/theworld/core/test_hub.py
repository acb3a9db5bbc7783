"""The Hub: hub repo ids load offline from a Hugging Face cache in huggingface_hub's own layout (from_pretrained,
describe, evaluate, init_from), a one-line error naming an id that is not there; uploads run in the background (the
file list, a slow or failing endpoint never stops or slows training, a failure is retried at the next save); a run
against a local stand-in of the Hub's write API commits once per save with `hub.strategy: every_save`, final/ only
with `end`.

Not testable here (no hub on these machines): an upload to and a download from huggingface.co itself."""

from __future__ import annotations

import base64
import hashlib
import http.server
import json
import shutil
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import base_args
from theworld.core import hub
from theworld.core.errors import UserError

REPO = "someone/theworld-stage1"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hf_cache(root: Path, repo: str, files: dict[str, Path], revision: str = "main") -> Path:
    """`files` (name -> local file) as huggingface_hub lays out a downloaded snapshot: content-addressed blobs,
    snapshots/<commit>/<name> symlinks to them, refs/<revision> naming the commit."""
    from huggingface_hub.file_download import repo_folder_name

    folder = root / repo_folder_name(repo_id=repo, repo_type="model")
    for name, src in files.items():
        data = Path(src).read_bytes()
        blob = folder / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = folder / "snapshots" / COMMIT / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(Path(*[".."] * (2 + name.count("/"))) / "blobs" / blob.name)  # a name in a folder: deeper
    (folder / "refs").mkdir(exist_ok=True)
    (folder / "refs" / revision).write_text(COMMIT)
    return folder


@pytest.fixture
def cached_stage(trained_run, tmp_path, monkeypatch):
    """trained_run's final/ in a Hugging Face cache under tmp_path, as hub repo REPO; offline."""
    import huggingface_hub.constants as constants
    from huggingface_hub import scan_cache_dir

    final = trained_run["run"] / "final"
    cache = tmp_path / "hf-cache"
    hf_cache(cache, REPO, {p.name: p for p in final.iterdir()})
    info = scan_cache_dir(cache)  # huggingface_hub itself reads the layout back
    assert not info.warnings and [r.repo_id for r in info.repos] == [REPO]
    assert {f.file_name for r in info.repos for rev in r.revisions for f in rev.files} == {
        p.name for p in final.iterdir()
    }
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return {**trained_run, "hf_cache": cache, "final": final}


def test_a_local_folder_wins_over_a_hub_id(tmp_path, monkeypatch):
    (tmp_path / "user" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert hub.resolve("user/name") == Path("user/name")


def test_a_stage_loads_by_hub_id_from_the_cache_with_the_same_weights(cached_stage):
    import torch

    from theworld.model.world import TheWorld
    from train.state import checkpoint

    by_id, _ = TheWorld.from_pretrained(REPO, device="cpu")
    by_path, _ = TheWorld.from_pretrained(cached_stage["final"], device="cpu")
    a, b = by_id.trainable_state_dict(), by_path.trainable_state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    weights = checkpoint.resolve_weights(f"{REPO}@main")  # init_from
    assert weights.name == "trainable.safetensors" and COMMIT in str(weights)


def test_evaluate_accepts_a_hub_id(cached_stage, capsys):
    from theworld.evaluate import main

    assert main(["--model", REPO, "--data", str(cached_stage["mc"]), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == REPO and out["n"] == 6


def test_describe_accepts_a_hub_id_and_an_absent_one_is_one_line(cached_stage, tmp_path, capsys):
    from PIL import Image

    from theworld.describe import main

    img = tmp_path / "a.png"
    Image.new("RGB", (64, 64), (200, 30, 30)).save(img)
    # in process: cached_stage points huggingface_hub's cache at the stage's copy, as HF_HUB_CACHE would
    assert main(["--model", REPO, "--image", str(img), "--max-new-tokens", "3"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1  # stdout: the text alone
    assert main(["--model", "someone/not-there", "--image", str(img)]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "someone/not-there" in err and "not in the local Hugging Face cache" in err


def test_an_absent_id_and_an_absent_revision_are_one_line_errors(cached_stage):
    from theworld.model.world import TheWorld

    with pytest.raises(UserError, match="someone/other.*not in the local Hugging Face cache"):
        TheWorld.from_pretrained("someone/other")
    with pytest.raises(UserError, match=f"{REPO}@v9"):
        hub.resolve(f"{REPO}@v9")


# ----------------------------------------------------------------------------------------------------------------------
# uploads


class FakeHub:
    """Stands in for HfApi's network calls: records each upload's files, optionally slow or failing."""

    def __init__(self, delay: float = 0.0, fail: int = 0):
        self.delay, self.fail, self.uploads, self.repos = delay, fail, [], []
        self.started = threading.Event()

    def install(self, monkeypatch):
        from huggingface_hub import HfApi

        fake = self

        def create_repo(self, repo_id, private=False, exist_ok=False, **kw):
            fake.repos.append((repo_id, private))

        def upload_folder(self, repo_id, folder_path, commit_message=None, **kw):
            fake.started.set()
            time.sleep(fake.delay)
            if fake.fail:
                fake.fail -= 1
                raise ConnectionError("hub unreachable")
            fake.uploads.append((repo_id, commit_message, sorted(p.name for p in Path(folder_path).iterdir())))

        monkeypatch.setattr(HfApi, "create_repo", create_repo)
        monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
        return self


class LocalHub(http.server.ThreadingHTTPServer):
    """The Hub's write API as huggingface_hub's HfApi calls it for small files, on 127.0.0.1: create_repo, then
    upload_folder's preupload (every file a regular upload), a README.md's metadata check, and commit (an NDJSON header
    and base64 files). Each commit is recorded as (message, {path: bytes})."""

    def __init__(self):
        self.commits: list[tuple[str, dict[str, bytes]]] = []
        self.repos: list[dict] = []
        super().__init__(("127.0.0.1", 0), LocalHubHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_port}"


class LocalHubHandler(http.server.BaseHTTPRequestHandler):
    server: LocalHub

    def _reply(self, obj: dict, code: int = 200) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path == "/api/repos/create":
            repo = json.loads(body)
            self.server.repos.append(repo)
            return self._reply({"url": f"{self.server.endpoint}/{repo['organization']}/{repo['name']}"})
        if self.path == "/api/validate-yaml":  # a README.md's metadata
            return self._reply({"warnings": []})
        if "/preupload/" in self.path:
            files = json.loads(body)["files"]
            return self._reply(
                {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]}
            )
        if "/commit/" in self.path:
            lines = [json.loads(ln) for ln in body.splitlines() if ln.strip()]
            message = next(ln["value"]["summary"] for ln in lines if ln["key"] == "header")
            files = {
                ln["value"]["path"]: base64.b64decode(ln["value"]["content"]) for ln in lines if ln["key"] == "file"
            }
            self.server.commits.append((message, files))
            oid = hashlib.sha1(body).hexdigest()
            repo = self.path.split("/api/models/", 1)[1].split("/commit/", 1)[0]
            return self._reply({"commitUrl": f"{self.server.endpoint}/{repo}/commit/{oid}", "commitOid": oid})
        self._reply({"error": "not found"}, 404)

    def do_GET(self):
        self._reply({"error": "not found"}, 404)

    def log_message(self, *a):
        pass


def checkpoint_like(folder: Path) -> Path:
    folder.mkdir(parents=True)
    for name in ("trainable.safetensors", "config.yaml", "optimizer.pt", "rng.safetensors", "state.json"):
        (folder / name).write_bytes(b"x" * 10)
    return folder


def test_uploads_hold_the_model_files_only_and_never_wait(tmp_path, monkeypatch):
    from train.state.hub_upload import HubUploader

    fake = FakeHub(delay=1.0).install(monkeypatch)
    warnings = []
    up = HubUploader(REPO, True, warnings.append)
    ckpt = checkpoint_like(tmp_path / "checkpoint-2")
    t = time.perf_counter()
    up.submit(ckpt, "checkpoint-2")
    assert time.perf_counter() - t < 0.5  # the upload itself sleeps a second
    assert fake.started.wait(5)
    shutil.rmtree(ckpt)  # keep_last rotates it away mid-upload: the staged copy is still whole
    assert up.wait(10)
    assert fake.repos == [(REPO, True)]
    assert fake.uploads == [(REPO, "checkpoint-2", ["config.yaml", "trainable.safetensors"])]
    assert not warnings and not list(tmp_path.glob(".hub-*"))


def test_a_failed_upload_is_one_warning_and_the_next_save_goes_up(tmp_path, monkeypatch):
    from train.state.hub_upload import HubUploader

    fake = FakeHub(fail=1).install(monkeypatch)
    warnings = []
    up = HubUploader(REPO, False, warnings.append)
    up.submit(checkpoint_like(tmp_path / "checkpoint-2"), "checkpoint-2")
    assert up.wait(10)
    assert len(warnings) == 1 and "\n" not in warnings[0] and REPO in warnings[0] and "hub unreachable" in warnings[0]
    up.submit(checkpoint_like(tmp_path / "checkpoint-4"), "checkpoint-4")
    assert up.wait(10)
    assert [u[1] for u in fake.uploads] == ["checkpoint-4"] and len(warnings) == 1


def test_a_run_with_a_slow_failing_hub_endpoint_trains_on_and_says_so(cached_stage, tmp_path, monkeypatch, capsys):
    """A real HfApi against a local server that answers every request after a second with HTTP 500."""
    import http.server

    import huggingface_hub.constants as constants

    class Slow500(http.server.BaseHTTPRequestHandler):
        def _fail(self):
            time.sleep(1.0)
            self.send_response(500)
            self.end_headers()

        do_GET = do_POST = do_PUT = do_HEAD = _fail

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Slow500)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", "hf_fake_token_for_the_test")
    from train.loop import main

    out = tmp_path / "run"
    sets = {
        "train.global_batch_size": 8,
        "train.eval.samples": 8,
        "train.checkpoint.every": 1,
        "train.eval.captions": 0,
    }
    sets |= {"hub.model_id": "someone/run", "hub.strategy": "every_save"}
    t = time.perf_counter()
    try:
        assert main(base_args(cached_stage["cache"], out, steps=4, **sets)) == 0
    finally:
        server.shutdown()
    err = capsys.readouterr().err
    assert "upload it by hand: huggingface-cli upload someone/run" in err
    warnings = [ln for ln in err.splitlines() if "hub upload to someone/run failed" in ln]
    assert 1 <= len(warnings) <= 5  # one per attempt: saves at steps 1..4 while one upload is under way, then final
    assert "hf_fake_token" not in err and not any(
        "hf_fake_token" in p.read_text(errors="ignore") for p in out.rglob("*") if p.is_file()
    )
    assert (out / "final" / "trainable.safetensors").is_file()
    assert time.perf_counter() - t < 120


@pytest.mark.parametrize(
    "strategy,expected", [("every_save", ["checkpoint-2", "checkpoint-4", "final"]), ("end", ["final"])]
)
def test_every_save_uploads_each_checkpoint_and_end_only_final(trained_run, tmp_path, monkeypatch, strategy, expected):
    """A run against a local Hub: one commit per save (steps 2 and 4) and one for final/, each holding that folder's
    model files as they were saved."""
    import huggingface_hub.constants as constants

    from train.loop import main
    from train.state.hub_upload import MODEL_FILES

    server = LocalHub()
    monkeypatch.setattr(constants, "ENDPOINT", server.endpoint)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", "hf_fake_token_for_the_test")
    out = tmp_path / "run"
    sets = {
        "train.global_batch_size": 8,
        "train.eval.samples": 8,
        "train.checkpoint.every": 2,
        "train.eval.captions": 0,
    }
    sets |= {"hub.model_id": "someone/run", "hub.strategy": strategy, "hub.private": "true"}
    try:
        assert main(base_args(trained_run["cache"], out, steps=4, **sets)) == 0
    finally:
        server.shutdown()
        server.server_close()
    assert server.repos == [{"name": "run", "organization": "someone", "visibility": "private"}]
    assert [message for message, _ in server.commits] == expected
    for message, files in server.commits:
        folder = out / message
        assert set(files) == {p.name for p in folder.iterdir() if p.name in MODEL_FILES} >= {"trainable.safetensors"}
        assert all(files[name] == (folder / name).read_bytes() for name in files), message
