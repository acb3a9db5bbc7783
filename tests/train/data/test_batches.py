"""train/data/batches.py: the packed Batch (one buffer per micro-batch, through a loader worker and back) and its
answer-token count."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("private_api", [True, False])
def test_packed_batch_round_trips_every_tensor_through_a_loader_worker(private_api, monkeypatch):
    from torch.utils.data import DataLoader

    from train.data import batches

    if not private_api:  # the shared-memory allocation must not depend on torch's private helper
        monkeypatch.setattr(torch.UntypedStorage, "_new_shared", None, raising=False)

    g = torch.Generator().manual_seed(0)
    tensors = {
        "input_ids": torch.randint(0, 100, (3, 7), generator=g),
        "labels": torch.randint(0, 100, (3, 7), generator=g),
        "latent_mean": torch.randn(3, 16, 1, 8, 8, generator=g),
        "siglip": torch.randn(3, 4, 8).bfloat16(),
        "odd": torch.randint(0, 255, (3, 5), dtype=torch.uint8),  # 15 bytes: what follows must be realigned
        "latent_logvar": torch.randn(3, 16, 1, 8, 8, generator=g),
        "images": torch.randint(0, 255, (3, 3, 8, 8), dtype=torch.uint8),
    }
    batch = batches.Batch(tensors, num_tokens=11)
    assert batch.buffer.dtype == torch.uint8 and batch.buffer.dim() == 1  # one block crosses per batch
    assert all(offset % batches.Batch.ALIGN == 0 for _, _, offset, _ in batch.layout)
    loader = DataLoader([0], batch_size=None, num_workers=1, collate_fn=lambda _: batches.Batch(tensors, 11))
    (received,) = list(loader)
    for b in (batch, received):
        out = b.tensors("cpu")
        assert out.keys() == tensors.keys() and b.num_tokens == 11
        for k, t in tensors.items():
            assert out[k].dtype == t.dtype and out[k].shape == t.shape and torch.equal(out[k], t)


def test_a_batch_counts_its_answer_tokens_and_gives_its_inputs_back():
    from theworld.model import objective
    from theworld.model.inputs import ModelInputs
    from train.data.batches import Batch

    ids = torch.arange(12).reshape(2, 6)
    labels = torch.full((2, 6), objective.IGNORE)
    labels[0, 3:] = ids[0, 3:]  # row 0 answers with its last three tokens, row 1 with its last one
    labels[1, 5] = ids[1, 5]
    inputs = ModelInputs(
        ids,
        torch.ones_like(ids),
        labels,
        latent_mean=torch.randn(2, 16, 1, 4, 4),
        latent_logvar=torch.zeros(2, 16, 1, 4, 4),
    )
    batch = Batch.of(inputs)
    assert batch.size == 2 and batch.num_tokens == objective.token_count(labels) == 4
    back = batch.to("cpu")
    for name in ("input_ids", "attention_mask", "labels", "latent_mean", "latent_logvar"):
        assert torch.equal(getattr(back, name), getattr(inputs, name)), name
    assert back.images is None and back.siglip is None
