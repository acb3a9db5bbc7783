"""theworld/embedded/synthetic.py: the demo's scenes are a pure function of (seed, index), and each caption names
exactly what is drawn where."""

from __future__ import annotations

import pytest

from theworld.embedded import synthetic


def test_a_scene_is_a_pure_function_of_seed_and_index():
    a, b = synthetic.scene(3, 7), synthetic.scene(3, 7)
    assert a[1] == b[1] and a[0].tobytes() == b[0].tobytes()
    others = [synthetic.scene(4, 7), synthetic.scene(3, 8)]
    assert all(o[0].tobytes() != a[0].tobytes() for o in others)


@pytest.mark.parametrize("index", range(40))
def test_the_caption_names_each_drawn_object_in_quadrant_order(index):
    size, half = 64, 32
    img, caption = synthetic.scene(0, index, size=size)
    assert img.size == (size, size) and set(caption.split()) <= set(synthetic.VOCABULARY)
    objects = [s.split() for s in caption.split(" .")[:-1]]
    assert 1 <= len(objects) <= 3 and caption.endswith(" .")
    named = {}
    for words in objects:
        *position, colour, shape = words
        assert shape in synthetic.SHAPES and colour in synthetic.COLOURS, words
        named[synthetic.POSITIONS.index(" ".join(position))] = colour
    assert list(named) == sorted(named)  # distinct quadrants, in quadrant order
    background = img.getpixel((0, 0))  # a corner: inside every margin
    for q in range(4):
        centre = img.getpixel(((q % 2) * half + half // 2, (q // 2) * half + half // 2))
        # every shape covers its box's centre; an empty quadrant shows the background there
        assert centre == (synthetic.COLOURS[named[q]] if q in named else background), (q, caption)
