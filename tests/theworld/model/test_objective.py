"""The supervision rule (theworld/model/objective.py) and the model's input contract (theworld/model/inputs.py): the
rule's
functions on hand-made tensors, and the places that count and score answer tokens (labels, the batch's token count,
the model's loss and log-probabilities, the prefix-cached scorer) agreeing on multi-turn, multi-image and
rollout-shaped batches."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from theworld.model import objective
from theworld.model.config import ModelConfig, WorldConfig
from theworld.model.inputs import ModelInputs, prompt_only, text_batch
from theworld.model.objective import IGNORE
from theworld.model.text import ChatFormatter, Encoded
from theworld.model.world import TheWorld

I = IGNORE  # noqa: E741 - short, for the tables below
TURNS = [("what is it ?", "a red circle ."), ("where ?", "top left .")]


# ---------------------------------------------------------------------------------------------- the rule, by hand


def test_the_answer_runs_to_its_last_end_of_turn_and_nothing_else_is_labelled():
    eot = 9
    ids = [1, 5, 6, 7, 3, 9, 4, 9, 2]
    assert objective.answer_stop(ids, 3, len(ids), eot) == 8  # the last <end_of_turn> after the start, included
    assert objective.answer_stop(ids, 3, 6, eot) == 6  # only up to `stop`
    with pytest.raises(ValueError, match="no <end_of_turn> after answer 2"):
        objective.answer_stop(ids, 0, 5, eot, "answer 2")
    assert objective.answer_labels(ids, [(1, 3), (6, 8)]) == [I, 5, 6, I, I, I, 4, 9, I]
    assert objective.answer_labels(ids, []) == [I] * len(ids)


def test_a_truncated_answer_ends_in_a_supervised_end_of_turn():
    ids, labels = [1, 2, 3, 4, 5, 9], [I, I, 3, 4, 5, 9]
    assert objective.truncated(ids, labels, 4, 9) == ([1, 2, 3, 9], [I, I, 3, 9])
    assert ids == [1, 2, 3, 4, 5, 9] and labels == [I, I, 3, 4, 5, 9]  # the inputs are left as they were


def test_targets_after_the_world_block_and_the_token_count():
    labels = torch.tensor([[I, I, 7, 8, 9], [I, 5, 6, I, I]])
    targets, keep = objective.shifted_targets(labels, 3)
    # fused: BOS, three world positions, then the rest of the row; position t predicts token t + 1
    assert targets.tolist() == [[I, I, I, I, 7, 8, 9], [I, I, I, 5, 6, I, I]]
    assert torch.equal(keep, targets != I)
    plain, _ = objective.shifted_targets(labels)
    assert torch.equal(plain, labels[:, 1:])
    for n_world in (0, 1, 66, 3 * 64 + 2):  # the count does not depend on the world block's length
        assert int(objective.shifted_targets(labels, n_world)[1].sum()) == objective.token_count(labels) == 5
    assert objective.token_count(torch.tensor([[4, I, I]])) == 0  # BOS is never a target
    assert objective.per_token(torch.tensor(6.0), 3) == 2.0 and objective.per_token(5.0, 0) == 5.0


def test_answer_loss_and_log_probabilities_against_full_log_softmax():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 6, 8, generator=g)
    head = torch.nn.Linear(8, 11)
    with torch.no_grad():
        head.weight.copy_(torch.randn(11, 8, generator=g))
    targets = torch.tensor([[I, I, 3, 4, I, I], [I, 1, 2, 3, 10, I], [I] * 6])
    with torch.no_grad():
        logp = F.log_softmax(head(hidden).double(), -1)
    keep = targets != I
    picked = logp[keep].gather(1, targets[keep][:, None])[:, 0]
    loss_sum, n = objective.answer_loss(hidden, targets, head)
    assert n == 6 and torch.allclose(loss_sum.double(), -picked.sum(), atol=1e-5)
    rows = objective.answer_logprobs(hidden, targets, head)
    expected = [float(picked[:2].sum()), float(picked[2:].sum()), 0.0]  # rows of 2, 4 and no answer tokens
    assert rows.dtype == torch.float32 and torch.allclose(rows.double(), torch.tensor(expected).double(), atol=1e-5)
    assert torch.allclose(-rows.sum(), loss_sum, atol=1e-5)  # the loss is the scores' sum, by construction
    scores, greedy = objective.answer_logprobs(hidden, targets, head, greedy=True)
    best = logp.argmax(-1)
    assert torch.equal(scores, rows)
    assert greedy.tolist() == [bool((best[r][keep[r]] == targets[r][keep[r]]).all()) for r in range(3)]
    # a row whose targets are each position's most likely token is greedy
    assert objective.answer_logprobs(hidden, torch.where(keep, best, I), head, greedy=True)[1].all()


# ---------------------------------------------------------------------------------------------- ModelInputs


# ---------------------------------------------------------------------------------------------- agreement


@pytest.fixture(scope="module")
def tiny():
    model, processor = TheWorld.from_config(ModelConfig(dtype="float32"), WorldConfig(), seed=0)
    return model.eval(), ChatFormatter(processor)


@pytest.fixture(scope="module")
def rollout():
    """The tiny model of a rollout stage: world latents of the observed frame and 2 predicted ones."""
    model, _ = TheWorld.from_config(ModelConfig(dtype="float32"), WorldConfig(num_world_steps=2), seed=0)
    return model.eval()


def _inputs(model, rows: list[Encoded], pad: int, images: int = 1, frames: int = 1) -> ModelInputs:
    """Rows with random cached inputs: `images` SigLIP blocks per row, world latents of `frames` 8 x 8 frames (a
    rollout's: the observed frame, then frames - 1 predicted ones)."""
    g = torch.Generator().manual_seed(len(rows) + images + frames)
    z, hidden = model.world_encoder.vae.config.z_dim, model.gemma.config.text_config.hidden_size
    mm = model.gemma.config.mm_tokens_per_image
    mean = model.projector.latents_mean[..., None] + torch.randn(len(rows), z, frames, 8, 8, generator=g)
    siglip = torch.randn(len(rows) * images, mm, hidden, generator=g)
    return text_batch(rows, pad, latent_mean=mean, latent_logvar=torch.zeros_like(mean), siglip=siglip)


def _cases(fmt: ChatFormatter) -> dict[str, tuple[list[Encoded], int, int]]:
    """name -> (rows, images per row, world frames)."""
    single = fmt.encode_many([("Describe the image.", "a red circle ."), ("What is it ?", "two blue squares .")])
    return {
        "multi_turn": ([fmt.encode_turns(TURNS)[0], fmt.encode_turns(TURNS[:1])[0]], 1, 1),
        "multi_image": ([fmt.encode("Which is left ?", c, images=2) for c in ("the cat", "a dog .")], 2, 1),
        "rollout_shaped": (single, 1, 3),
    }


@pytest.mark.parametrize("case", ["multi_turn", "multi_image", "rollout_shaped", "no_rollout"])
def test_every_place_that_counts_answer_tokens_agrees(tiny, rollout, case):
    """The labels the formatter writes, the batch's token count that normalises the loss (train/data/batches.py), the
    tokens the model's loss sums over and the log-probabilities it scores are one rule: equal on every batch shape
    (a rollout stage's world block of 3 frames, and of its observed frame alone: the no_rollout baseline)."""
    from train.data.batches import Batch

    model, fmt = tiny
    rows, images, frames = _cases(fmt)[case if case != "no_rollout" else "rollout_shaped"]
    if frames > 1:
        model = rollout
    inputs = _inputs(model, rows, fmt.pad_id, images, frames)
    if case == "no_rollout":
        inputs, frames = inputs.with_inputs(use_rollout=False), 1
    labelled = sum(lab != IGNORE for e in rows for lab in e.labels)
    eot = fmt.end_of_turn_id
    assert all([lab for lab in e.labels if lab != IGNORE][-1] == eot for e in rows)  # answers end in <end_of_turn>
    if case == "multi_turn":  # both turns' answers are labelled
        assert sum(lab == eot for lab in rows[0].labels) == 2
    with torch.no_grad():
        out = model(inputs, return_logits=True)
        scores = model.answer_logprobs(inputs)
    n_world = out.logits.shape[1] - inputs.input_ids.shape[1]
    assert n_world == frames * 64 + 2 == model.projector.num_tokens(8, 8, frames)  # the world block: the frames
    assert Batch.of(inputs).num_tokens == objective.token_count(inputs.labels) == out.num_tokens == labelled
    # the loss and the scores are the same sum, and both are the full logits' log-softmax at the answer tokens
    assert torch.allclose(-scores.sum(), out.loss_sum, rtol=1e-5)
    targets, keep = objective.shifted_targets(inputs.labels, n_world)
    logp = F.log_softmax(out.logits[:, :-1].double(), -1)
    hand = [float(logp[r][keep[r]].gather(1, targets[r][keep[r]][:, None]).sum()) for r in range(len(rows))]
    assert torch.allclose(scores.double(), torch.tensor(hand, dtype=torch.float64), atol=1e-4)
    assert torch.allclose(out.loss, out.loss_sum / labelled)


@pytest.mark.parametrize("case", ["multi_image", "rollout_shaped"])
def test_the_prefix_cached_scorer_scores_the_same_answer_tokens(tiny, rollout, case):
    from theworld.infer import prefix_scoring

    model, fmt = tiny
    rows, images, frames = _cases(fmt)[case]
    if frames > 1:
        model = rollout
    inputs = _inputs(model, rows, fmt.pad_id, images, frames)
    question = {"multi_image": "Which is left ?", "rollout_shaped": None}[case]
    if question is None:  # one prefix per row: the row's ids before its first label
        prefixes = [e.input_ids[: next(i for i, lab in enumerate(e.labels) if lab != IGNORE)] for e in rows]
    else:
        prefixes = [fmt.prefix(question, images=images)] * len(rows)
    with torch.no_grad():
        whole = model.answer_logprobs(inputs)
        cached = prefix_scoring.answer_logprobs(
            model,
            prefixes,
            rows,
            list(range(len(rows))),
            inputs.siglip,
            latent_mean=inputs.latent_mean,
            latent_logvar=inputs.latent_logvar,
        )
    assert torch.allclose(whole, cached, atol=1e-4)


def test_a_prompt_only_batch_has_no_loss(tiny):
    model, fmt = tiny
    prompts = prompt_only([fmt.prefix("Describe the image.")], fmt.pad_id)
    inputs = _inputs(model, [fmt.encode("Describe the image.", "a cat .")], fmt.pad_id).behind(prompts)
    with pytest.raises(ValueError, match="need labels"):
        model(inputs)
    assert model.embed_inputs(inputs)["inputs_embeds"].shape[1] == prompts.input_ids.shape[1] + 66
