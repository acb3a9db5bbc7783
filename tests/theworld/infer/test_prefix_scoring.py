"""One prefix per item and world: the shared-prefix scores equal the whole-sequence ones (float32, tiny models)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from theworld.embedded import synthetic
from theworld.infer import benchmark_items
from theworld.infer.baselines import BASELINES, MODEL, SHUFFLED
from theworld.infer.scoring import Scorer, evaluate
from theworld.model.config import ImageConfig, ModelConfig, WorldConfig
from theworld.model.world import TheWorld

# choices that tokenize to different lengths, items with 3 and 2 choices, one and two images (prefixes of two lengths)
ITEMS = [
    {
        "image": "0.png",
        "question": "describe the scene .",
        "answer": 1,
        "choices": ["top left red circle . bottom right blue square .", "left", "bottom right"],
    },
    {"image": ["1.png", "2.png"], "question": "left right", "choices": ["red square .", "blue"], "answer": 0},
    {
        "image": "2.png",
        "question": "which colour ?",
        "choices": ["green", "a blue square in the top left"],
        "answer": "B",
    },
]


@pytest.fixture(scope="module")
def items(tmp_path_factory) -> list[benchmark_items.Item]:
    root = tmp_path_factory.mktemp("items")
    for i in range(3):
        synthetic.scene(11, i)[0].save(root / f"{i}.png")
    (root / "items.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ITEMS))
    return benchmark_items.read(root / "items.jsonl")


@pytest.fixture(scope="module", params=["one_global_layer", "sliding_and_global"])
def model(request, tmp_path_factory):
    gemma = "tiny"
    if request.param == "sliding_and_global":
        # a sliding-window layer whose window (16) is shorter than every prefix (~90 tokens), then a global one
        from theworld.embedded.tiny import build_tiny_gemma

        gemma = str(Path(tmp_path_factory.mktemp("gemma2")) / "g")
        build_tiny_gemma(gemma, num_hidden_layers=2, sliding_window=16)
    model, processor = TheWorld.from_config(ModelConfig(gemma=gemma, dtype="float32"), WorldConfig())
    return model.eval(), processor


# every condition that changes the world block: own, previous item's, none at all, a constant latent
CONDS = [MODEL, SHUFFLED, BASELINES["no_world"], BASELINES["constant_latent"]]


def test_shared_prefix_scores_equal_whole_sequence_scores(model, items):
    m, processor = model
    fmt = Scorer(m, processor, ImageConfig(), items).formatter
    assert len({len(fmt.encode(items[0].question, c).input_ids) for c in items[0].choices}) == 3  # lengths differ
    shared = Scorer(m, processor, ImageConfig(), items, shared_prefix=True).score([0, 1, 2], CONDS)
    whole = Scorer(m, processor, ImageConfig(), items, shared_prefix=False).score([0, 1, 2], CONDS)
    for s, w in zip(shared, whole):
        assert list(s) == [c.name for c in CONDS]
        for c in s:
            assert s[c] == pytest.approx(w[c], abs=1e-5, rel=0)
        assert s["model"] != s["shuffled_world"] and s["model"] != s["no_world"]  # the conditions are scored apart
    assert [len(s["model"]) for s in shared] == [3, 2, 2]


def test_evaluate_predicts_the_same_either_way(model, items):
    m, processor = model
    preds = lambda records: [r["preds"] for r in records]
    shared = evaluate(m, processor, ImageConfig(), items, batch_size=2, conds=CONDS)
    assert preds(shared) == preds(
        evaluate(m, processor, ImageConfig(), items, batch_size=2, conds=CONDS, shared_prefix=False)
    )
    assert preds(shared) == preds(evaluate(m, processor, ImageConfig(), items, batch_size=3, conds=CONDS))


def test_a_choice_that_does_not_continue_its_prefix_is_refused(model, items):
    from theworld.infer import prefix_scoring
    from theworld.model.text import Encoded

    m, processor = model
    scorer = Scorer(m, processor, ImageConfig(), items)
    prefix = scorer.formatter.prefix(items[0].question)
    row = scorer.formatter.encode(items[0].question, "left")
    bad = Encoded([row.input_ids[0] + 1] + row.input_ids[1:], row.labels)
    with pytest.raises(ValueError, match="do not continue"):
        prefix_scoring.answer_logprobs(m, [prefix], [bad], [0], torch.zeros(0))
