"""theworld/cache_format/layout.py: a malformed sidecar is one line naming it."""

from __future__ import annotations

import pytest

from tests.theworld.cache_format.conftest import as_format_3
from theworld import cache_format as cf
from theworld.core.errors import CacheDamaged


@pytest.mark.parametrize(
    "sidecar",
    [
        b"{not json",
        b"[1, 2]",
        b'{"samples": 3}',
        b'{"samples": [{"key": "a", "members": {"txt": "x"}}]}',
        b'{"samples": [{"key": 1, "members": {}}]}',
    ],
)
def test_a_malformed_sidecar_is_one_line_naming_it(small_cache, sidecar):
    as_format_3(small_cache)  # a format-4 reader reads the shard index, not the sidecars
    cf.sidecar_path(small_cache, 1).write_bytes(sidecar)
    with pytest.raises(CacheDamaged) as e:
        cf.CacheReader(small_cache)
    assert "shard-000001.json" in str(e.value) and "\n" not in str(e.value)
