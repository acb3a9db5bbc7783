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


def test_a_manifest_rewritten_from_an_older_ones_fields_takes_its_records_from_the_sidecars(small_cache):
    """write_manifest's `extra` adds fields; the shard list, totals and index it computes are never taken from it."""
    old = cf.load_manifest(small_cache)
    sides = [cf.read_sidecar(small_cache, i) for i in range(old["num_shards"])]
    stale = {"shards": old["shards"][:1], "shard_index": [], "num_shards": 99, "bytes": 1, "source": {"type": "x"}}
    m = cf.write_manifest(
        small_cache,
        sides,
        fingerprint=old["fingerprint"],
        latent_shape=old["latent_shape"],
        latent_dtype=old["latent_dtype"],
        num_errors=old["num_errors"],
        contents=old["contents"],
        extra=stale,
    )
    assert m["source"] == {"type": "x"}  # an added field
    assert (m["num_shards"], m["bytes"], len(m["shards"])) == (len(sides), sum(s["bytes"] for s in sides), len(sides))
    assert m["shard_index"] == old["shard_index"]  # the same bytes as precompute wrote
    reader = cf.CacheReader(small_cache)
    reader.check_consistency()
    assert len(reader) == old["num_samples"]
