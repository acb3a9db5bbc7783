"""Shared test set-up: no network, tiny models built once per checkout, a fake VAE on request."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("THEWORLD_MODELS", str(ROOT / "cache" / "models"))  # built once, reused by every test
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture
def fake_vae(monkeypatch):
    """Make every `theworld.encoders.load_vae` call return a FakeWanVAE (fast, deterministic)."""
    from fake_vae import FakeWanVAE

    from theworld import encoders

    vae = FakeWanVAE()
    monkeypatch.setattr(encoders, "load_vae", lambda spec, dtype="float32": vae)
    return vae
