"""Intervals and paired tests for accuracies on a benchmark's items."""

from __future__ import annotations

import math


def wilson(k: int, n: int, z: float = 1.96) -> list[float]:
    """95% Wilson score interval of k successes in n trials."""
    if n == 0:
        return [0.0, 1.0]
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return [max(0.0, centre - half), min(1.0, centre + half)]


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value: b and c are the discordant pairs (right on one side only, each way); under
    the null each is Binomial(b + c, 1/2). p = min(1, 2 P(X <= min(b, c))), computed in exact integers."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(b, c) + 1))
    return min(1.0, 2 * tail / 2**n)


def paired(model_right: list[bool], other_right: list[bool]) -> dict:
    """`other`'s accuracy with its interval, and the model's paired difference to it on the same items (model accuracy
    minus `other`'s: positive when the model does better) with the exact McNemar p-value."""
    if len(model_right) != len(other_right):
        raise ValueError(f"paired results need the same items: {len(model_right)} against {len(other_right)}")
    only_model = sum(a and not b for a, b in zip(model_right, other_right))
    only_other = sum(b and not a for a, b in zip(model_right, other_right))
    return paired_counts(len(other_right), sum(other_right), only_model, only_other)


def paired_counts(n: int, k: int, only_model: int, only_other: int) -> dict:
    """`paired` from its counts: n items, k right by the other, the discordant pairs each way."""
    return {
        "n": n,
        "accuracy": k / n if n else 0.0,
        "accuracy_ci95": wilson(k, n),
        "difference": (only_model - only_other) / n if n else 0.0,
        "p_value": mcnemar_exact(only_model, only_other),
        "only_model_right": only_model,
        "only_baseline_right": only_other,
    }
