"""The lmms-eval adapter: `python -m lmms_eval --model theworld` on a local task (tests/lmms_task, data in a temporary
folder, no hub) gives what theworld's own scoring and generation give on the same items."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, one_error_line

pytest.importorskip("lmms_eval", reason="the eval extra (pip install .[eval]) is not installed")


ENTRY_POINT = "theworld.lmms_adapter:manifest"


def test_the_entry_point_lmms_eval_reads_is_declared():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["lmms_eval.models"] == {"theworld": ENTRY_POINT}
    assert any(d.startswith(("lmms-eval", "lmms_eval")) for d in project["optional-dependencies"]["eval"])


def _task_folder(root: Path, items) -> Path:
    """The local task with its data file: one JSON line per item, the image as an absolute path."""
    tasks = root / "tasks"
    shutil.copytree(ROOT / "tests" / "lmms_task", tasks)
    data = root / "items.jsonl"
    data.write_text(
        "".join(
            json.dumps(
                {
                    "image": str(Path(it.images[0]).resolve()),
                    "question": it.question,
                    "choices": it.choices,
                    "answer": it.answer,
                }
            )
            + "\n"
            for it in items
        )
    )
    for name in ("gen.yaml", "loglik.yaml"):
        (tasks / name).write_text((tasks / name).read_text().replace("DATA_FILE", str(data)))
    return tasks


def _entry_point(root: Path) -> Path:
    """What `pip install .[eval]` registers, without installing: a distribution's metadata on the path."""
    meta = root / "ep" / "theworld_lmms_check-0.dist-info"
    meta.mkdir(parents=True)
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: theworld-lmms-check\nVersion: 0\n")
    (meta / "entry_points.txt").write_text(f"[lmms_eval.models]\ntheworld = {ENTRY_POINT}\n")
    return meta.parent


def _task_module():
    sys.path.insert(0, str(ROOT / "tests" / "lmms_task"))
    try:
        import utils
    finally:
        sys.path.pop(0)
    return utils


def _reference_generate(model, docs: list[dict]) -> tuple[list[str], float]:
    """Each doc's answer from TheWorld.generate with the task's prompt, and the accuracy of the task's letter rule."""
    task = _task_module()
    answers = model.generate([d["image"] for d in docs], [task.doc_to_text(d) for d in docs], max_new_tokens=16)
    right = [task.read_letter(a, len(d["choices"])) == d["answer"] for a, d in zip(answers, docs)]
    return answers, sum(right) / len(docs)


def _text(resps) -> str:
    """A logged response: the text itself (the samples file) or in a one-element list (in process)."""
    return resps[0] if isinstance(resps, list) else resps


@pytest.fixture(scope="module")
def bundled_task_index(tmp_path_factory) -> Path:
    """Where the module's `python -m lmms_eval` runs share the index of lmms-eval's bundled tasks
    (tests/_lmms_eval_cli.py): the first run builds it."""
    return tmp_path_factory.mktemp("lmms") / "bundled_task_index.json"


def lmms_eval_cli(
    tmp_path, index: Path, tasks, model_args: str, task_names: str, *extra: str
) -> subprocess.CompletedProcess:
    """`python -m lmms_eval --model theworld` on the local tasks, offline, the adapter found through its entry point:
    a process of its own (its exit code, stdout and stderr), forked from tools/ranks.py's server, which imported torch
    and transformers once (tests/_lmms_eval_cli.py)."""
    from tools import ranks

    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "HF_DATASETS_CACHE": str(tmp_path / "hf_datasets"),
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(_entry_point(tmp_path))]),
        "LMMS_TASK_INDEX": str(index),
    }
    args = ["--model", "theworld", "--model_args", model_args, "--tasks", task_names, "--include_path", str(tasks)]
    args += ["--batch_size", "1", "--output_path", str(tmp_path / "out"), *extra]
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    process = ranks.start("tests._lmms_eval_cli", args, env, tmp_path, str(out), str(err))
    process.join(900)
    if process.exitcode is None:
        process.kill()
        process.join()
    return subprocess.CompletedProcess(["lmms_eval", *args], process.exitcode, out.read_text(), err.read_text())


@pytest.mark.slow
def test_python_m_lmms_eval_runs_the_adapter_and_agrees_with_theworld(trained_run, bundled_task_index, tmp_path):
    from theworld.infer import benchmark_items
    from theworld.infer.scoring import evaluate
    from theworld.model.world import TheWorld

    items = benchmark_items.read(trained_run["mc"])
    tasks = _task_folder(tmp_path, items)
    run = lmms_eval_cli(
        tmp_path,
        bundled_task_index,
        tasks,
        f"pretrained={trained_run['run']},device=cpu",
        "theworld_local_generate,theworld_local_loglik",
        "--log_samples",
    )
    results = list((tmp_path / "out").rglob("*_results.json"))  # lmms-eval exits 0 after an error too
    assert run.returncode == 0 and len(results) == 1, run.stderr[-4000:]
    # and it logs an error it survives (a failed import of one of its own parts, a task it skipped) as a line only
    logged = [ln for ln in run.stderr.splitlines() if "| ERROR" in ln or "Traceback" in ln or "Error:" in ln]
    assert not logged, "\n".join(logged)[-4000:]
    got = json.loads(results[0].read_text())["results"]

    model, processor = TheWorld.from_pretrained(trained_run["run"], device="cpu")
    records = evaluate(model, processor, model.image_config, items)
    assert got["theworld_local_loglik"]["acc,none"] == pytest.approx(
        sum(r["pred"] == r["answer"] for r in records) / len(records)
    )
    docs = [json.loads(x) for x in (tmp_path / "items.jsonl").read_text().splitlines()]
    answers, accuracy = _reference_generate(model, docs)
    assert got["theworld_local_generate"]["accuracy,none"] == pytest.approx(accuracy)
    # and theworld.evaluate's generate protocol (same prompt, greedy, 16 new tokens, same letter rule) on the items
    protocol = evaluate(model, processor, model.image_config, items, protocol="generate")
    assert accuracy == pytest.approx(sum(r["pred"] == r["answer"] for r in protocol) / len(protocol))
    (samples,) = (tmp_path / "out").rglob("*_samples_theworld_local_generate.jsonl")
    logged = {s["doc_id"]: _text(s["filtered_resps"]) for s in map(json.loads, samples.read_text().splitlines())}
    assert [logged[k] for k in range(len(docs))] == answers


@pytest.mark.slow
def test_generate_until_gives_the_text_theworld_generates(tmp_path, monkeypatch):
    """The trained tiny run answers every prompt with an empty string; a tiny model with a random, untied output
    layer says something different for each item, so this compares text that can differ."""
    import torch
    from lmms_eval.evaluator import simple_evaluate
    from lmms_eval.tasks import TaskManager

    from theworld.infer import benchmark_items
    from theworld.lmms_adapter import TheWorldLMM
    from theworld.model.config import ModelConfig, WorldConfig
    from theworld.model.world import TheWorld

    model, processor = TheWorld.from_config(ModelConfig(dtype="float32"), WorldConfig())
    head = model.gemma.lm_head.weight
    model.gemma.lm_head.weight = torch.nn.Parameter(torch.randn(head.shape, generator=torch.Generator().manual_seed(0)))
    model.eval()
    monkeypatch.setattr(TheWorld, "from_pretrained", classmethod(lambda cls, path, **kw: (model, processor)))
    benchmark_items.make_synthetic(tmp_path / "mc" / "items.jsonl", 4)
    tasks = _task_folder(tmp_path, benchmark_items.read(tmp_path / "mc" / "items.jsonl"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))
    out = simple_evaluate(
        model=TheWorldLMM("unused"),
        tasks=["theworld_local_generate"],
        log_samples=True,
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False),  # the local task alone
    )
    docs = [json.loads(x) for x in (tmp_path / "items.jsonl").read_text().splitlines()]
    answers, accuracy = _reference_generate(model, docs)
    assert len(set(answers)) > 1 and all(answers)  # text worth comparing
    logged = {s["doc_id"]: _text(s["filtered_resps"]) for s in out["samples"]["theworld_local_generate"]}
    assert [logged[k] for k in range(len(docs))] == answers
    assert out["results"]["theworld_local_generate"]["accuracy,none"] == pytest.approx(accuracy)


@pytest.mark.slow
@pytest.mark.parametrize(
    "model_args, words",
    [("pretrained=MISSING", ["MISSING", "not a folder"]), ("pretrained=RUN,temperature=0", ["unknown model_args"])],
)
def test_lmms_eval_with_a_model_it_cannot_build_is_one_line_and_exit_2(
    trained_run, bundled_task_index, tmp_path, model_args, words
):
    """lmms-eval prints any Exception of a model's constructor as a traceback and exits 0, having evaluated nothing;
    the adapter's own refusal gets through it as one line and exit code 2."""
    from theworld.infer import benchmark_items

    tasks = _task_folder(tmp_path, benchmark_items.read(trained_run["mc"])[:1])
    missing = tmp_path / "no-run"
    model_args = model_args.replace("MISSING", str(missing)).replace("RUN", str(trained_run["run"]))
    run = lmms_eval_cli(tmp_path, bundled_task_index, tasks, model_args, "theworld_local_loglik")
    errors = [ln for ln in run.stderr.splitlines() if ln.startswith("error: theworld:")]
    assert run.returncode == 2 and len(errors) == 1, run.stderr[-4000:]
    assert all(w.replace("MISSING", str(missing)) in errors[0] for w in words), errors
    assert "Traceback" not in run.stderr


@pytest.mark.parametrize(
    "args, words",
    [
        ({"pretrained": "/no/such/run"}, ["/no/such/run"]),
        ({"pretrained": "RUN", "temperature": "0"}, ["unknown model_args temperature"]),
        ({}, ["pretrained=RUN"]),
    ],
)
def test_lmms_adapter_refuses_in_one_line_with_a_nonzero_exit(trained_run, args, words, capsys):
    pytest.importorskip("lmms_eval")
    from theworld.lmms_adapter import TheWorldLMM

    args = {k: str(trained_run["run"]) if v == "RUN" else v for k, v in args.items()}
    with pytest.raises(SystemExit) as e:
        TheWorldLMM(**args)
    assert e.value.code == 2
    one_error_line(capsys, "error: theworld:", *words)


@pytest.mark.parametrize("data", ["missing", "relative", "malformed"])
def test_a_task_whose_data_does_not_load_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys, data):
    """lmms-eval retries a task's failed data load five times, 2 s apart, then prints tenacity's RetryError around
    the cause as two tracebacks and goes on; under the adapter it is one line naming the task and the cause, and a
    local data file that does not exist is refused before any retry."""
    from lmms_eval.api.task import ConfigurableTask
    from lmms_eval.tasks import TaskManager, get_task_dict
    from loguru import logger
    from tenacity import wait_fixed

    from theworld import lmms_adapter

    # lmms-eval (loguru) and datasets (logging) write to the stderr they met first: here, to this test's, as in the
    # one process of a command line
    logger.remove()
    logger.add(lambda message: sys.stderr.write(message), level="WARNING")
    for handler in logging.getLogger("datasets").handlers:
        monkeypatch.setattr(handler, "stream", sys.stderr)
    # lmms-eval's own retries, without their 2 s waits; then the adapter's guard around them
    tries = []
    base = getattr(ConfigurableTask.download, "retried", ConfigurableTask.download)
    counted = base.retry_with(wait=wait_fixed(0), after=lambda state: tries.append(state.attempt_number))
    monkeypatch.setattr(ConfigurableTask, "download", counted)
    lmms_adapter._guard_task_data()
    monkeypatch.chdir(tmp_path)
    tasks = tmp_path / "tasks"
    shutil.copytree(ROOT / "tests" / "lmms_task", tasks)
    path = {"missing": str(tmp_path / "gone.jsonl"), "relative": "gone.jsonl", "malformed": str(tmp_path / "bad.jsonl")}
    (tmp_path / "bad.jsonl").write_text('{"image": "a.png", "question": \n')
    (tasks / "loglik.yaml").write_text((tasks / "loglik.yaml").read_text().replace("DATA_FILE", path[data]))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))
    with pytest.raises(SystemExit) as exit_:
        get_task_dict(["theworld_local_loglik"], TaskManager(include_path=str(tasks), include_defaults=False))
    assert exit_.value.code == 2
    line = one_error_line(capsys, "theworld_local_loglik")
    if data == "malformed":
        assert "after lmms-eval's retries" in line and "(from " in line and tries == [1, 2, 3, 4, 5]
    else:
        assert f"data file {path[data]} does not exist" in line and tries == []
        assert (f"read from {tmp_path}" in line) == (data == "relative")


def test_a_tasks_local_data_files_are_those_neither_urls_nor_globs():
    from theworld.lmms_adapter import _local_files

    files = {"test": ["a.json", "hf://datasets/x/y.json", Path("b.json")], "val": "https://h/c.json", "x": "d*.json"}
    assert _local_files(files) == ["a.json", "b.json"] and _local_files("e.json") == ["e.json"]
