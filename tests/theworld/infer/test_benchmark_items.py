"""theworld/infer/benchmark_items.py: VSR's released layout (cambridgeltl/visual-spatial-reasoning) read as it is,
beside JSONL items and BLINK, recognised from its fields."""

from __future__ import annotations

import json
import re

import pytest

from tests._precompute_helpers import gradient, jpeg_bytes
from theworld.core.errors import UserError
from theworld.evaluate import main
from theworld.infer import baselines, benchmark_items

# records as VSR's data/splits/random/test.jsonl holds them (its fields, its COCO file names, its extra keys)
VSR_ROWS = [
    {
        "image": "000000085637.jpg",
        "image_link": "http://images.cocodataset.org/train2017/000000085637.jpg",
        "caption": "The umbrella is under the bed.",
        "label": 0,
        "relation": "under",
        "annotator_id": 9,
        "vote_true_validator_id": [],
        "vote_false_validator_id": [2, 11],
    },
    {
        "image": "000000313429.jpg",
        "image_link": "http://images.cocodataset.org/val2017/000000313429.jpg",
        "caption": "The cat is behind the laptop.",
        "label": 1,
        "relation": "behind",
        "annotator_id": 31,
        "vote_true_validator_id": [2, 6],
        "vote_false_validator_id": [],
    },
]


def vsr_release(root, rows=VSR_ROWS, as_json: bool = False):
    """VSR's layout: data/splits/random/test.jsonl (or a .json list) and the COCO images in data/images/."""
    split = root / "data" / "splits" / "random"
    split.mkdir(parents=True)
    (root / "data" / "images").mkdir()
    for k, r in enumerate(rows):
        (root / "data" / "images" / r["image"]).write_bytes(jpeg_bytes(gradient(30 + k, 40)))
    if as_json:
        path = split / "test.json"
        path.write_text(json.dumps(rows))
    else:
        path = split / "test.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("as_json", [False, True])
def test_a_vsr_split_is_read_as_released(tmp_path, as_json):
    path = vsr_release(tmp_path, as_json=as_json)
    items = benchmark_items.read(path)
    assert [it.question for it in items] == [
        'Is this statement about the image true or false? "The umbrella is under the bed."',
        'Is this statement about the image true or false? "The cat is behind the laptop."',
    ]
    assert [it.choices for it in items] == [["True", "False"]] * 2
    assert [it.choices[it.answer] for it in items] == ["False", "True"]  # label 0, label 1
    assert [it.category for it in items] == ["under", "behind"]
    assert [it.images[0] for it in items] == [tmp_path / "data" / "images" / r["image"] for r in VSR_ROWS]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"label": 2}, "field 'label': 2 is neither 1 (true) nor 0 (false)"),
        ({"caption": ""}, "field 'caption': missing"),
        ({"image": "000000999999.jpg"}, "field 'image': 000000999999.jpg"),
    ],
)
def test_a_bad_vsr_record_is_one_line_naming_it(tmp_path, capsys, change, message):
    rows = [VSR_ROWS[0], {**VSR_ROWS[1], **change}]
    path = vsr_release(tmp_path, rows)
    if "image" in change:
        (tmp_path / "data" / "images" / "000000999999.jpg").unlink(missing_ok=True)
    with pytest.raises(UserError, match=re.escape(f"test.jsonl:2: {message}")):
        benchmark_items.read(path)


def test_jsonl_items_are_not_taken_for_vsr(tmp_path):
    (tmp_path / "a.png").write_bytes(jpeg_bytes(gradient(3, 16)))
    rec = {"image": "a.png", "question": "Which?", "choices": ["x", "y"], "answer": 1}
    (tmp_path / "items.jsonl").write_text(json.dumps(rec) + "\n")
    (item,) = benchmark_items.read(tmp_path / "items.jsonl")
    assert (item.question, item.answer) == ("Which?", 1)


def test_evaluate_scores_vsr_with_its_baselines_and_paired_tests(trained_run, run_copy, tmp_path, capsys):
    path = vsr_release(tmp_path)
    assert main(["--model", str(run_copy), "--data", str(path), "--json", "--baselines", "all"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["n"] == 2 and set(res["baselines"]) == set(baselines.BASELINES)
    for b in res["baselines"].values():
        assert {"accuracy", "difference", "p_value"} <= b.keys() and 0 <= b["p_value"] <= 1
    assert set(res["categories"]) == {"under", "behind"}
