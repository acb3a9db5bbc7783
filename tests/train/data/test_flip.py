"""train/data/flip.py: flip augmentation's text rule."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(
    "text,flipped",
    [
        ("top left red circle . bottom right blue square .", "top right red circle . bottom left blue square ."),
        ("a cat on the left and a dog on the right", "a cat on the right and a dog on the left"),
        ("Left of the tree, to the Right of the car", "Right of the tree, to the Left of the car"),
        ("THE LEFT SIDE", "THE RIGHT SIDE"),
        ("upper-right corner", "upper-left corner"),
        ("the left-hand page", "the right-hand page"),
        ("the leftmost cup", "the rightmost cup"),
        ("from left to right", "from right to left"),
        ("left and right halves", "right and left halves"),
        ("a bird facing left", "a bird facing right"),
        ("in the right half", "in the left half"),
        ("all right", "all right"),
        ("right now", "right now"),
        ("you're right", "you're right"),
        ("left over", "left over"),
        ("he left the room", "he left the room"),
        ("the right answer", "the right answer"),
        ("bright lights, leftovers", "bright lights, leftovers"),
        ("Turn right. Left alone", "Turn left. Left alone"),
    ],
)
def test_flip_swaps_left_and_right_only_where_they_name_a_side(text, flipped):
    from train.data.flip import swap_left_right

    assert swap_left_right(text) == flipped
    assert swap_left_right(flipped) == text  # mirroring twice gives the caption back
