"""theworld/core/errors.py: the one-line user errors."""

from __future__ import annotations


def test_one_line_joins_a_librarys_lines():
    from theworld.core.errors import one_line

    assert (
        one_line("Couldn't deserialize thrift\nDeserializing page header failed.\n")
        == "Couldn't deserialize thrift / Deserializing page header failed."
    )
