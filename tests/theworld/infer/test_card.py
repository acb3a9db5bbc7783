"""The model card's results table: rows keyed by what they measured, kept in a record beside the card and rendered
from it, the card's own text kept around the table, and one-line refusals of a card or record that cannot be read."""

from __future__ import annotations

import json

import pytest

from theworld.cache_format import MANIFEST
from theworld.core.errors import UserError
from theworld.infer import card
from theworld.model.stage_layout import SUMS, WEIGHTS

MC = {"n": 6, "accuracy": 0.75, "accuracy_shuffled_world": 0.5, "protocol": "loglik"}


def _set(tmp_path, name: str = "items.jsonl", body: str = "{}\n"):
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body)
    return path


def test_a_sets_fingerprint_is_its_content_whatever_its_name(tmp_path):
    a, b = _set(tmp_path / "a"), _set(tmp_path / "b", "other.jsonl")
    assert card.fingerprint(a) == card.fingerprint(b) and len(card.fingerprint(a)) == 16
    assert card.fingerprint(_set(tmp_path / "c", body="[]\n")) != card.fingerprint(a)
    folder = tmp_path / "folder"
    _set(folder, "x.txt", "1")
    before = card.fingerprint(folder)
    (folder / "x.txt").write_text("2")
    assert card.fingerprint(folder) != before
    _set(folder, MANIFEST, "{}")  # a cache: its manifest stands for its shards
    with_manifest = card.fingerprint(folder)
    (folder / "x.txt").write_text("3")
    assert card.fingerprint(folder) == with_manifest


def test_rows_say_what_they_measured_with_pipes_escaped(tmp_path):
    data = _set(tmp_path, "a|b.jsonl")
    summary = MC | {"baselines": {"text only": {"accuracy": 0.25, "p_value": 0.0123}}}
    r = dict(zip(card.COLUMNS, card.row(summary, str(data), "mc", ["--data", str(data)], limit=3)))
    assert r["benchmark"] == "a%7Cb.jsonl" and r["split"] == "-" and r["limit"] == "first 3"
    assert (r["model"], r["shuffled world"], r["n"]) == ("0.7500", "0.5000", "6")
    assert r["baselines"] == "text only 0.2500 (p 0.012)" and "|" not in r["command"]
    scores = {k: 0.5 for k in ("bleu4", "rouge_l", "cider")} | {
        f"{k}_shuffled_world": 0.25 for k in ("bleu4", "rouge_l", "cider")
    }
    folder = tmp_path / "captions"
    _set(folder, "a.json")
    cap = dict(zip(card.COLUMNS, card.row(scores | {"n": 2}, str(folder) + "/", "caption", [], split="test")))
    assert cap["benchmark"] == "captions" and cap["split"] == "test" and cap["limit"] == "all"
    assert cap["model"] == "0.5000 / 0.5000 / 0.5000" and cap["baselines"] == "-"
    assert cap["protocol"] == "generate (BLEU-4 / ROUGE-L / CIDEr)"


def test_update_replaces_only_the_row_of_the_same_key_and_keeps_the_cards_text(tmp_path):
    final = tmp_path / "final"
    readme = _set(final, "README.md", "# A model\n\nIts story.\n")
    data = _set(tmp_path, "items.jsonl")
    card.update(readme, card.row(MC, str(data), "mc", []))
    card.update(readme, card.row(MC, str(data), "mc", [], limit=2))
    card.update(readme, card.row(MC | {"accuracy": 1.0}, str(data), "mc", []))  # the first row's key again
    got = card.rows(final)
    assert [(r["limit"], r["model"]) for r in got] == [("first 2", "0.7500"), ("all", "1.0000")]
    assert card.results(readme) == got == [json.loads(x) for x in (final / card.RECORD).read_text().splitlines()]
    text = readme.read_text()
    assert text.startswith("# A model\n\nIts story.\n\n## Evaluation results\n\n| benchmark |")
    assert text.count("| items.jsonl |") == 2
    readme.write_text(text + "\nWritten by hand.\n")
    card.update(readme, card.row(MC, str(data), "mc", [], limit=5))
    assert readme.read_text().endswith("\n\nWritten by hand.\n") and readme.read_text().count("| items.jsonl |") == 3


def test_a_row_of_weights_final_no_longer_holds_is_marked(tmp_path):
    final = tmp_path / "final"
    readme = _set(final, "README.md", "# A model\n")
    data = _set(tmp_path, "items.jsonl")
    _set(final, SUMS, json.dumps({WEIGHTS: "aaa"}))
    card.update(readme, card.row(MC, str(data), "mc", []))
    assert card.rows(final)[0][card.WEIGHTS_KEY] == "aaa" and card.EARLIER not in readme.read_text()
    _set(final, SUMS, json.dumps({WEIGHTS: "bbb"}))
    card.update(readme, card.row(MC, str(data), "mc", [], limit=1))
    assert readme.read_text().count(card.EARLIER) == 1 and f"| items.jsonl{card.EARLIER} | " in readme.read_text()
    assert card.section([]) == "" and card.render("# Only text\n", []) == "# Only text\n"


def test_a_card_or_record_that_cannot_be_read_is_one_line(tmp_path):
    final = tmp_path / "final"
    (final / "README.md").mkdir(parents=True)
    assert card.rows(tmp_path / "none") == []  # no card, no record: no rows
    with pytest.raises(UserError, match=r"README.md \(the model card the results go into\) is a directory"):
        card.update(final / "README.md", card.row(MC, str(_set(tmp_path)), "mc", []))
    (final / card.RECORD).write_text('{"benchmark": "x"}\nnot json\n')
    with pytest.raises(UserError, match="results.jsonl: cannot read the results record"):
        card.rows(final)
    (final / card.RECORD).write_text('["a list"]\n')
    with pytest.raises(UserError, match="results.jsonl: a line is not a results row"):
        card.rows(final)
    (final / card.RECORD).unlink()
    (final / card.RECORD).mkdir()
    with pytest.raises(UserError, match=r"results.jsonl \(the record of the model card's results\) is a directory"):
        card.rows(final)


def test_a_card_written_before_the_keys_keeps_its_rows(tmp_path):
    from theworld.infer import card

    path = tmp_path / "README.md"
    path.write_text(
        "# A card\n\n## Evaluation results\n\n| benchmark | task | protocol | n | model | shuffled world | baselines | "
        "command |\n| --- | --- | --- | --- | --- | --- | --- | --- |\n| items.jsonl | mc | loglik | 6 | 0.5 | 0.4 | - "
        "| `x` |\n"
    )
    data = tmp_path / "items.jsonl"
    data.write_text("{}\n")
    summary = {"n": 6, "accuracy": 0.75, "accuracy_shuffled_world": 0.5, "protocol": "loglik"}
    card.update(path, card.row(summary, str(data), "mc", ["--data", str(data)]))
    text = path.read_text()
    assert text.startswith("# A card") and "| 0.5 | 0.4 |" in text and "0.7500" in text
    assert text.count("| items.jsonl |") == 2
