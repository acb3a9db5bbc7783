"""The supervision rule: which tokens the model is judged on, and how.

- A conversation's labels hold the token id on every answer token (each model turn's answer up to and including its
  last <end_of_turn>) and IGNORE everywhere else (`answer_stop`, `answer_labels`); a conversation cut to max_length
  keeps <end_of_turn> as its last supervised token (`truncated`).
- On the fused sequence the world block sits right after BOS, so position t predicts the label of the token after it,
  with the world block's positions never answer tokens (`shifted_targets`).
- The loss is the summed cross-entropy of those targets (`answer_loss`) divided by their count over the whole global
  batch (`token_count`, `per_token`); a row's score is the summed log-probability of its targets (`answer_logprobs`).

Every place that builds labels, counts answer tokens or scores them calls these functions: the text formatter
(theworld/model/text.py), the batch collate (train/data/batches.py), the model's loss and log-probabilities
(theworld/model/world.py)
and the prefix-cached scorer (theworld/infer/prefix_scoring.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

IGNORE = -100  # the label of a token the model is not judged on (cross-entropy's default ignore_index)


def answer_stop(ids: Sequence[int], start: int, stop: int, end_of_turn: int, what: str = "the answer") -> int:
    """End (exclusive) of the answer that starts at `start`: its last <end_of_turn> before `stop`, included."""
    ends = [i for i in range(start, stop) if ids[i] == end_of_turn]
    if not ends:
        raise ValueError(f"no <end_of_turn> after {what}")
    return ends[-1] + 1


def answer_labels(ids: Sequence[int], spans: Sequence[tuple[int, int]]) -> list[int]:
    """Labels of `ids`: the token on every [start, stop) span, IGNORE elsewhere."""
    labels = [IGNORE] * len(ids)
    for start, stop in spans:
        labels[start:stop] = ids[start:stop]
    return labels


def truncated(ids: list[int], labels: list[int], keep: int, end_of_turn: int) -> tuple[list[int], list[int]]:
    """The first `keep` tokens, with <end_of_turn> as the last (supervised) one: a cut answer still teaches when to
    stop."""
    ids, labels = ids[:keep], labels[:keep]
    ids[-1] = labels[-1] = end_of_turn
    return ids, labels


def answer_mask(labels: torch.Tensor) -> torch.Tensor:
    return labels != IGNORE


def shifted_targets(labels: torch.Tensor, n_world: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(next-token targets of the fused sequence, where they are answer tokens): `labels` (B, L) with `n_world`
    world-block positions (never answer tokens) after BOS, shifted one to the left: (B, L + n_world - 1)."""
    world = labels.new_full((labels.shape[0], n_world), IGNORE)
    targets = torch.cat([labels[:, :1], world, labels[:, 1:]], dim=1)[:, 1:]
    return targets, answer_mask(targets)


def token_count(labels: torch.Tensor) -> int:
    """Answer tokens of a batch: the targets its loss sums over, whatever the world block's length."""
    return int(shifted_targets(labels)[1].sum())


def per_token(loss_sum, count):
    """The loss per answer token: a summed loss over its global token count (1 when there were none)."""
    return loss_sum / max(count, 1)


Head = Callable[[torch.Tensor], torch.Tensor]  # hidden states -> logits (the model's lm_head with soft-capping)


def answer_loss(hidden: torch.Tensor, targets: torch.Tensor, head: Head) -> tuple[torch.Tensor, int]:
    """(summed cross-entropy of the answer targets, their count); hidden[b, t] predicts targets[b, t]. Only answer
    positions go through `head`: with a 262k vocabulary the full logits would dominate memory."""
    keep = answer_mask(targets)
    loss_sum = F.cross_entropy(head(hidden[keep]).float(), targets[keep], reduction="sum")
    return loss_sum, int(keep.sum())


def answer_logprobs(
    hidden: torch.Tensor, targets: torch.Tensor, head: Head, greedy: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """(B,) float32: each row's summed log-probability of its answer targets (hidden[b, t] predicts targets[b, t]).
    `greedy`: also, per row, whether every answer token is the most likely one there (lmms-eval's is_greedy)."""
    keep = answer_mask(targets)
    logits = head(hidden[keep]).float()
    nll = F.cross_entropy(logits, targets[keep], reduction="none")
    rows = keep.nonzero()[:, 0]
    scores = torch.zeros(len(targets), dtype=torch.float32, device=nll.device).index_add_(0, rows, -nll)
    if not greedy:
        return scores
    wrong = (logits.argmax(-1) != targets[keep]).float()
    misses = torch.zeros(len(targets), device=nll.device).index_add_(0, rows, wrong)
    return scores, misses == 0
