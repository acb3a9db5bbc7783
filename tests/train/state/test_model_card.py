"""train/state/model_card.py: final/'s card and its results rows, keyed by the evaluated set."""

from __future__ import annotations

from tests.conftest import evaluate_main, one_error_line


def test_card_rows_are_keyed_by_the_sets_content_split_and_limit(run_copy, trained_run, tmp_path, capsys):
    from theworld.infer import benchmark_items

    other = tmp_path / "other" / "items.jsonl"  # another set with the same file name
    benchmark_items.make_synthetic(other, 4, seed=7)
    card = run_copy / "final" / "README.md"
    assert evaluate_main("--model", run_copy, "--data", trained_run["mc"]) == 0
    assert evaluate_main("--model", run_copy, "--data", other) == 0
    assert evaluate_main("--model", run_copy, "--data", trained_run["mc"], "--limit", "3") == 0
    capsys.readouterr()

    def rows() -> list[list[str]]:
        table = card.read_text().split("## Evaluation results")[1]
        return [[c.strip() for c in r.strip("|").split("|")] for r in table.splitlines() if r.startswith("| items")]

    got = rows()
    assert len(got) == 3, got
    assert {r[1] for r in got} == {
        __import__("theworld.infer.card", fromlist=["x"]).fingerprint(p) for p in (trained_run["mc"], other)
    }
    assert sorted(r[3] for r in got) == ["all", "all", "first 3"]
    assert sorted(r[6] for r in got) == ["3", "4", "6"]
    full = next(r for r in got if r[6] == "6")
    assert evaluate_main("--model", run_copy, "--data", trained_run["mc"]) == 0  # the same set again: its own row only
    capsys.readouterr()
    again = rows()
    assert len(again) == 3 and sorted(r[6] for r in again) == ["3", "4", "6"]
    assert next(r for r in again if r[6] == "6")[1] == full[1]


def test_a_model_card_that_is_a_folder_is_one_line(run_copy, trained_run, capsys):
    (run_copy / "final" / "README.md").unlink()
    (run_copy / "final" / "README.md").mkdir()
    assert evaluate_main("--model", run_copy, "--data", trained_run["mc"], "--limit", "1") == 2
    one_error_line(capsys, "README.md", "a directory")
