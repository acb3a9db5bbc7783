"""train.report: the curves' data from metrics.jsonl (last record of a step, stages of one log, stages chained by
init_from), one self-contained HTML file whose inline images decode as PNGs, runs without metrics named, bad input in
one line, and the page as headless Chromium renders it (Debian's package: `make chromium` installs it)."""

from __future__ import annotations

import base64
import io
import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from tests.conftest import ROOT, metrics
from train import report
from train.report import main

TPS = {"tokens_per_s": 400.0, "padding_share": 0.25}  # the throughput the loop logs with each loss line
S1 = [  # a stage-1 log: evals at 0, 2, 4; step 3 logged twice (the interrupted run's line, then the resumed run's)
    {"step": 0, "eval_loss": 6.0, "eval_loss_shuffled_world": 6.25, "eval_gap": 0.25},
    {"step": 0, "samples": [{"caption": "a red square .", "own_world": "red", "shuffled_world": "blue", "image": ""}]},
    {"step": 1, "loss": 5.0, "lr": 0.01, "grad_norm": 1.0, "samples_per_s": 10.0, **TPS},
    {"step": 2, "loss": 4.0, "lr": 0.01, "grad_norm": 1.0, "samples_per_s": 10.0, **TPS},
    {"step": 2, "eval_loss": 4.5, "eval_loss_shuffled_world": 5.0},
    {"step": 2, "bench/items/n": 6, "bench/items/accuracy": 0.5, "bench/items/accuracy_shuffled_world": 0.25},
    {"step": 3, "loss": 9.75, "lr": 0.01, "grad_norm": 1.0, "samples_per_s": 10.0, **TPS},
    {"step": 3, "loss": 3.5, "lr": 0.01, "grad_norm": 1.0, "samples_per_s": 10.0, **TPS},
    {"step": 4, "loss": 3.0, "lr": 0.01, "grad_norm": 1.0, "samples_per_s": 10.0, **TPS},
    {"step": 4, "eval_loss": 3.25, "eval_loss_shuffled_world": 4.0},
    {
        "step": 4,
        "samples": [
            {
                "caption": "a red square .",
                "own_world": "a red square",
                "shuffled_world": "a blue circle",
                "image": "samples/0.png",
            }
        ],  # noqa: E501
    },
]
S2 = [
    {"step": 0, "eval_loss": 3.0, "eval_loss_shuffled_world": 4.5},
    {"step": 1, "loss": 2.5, **TPS},
    {"step": 2, "loss": float("nan"), **TPS},  # every step of the window skipped
    {"step": 3, "loss": 2.0, **TPS},
    {"step": 3, "eval_loss": 2.25, "eval_loss_shuffled_world": 4.25},
]


def write_run(folder: Path, records: list[dict], init_from: str | None = None) -> Path:
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if init_from is not None:
        (folder / "final").mkdir()
        (folder / "final" / "config.yaml").write_text(yaml.safe_dump({"init_from": init_from, "output_dir": "x"}))
    return folder


def data_images(page: str) -> list[Image.Image]:
    """Every <img> of the page: each must be an inline PNG (no file or network reference)."""
    srcs = re.findall(r'<img[^>]*\ssrc="([^"]*)"', page)
    out = []
    for src in srcs:
        assert src.startswith("data:image/png;base64,"), src[:80]
        im = Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1], validate=True)))
        assert im.format == "PNG"
        im.load()
        out.append(im)
    return out


def assert_self_contained(page: str) -> None:
    assert "http://" not in page and "https://" not in page and "file:" not in page
    assert "<link" not in page and "<script" not in page and "url(" not in page
    assert len(re.findall(r"\ssrc=", page)) == len(re.findall(r'\ssrc="data:image/png;base64,', page))


@pytest.fixture
def runs(tmp_path) -> dict[str, Path]:
    s1 = write_run(tmp_path / "s1", S1)
    (s1 / "samples").mkdir()
    Image.new("RGB", (32, 24), (200, 30, 30)).save(s1 / "samples" / "0.png")
    s2 = write_run(tmp_path / "s2", S2, init_from=str(s1 / "final"))
    empty = tmp_path / "empty"
    empty.mkdir()
    samples_only = write_run(tmp_path / "samples_only", [S1[1]])
    return {"s1": s1, "s2": s2, "empty": empty, "samples_only": samples_only}


def test_series_keeps_the_last_record_of_a_step_and_the_gap_is_shuffled_minus_own():
    c = report.series(S1)
    assert c["loss"] == ([1, 2, 3, 4], [5.0, 4.0, 3.5, 3.0])
    assert c["eval_loss"] == ([0, 2, 4], [6.0, 4.5, 3.25])
    assert c["eval_loss_shuffled_world"] == ([0, 2, 4], [6.25, 5.0, 4.0])
    assert c["gap"] == ([0, 2, 4], [0.25, 0.5, 0.75])
    loss = report.series(S2)["loss"]
    assert loss[0] == [1, 2, 3] and loss[1][0] == 2.5 and math.isnan(loss[1][1]) and loss[1][2] == 2.0


def test_a_log_that_restarts_at_step_0_holds_two_stages_a_resume_does_not():
    assert [len(s) for s in report.split_stages(S1 + S2)] == [len(S1), len(S2)]
    resumed = S1[:8] + S1[6:]  # steps 3.. logged again after a resume from step 2's checkpoint
    assert len(report.split_stages(resumed)) == 1


def test_damaged_lines_are_counted_not_fatal(tmp_path):
    log = tmp_path / "metrics.jsonl"
    good = {"step": 1, "loss": 2.0, "note": "a\u2028b"}
    log.write_bytes(json.dumps(good, ensure_ascii=False).encode() + b'\n\xff\xfe\n[1, 2]\n{"loss": 3}\n{"step": 2, "lo')
    records, bad = report.read_records(log)
    assert records == [good] and bad == 4
    log.write_text('{"step": true, "loss": 1.0}\n{"step": -1, "loss": 1.0}\n{"step": 1.5, "loss": 1.0}\n')
    assert report.read_records(log) == ([], 3)


def test_the_page_is_one_file_with_inline_pngs_and_the_figures_hold_the_metrics(runs, tmp_path, capsys):
    out = tmp_path / "out" / "report.html"
    out.parent.mkdir()
    args = [str(runs[k]) for k in ("s1", "s2", "empty", "samples_only")]
    assert main([*args, "--out", str(out)]) == 0
    named = [line for line in capsys.readouterr().err.splitlines() if "no metrics" in line]
    assert named == [
        f"warning: train.report: no metrics in {runs['empty']} (no metrics.jsonl), {runs['samples_only']} "
        "(no loss or eval lines): left out, the rest drawn"
    ]
    assert sorted(p.name for p in out.parent.iterdir()) == ["report.html", "report_files"]  # no temporary file left
    page = out.read_text()
    assert_self_contained(page)
    images = data_images(page)
    figures = sorted((out.parent / "report_files").iterdir())
    assert [p.name for p in figures] == [
        "eval_loss.png",
        "gap.png",
        "loss.png",
        "padding_share.png",
        "tokens_per_s.png",
    ]
    inline = {base64.b64decode(s) for s in re.findall(r"data:image/png;base64,([^\"]+)", page)}
    assert {p.read_bytes() for p in figures} <= inline  # the PNGs beside it are the page's figures
    assert len(images) == 5 + 1  # the figures and the one logged picture (step 4's samples)
    sample = [im for im in images if im.size == (256, 192)]  # 32 x 24 enlarged 8 times, whole pixels
    assert len(sample) == 1 and sample[0].convert("RGB").getpixel((40, 40)) == (200, 30, 30)
    assert "a blue circle" in page and "0.5000" in page  # step 4's samples; the benchmark logged at step 2

    loaded = [report.load_run(str(runs[k])) for k in ("s1", "s2")]
    report.place(loaded)
    stages = [s for r in loaded for s in r.stages]
    assert [s.offset for s in stages] == [0, 4] and stages[1].after == str(runs["s1"])
    (runs["s2"] / "final" / "config.yaml").write_text(yaml.safe_dump({"init_from": str(runs["s1"] / "checkpoint-2")}))
    branched = [report.load_run(str(runs[k])) for k in ("s1", "s2")]
    report.place(branched)
    assert [r.stages[0].offset for r in branched] == [0, 2]  # from stage 1's step-2 checkpoint
    for name, (_, _, _, curves) in report.FIGURES.items():
        ax = report.draw(name, stages).axes[0]
        lines = {ln.get_label(): ln for ln in ax.lines if not ln.get_label().startswith("_")}
        for s in stages:
            for curve, _ in curves:
                steps, values = report.series(s.records)[curve]
                if steps[0] == 0:  # the eval before training: left out of the curve
                    steps, values = steps[1:], values[1:]
                label = s.label + (f" ({report.CURVES[curve]})" if len(curves) > 1 else "")
                np.testing.assert_array_equal(lines[label].get_xdata(), [x + s.offset for x in steps])
                np.testing.assert_array_equal(lines[label].get_ydata(), values)


def test_results_of_the_card_and_evaluate_files_are_tables_of_the_page(runs, tmp_path):
    from theworld.infer import card

    row = ["items.jsonl", "0123456789abcdef", "-", "all", "mc", "loglik", "6", "0.6667", "0.1667", "-", "`python -m x`"]
    (runs["s1"] / "final").mkdir()
    card.update(runs["s1"] / "final" / "README.md", row)
    summary = tmp_path / "summary.json"
    summary.write_text(
        json.dumps(
            {
                "model": "runs/stage1",
                "data": "items.jsonl",
                "n": 4,
                "accuracy": 0.75,
                "accuracy_ci95": [0.3, 0.95],
                "accuracy_shuffled_world": 0.25,
                "accuracy_shuffled_world_ci95": [0.05, 0.7],
            }
        )
    )
    records = tmp_path / "items.jsonl"
    recs = [
        {"item": f"i{k}", "category": None, "answer": k % 2, "pred": 0, "pred_shuffled_world": 1, "outputs": {}}
        for k in range(4)
    ]
    for r in recs:
        r["preds"] = {"model": r["pred"], "shuffled_world": r["pred_shuffled_world"]}
        r["outputs"] = {"model": [0.0, -1.0], "shuffled_world": [-1.0, 0.0]}
    records.write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = tmp_path / "r.html"
    assert main([str(runs["s1"]), "--out", str(out), "--eval", str(summary), str(records)]) == 0
    page = out.read_text()
    cells = re.findall(r"<td[^>]*>([^<]*)</td>", page)
    assert "0.6667" in cells and "0123456789abcdef" in cells and "python -m x" in cells  # the card's row
    assert "accuracy                0.7500" in page  # the --json summary, as evaluate prints it
    assert "accuracy                0.5000" in page and "protocol loglik" in page  # the --out records, summarised


def test_bad_input_is_one_line_and_exit_2(runs, tmp_path, capsys):
    out = str(tmp_path / "r.html")
    a_file = tmp_path / "f.txt"
    a_file.write_text("x")
    no_figures = tmp_path / "summary.json"
    no_figures.write_text('{"n": 3, "task": "caption"}')
    cases = [
        ([str(a_file), "--out", out], "is a regular file"),
        ([str(tmp_path / "missing"), "--out", out], "is not there"),
        ([str(runs["empty"]), str(runs["samples_only"]), "--out", out], "no metrics in"),
        ([str(runs["s1"]), "--out", str(tmp_path)], "is a directory"),
        ([str(runs["s1"]), "--out", str(runs["s1"] / "metrics.jsonl")], "would destroy the input"),
        ([str(runs["s1"]), "--out", out, "--eval", str(a_file)], "not theworld.evaluate's"),
        ([str(runs["s1"]), "--out", out, "--eval", str(no_figures)], "without evaluate's figures"),
        ([str(runs["s1"]), "--out", out, "--eval", str(tmp_path)], "is a directory"),
        ([str(runs["s1"]), "--out", str(tmp_path / "nowhere" / "r.html")], "is not there"),
    ]
    for argv, words in cases:
        capsys.readouterr()
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and words in err and "Traceback" not in err, (argv, err)
    assert not (tmp_path / "r.html").exists()
    assert (runs["s1"] / "metrics.jsonl").read_text().count("\n") == len(S1)


def test_a_stage_folder_stands_for_its_run_and_a_file_where_pictures_go_is_refused(runs, tmp_path, capsys):
    from train.loop import main as train

    (runs["s1"] / "final").mkdir()
    assert report.load_run(str(runs["s1"] / "final")).folder == runs["s1"]
    out = tmp_path / "run"
    out.mkdir()
    (out / "samples").write_text("mine")
    argv = ["--config", str(ROOT / "configs" / "stage1.yaml"), "--set", f"output_dir={out}"]
    assert train([*argv, "--set", f"cache_dir={tmp_path / 'no-cache'}"]) == 2
    err = capsys.readouterr().err
    assert "samples is a regular file, where the run writes the caption samples' pictures" in err
    assert (out / "samples").read_text() == "mine"


def chromium() -> str:
    exe = shutil.which("chromium")
    assert exe, "chromium is not on PATH: `make chromium` installs Debian's package (apt-get install chromium)"
    return exe


def screenshot(page: Path, png: Path, tmp_path: Path, size: str = "1400,2400") -> Image.Image:
    cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run"]
    cmd += [f"--user-data-dir={tmp_path / 'chromium-profile'}", f"--screenshot={png}", f"--window-size={size}"]
    done = subprocess.run([*cmd, page.resolve().as_uri()], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0 and png.is_file(), done.stderr[-2000:]
    return Image.open(png).convert("RGB")


@pytest.mark.slow
def test_a_trained_runs_report_renders_in_chromium(trained_run, tmp_path, capsys):
    """The trained run's samples carry their pictures; evaluate's card row, --json and --out files are shown; the
    page Chromium draws is not blank and shows the plots (their first line's colour, C0 #1f77b4)."""
    from theworld.evaluate import main as evaluate

    run = tmp_path / "run"
    shutil.copytree(trained_run["run"], run, symlinks=True)
    rows = next(r["samples"] for r in metrics(run) if "samples" in r)
    assert [r["image"] for r in rows] == [f"samples/{i}.png" for i in range(len(rows))]
    for r in rows:
        with Image.open(run / r["image"]) as im:
            assert im.size == (64, 64) and np.asarray(im).std() > 0  # the cache's 64 px picture, not a blank
    items = tmp_path / "items.jsonl"
    mc = ["--model", str(run), "--data", str(trained_run["mc"]), "--limit", "2", "--batch-size", "2"]
    assert evaluate([*mc, "--out", str(items), "--json"]) == 0
    summary = tmp_path / "summary.json"
    summary.write_text(capsys.readouterr().out)
    out = tmp_path / "report.html"
    assert main([str(run), "--out", str(out), "--eval", str(summary), str(items)]) == 0
    page = out.read_text()
    assert_self_contained(page)
    images = data_images(page)
    assert len(images) == len(report.FIGURES) + len(rows) and sum(im.size == (256, 256) for im in images) == len(rows)
    assert "first 2" in re.findall(r"<td[^>]*>([^<]*)</td>", page)  # the card's row evaluate wrote
    assert page.count("n 2") >= 2  # both evaluate files

    shot = np.asarray(screenshot(out, tmp_path / "shot.png", tmp_path)).astype(int)
    assert shot.std() > 20 and len(np.unique(shot.reshape(-1, 3), axis=0)) > 50  # not blank
    near_c0 = (np.abs(shot - [31, 119, 180]).sum(axis=2) < 30).sum()
    assert near_c0 > 200, near_c0  # the curves are drawn, not only the text


def long_run(every_loss: int = 50, every_eval: int = 250, steps: int = 2000) -> list[dict]:
    """A log as a longer run writes it: loss every 50 steps, evals every 250 from step 0 (its step-0 eval far above)."""
    records = [{"step": 0, "eval_loss": 12.0, "eval_loss_shuffled_world": 12.5}]
    for step in range(every_loss, steps + 1, every_loss):
        records.append({"step": step, "loss": 3.0 - step / steps})
        if step % every_eval == 0:
            own, shuffled = 2.9 - step / steps, 3.4 - step / 4e3
            records.append({"step": step, "eval_loss": own, "eval_loss_shuffled_world": shuffled})
    return records


def test_the_figures_read_as_the_comparison_own_vs_shuffled_on_one_axis_for_a_slide(tmp_path):
    run = write_run(tmp_path / "long", long_run())
    out = tmp_path / "r.html"
    assert main([str(run), "--out", str(out)]) == 0
    files = out.with_name("r_files")
    for png in files.iterdir():
        with Image.open(png) as im:
            assert im.size == (1600, 900), (png.name, im.size)
    stages = report.load_run(str(run)).stages
    ax = report.draw("eval", stages).axes[0]
    own, shuffled = (ln for ln in ax.lines if not ln.get_label().startswith("_"))  # one axis, both curves
    assert own.get_linestyle() == "-" and shuffled.get_linestyle() == "--" and own.get_color() == shuffled.get_color()
    assert list(own.get_xdata()) == list(range(250, 2001, 250)) and max(shuffled.get_ydata()) < 4  # no step-0 12.0
    assert ax.get_ylim()[1] < 4 and "step 0, before training, left out" in ax.get_xlabel()
    assert list(ax.get_xticks()) == list(range(250, 2001, 250))  # the eval steps
    assert list(report.draw("loss", stages).axes[0].get_xticks()) == list(range(250, 2001, 250))
    page = out.read_text()
    assert "training loss (mean of the last log window)" in page and "2.0000 (steps 1951-2000)" in page
    assert "12.0000 / 12.5000" in page  # the step-0 eval the curves leave out, in the summary
    many = write_run(tmp_path / "many", long_run(every_loss=10, every_eval=20))  # 100 evals: every 7th a tick
    assert list(report.draw("gap", report.load_run(str(many)).stages).axes[0].get_xticks()) == list(
        range(20, 2001, 140)
    )


def test_throughput_figures_hold_the_logged_tokens_per_s_and_padding_share(tmp_path):
    """Real tokens/s and the padding share, as the loop logs them with each loss line, are two figures: one line per
    run, the logged numbers at their steps, the share on a percent axis; a run that logged neither draws no such
    figure and the page says so."""
    plain = [{"step": s, "loss": 3.0, "tokens_per_s": 100.0 + s, "padding_share": 0.5} for s in (10, 20, 30)]
    packed = [{"step": s, "loss": 3.0, "tokens_per_s": 180.0 + s, "padding_share": 0.03} for s in (10, 20, 30)]
    runs = [write_run(tmp_path / name, records) for name, records in (("plain", plain), ("packed", packed))]
    out = tmp_path / "r.html"
    assert main([*map(str, runs), "--out", str(out)]) == 0
    files = sorted(p.name for p in out.with_name("r_files").iterdir())
    assert files == ["loss.png", "padding_share.png", "tokens_per_s.png"]
    assert len(data_images(out.read_text())) == 3
    stages = [s for r in runs for s in report.load_run(str(r)).stages]
    tps = report.draw("throughput", stages).axes[0]
    assert [(ln.get_label(), list(ln.get_xdata()), list(ln.get_ydata())) for ln in tps.lines] == [
        (str(runs[0]), [10, 20, 30], [110.0, 120.0, 130.0]),
        (str(runs[1]), [10, 20, 30], [190.0, 200.0, 210.0]),
    ]
    pad = report.draw("padding", stages).axes[0]
    assert [list(ln.get_ydata()) for ln in pad.lines] == [[0.5] * 3, [0.03] * 3]
    assert pad.yaxis.get_major_formatter().format_pct(0.5, 1.0) == "50%"
    assert tps.get_ylim()[0] == pad.get_ylim()[0] == 0.0 and tps.get_ylim()[1] > 210

    old = write_run(tmp_path / "old", [{"step": 1, "loss": 2.0}])  # a log from before the throughput figures
    assert main([str(old), "--out", str(out)]) == 0
    assert report.draw("throughput", report.load_run(str(old)).stages) is None
    assert "real tokens per second" in out.read_text().split("No run logged:")[1].split("</p>")[0]


def test_hostile_numbers_and_a_math_looking_folder_name_draw_or_are_one_line(tmp_path, capsys):
    """A benchmark count that is NaN or infinite, steps and values past a float (JSON 1e400 is inf, 10**400 an int),
    and a run folder matplotlib would read as math: the page is drawn, the bad lines counted, nothing traces back."""
    folder = tmp_path / "$\\frac{ run $x"  # mathtext: an unclosed \frac, a parse error
    folder.mkdir()
    lines = [json.dumps(r) for r in long_run(steps=500)]
    lines += [
        '{"step": 500, "bench/mc/n": NaN, "bench/mc/accuracy": 0.5, "bench/mc/accuracy_shuffled_world": Infinity, '
        '"bench/big/n": Infinity, "bench/big/accuracy": -Infinity}',
        '{"step": 1e400, "loss": 1.0}',
        '{"step": 1' + "0" * 400 + ', "loss": 1.0}',
        '{"step": 475, "loss": 1' + "0" * 400 + "}",
    ]
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "r.html"
    assert main([str(folder), "--out", str(out)]) == 0, capsys.readouterr().err
    page = out.read_text()
    cells = re.findall(r"<td[^>]*>([^<]*)</td>", page)
    assert cells[cells.index("mc") + 1] == "nan" and cells[cells.index("mc") + 3] == "inf"
    assert cells[cells.index("big") + 1 : cells.index("big") + 3] == ["inf", "-inf"]
    run = report.load_run(str(folder))
    assert run.unreadable == 2 and '<td class="num">2</td></tr>' in page  # the two steps past a float: unreadable
    assert 475 not in report.series(run.stages[0].records)["loss"][0]  # a loss past a float: not a point
    ax = report.draw("eval", run.stages).axes[0]
    legend = ax.get_legend().get_texts()[0].get_text()  # the dollars escaped: drawn as written, not as math
    assert legend == str(folder).replace("$", "\\$") + " (eval loss (own world))"
    assert len(data_images(page)) == 3
