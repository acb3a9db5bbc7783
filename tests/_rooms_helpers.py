"""Helpers shared by the same-name unit tests: a small cache built with the fake VAE, outside any test's fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest


def fake_vae_cache(out: Path, *sets: str, n: int = 12, shard: int = 4, res: int = 32) -> Path:
    """`n` synthetic samples in shards of `shard` at `res` px, encoded by the fake VAE (fast, deterministic), for a
    module-scoped fixture (the `fake_vae` fixture is per test)."""
    from precompute import pipeline
    from tests._precompute_helpers import make_cfg
    from tests.fake_vae import FakeWanVAE
    from theworld.model import encoders

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(encoders, "load_vae", lambda spec, dtype="float32": FakeWanVAE())
        pipeline.run(make_cfg(out, *sets, n=n, shard=shard, res=res))
    return out
