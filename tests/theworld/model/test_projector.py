"""theworld/model/projector.py: world latents of 1 + N frames -> world tokens in time order with a learned
temporal embedding per frame, one SOW/EOW around them, N = 0 exactly as before; a non-square latent pooled over h and w
separately."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests._rollout_helpers import random_latents
from theworld.model.config import ModelConfig, WorldConfig
from theworld.model.inputs import text_batch
from theworld.model.projector import WorldProjector
from theworld.model.text import ChatFormatter
from theworld.model.world import TheWorld


def test_the_world_projector_pools_a_non_square_latent_over_h_and_w_separately():
    from theworld.model.projector import WorldProjector

    torch.manual_seed(0)
    proj = WorldProjector(32, torch.zeros(16), torch.ones(16), pool=4)
    mean = torch.randn(2, 16, 1, 12, 20)
    out = proj(mean, None)
    assert out.shape == (2, 3 * 5 + 2, 32) and proj.num_tokens(12, 20) == 17
    # token (row 1, column 3) is the projection of the mean over latent rows 4-7 and columns 12-15
    pooled = mean[:, :, 0, 4:8, 12:16].mean(dim=(-2, -1))
    torch.testing.assert_close(out[:, 1 + 1 * 5 + 3], proj.net(pooled) * proj.embed_scale)


H = 32  # hidden size of the hand-made projectors


def projector(steps: int, pool: int = 1, arch: str = "mlp", seed: int = 0) -> WorldProjector:
    torch.manual_seed(seed)
    mean, std = torch.linspace(-1, 1, 16), torch.linspace(0.5, 1.5, 16)
    return WorldProjector(H, mean, std, pool=pool, arch=arch, num_world_steps=steps, max_world_steps=4)


def reference(p: WorldProjector, mean: torch.Tensor) -> torch.Tensor:
    """The projector as it was before rollouts, of one frame (B, C, 1, h, w): normalise, pool, project, markers."""
    z = (mean[:, :, 0].float() - p.latents_mean) / p.latents_std
    z = F.avg_pool2d(z, p.pool) if p.pool > 1 else z
    world = p.net(z.flatten(2).transpose(1, 2))
    b = len(mean)
    return torch.cat([p.sow.expand(b, 1, -1), world, p.eow.expand(b, 1, -1)], 1) * p.embed_scale


@pytest.mark.parametrize("pool", [1, 2])
def test_world_tokens_are_each_frames_tokens_in_time_order_with_its_temporal_row(pool):
    p, plain = projector(2, pool), projector(0, pool)
    assert all(torch.equal(v, p.state_dict()[k]) for k, v in plain.state_dict().items())  # same seed, same weights
    mean = random_latents(3, 3, side=4)
    with torch.no_grad():
        out = p(mean, torch.zeros_like(mean))
    per_frame = (4 // pool) ** 2
    assert out.shape == (3, 3 * per_frame + 2, H) and p.num_tokens(4, 4) == out.shape[1]
    assert p.num_tokens(4, 4, frames=1) == per_frame + 2 and plain.num_tokens(4, 4) == per_frame + 2
    s = p.embed_scale
    # one SOW first, one EOW last, nothing else equal to either marker
    assert torch.equal(out[:, 0], (p.sow * s).expand(3, -1)) and torch.equal(out[:, -1], (p.eow * s).expand(3, -1))
    body = out[:, 1:-1]
    assert not any(torch.allclose(body[:, i], out[:, 0]) or torch.allclose(body[:, i], out[:, -1]) for i in range(9))
    for k in range(3):  # frame k's tokens: the projector of that frame alone, plus temporal row k
        alone = reference(p, mean[:, :, k : k + 1])[:, 1:-1]
        block = body[:, k * per_frame : (k + 1) * per_frame]
        assert torch.allclose(block, alone + p.temporal[k] * s, atol=1e-5), k
    assert not torch.allclose(body[:, :per_frame], body[:, per_frame : 2 * per_frame])  # frames are told apart


def test_without_world_steps_the_projector_is_what_it_was():
    """N = 0: no temporal table (the parameter set and so the checkpoints are as before) and bit-identical output."""
    for arch in ("mlp", "linear"):
        p = projector(0, arch=arch)
        assert p.temporal is None and set(p.state_dict()) == {"sow", "eow", *(f"net.{k}" for k in p.net.state_dict())}
        mean = random_latents(2, 1)
        with torch.no_grad():
            assert torch.equal(p(mean, torch.zeros_like(mean)), reference(p, mean))
            assert torch.equal(p(mean[:, :, 0]), reference(p, mean))  # (B, C, h, w): one frame without a time axis
    model, _ = TheWorld.from_config(ModelConfig(dtype="float32"), WorldConfig(), seed=0)
    assert not [n for n, _ in model.named_parameters() if "temporal" in n]


def test_more_frames_than_the_model_uses_are_cut_and_fewer_refused():
    p, mean = projector(2), random_latents(2, 5)
    logvar = torch.full_like(mean, -30.0)
    with torch.no_grad():
        assert torch.equal(p(mean, logvar), p(mean[:, :, :3], logvar[:, :, :3]))
        # latent mode sample: the noise a frame gets does not depend on the frames after it
        assert torch.equal(p(mean, logvar, "sample", [4, 5]), p(mean[:, :, :3], logvar[:, :, :3], "sample", [4, 5]))
    with pytest.raises(ValueError, match="hold 2 frame.* uses 3 .*num_world_steps = 2"):
        p(mean[:, :, :2])
    with pytest.raises(ValueError, match=r"frames must be in \[1, 3\]"):
        p(mean, frames=4)


def test_the_temporal_table_trains_with_the_projector():
    """A training step reaches the table's rows of the frames in play (and no other row); the optimiser has it with
    the projector, without weight decay; the trainable counts include it."""
    from train.optim import param_groups
    from train.params import part_counts

    world = WorldConfig(num_world_steps=2, max_world_steps=4)
    model, processor = TheWorld.from_config(ModelConfig(dtype="float32"), world, seed=0)
    plain, _ = TheWorld.from_config(ModelConfig(dtype="float32"), WorldConfig(), seed=0)
    hidden = model.gemma.config.get_text_config().hidden_size
    assert model.projector.temporal.shape == (5, hidden)
    counts, before = part_counts(model)["projector"], part_counts(plain)["projector"]
    assert counts["trainable"] == counts["total"] == before["trainable"] + 5 * hidden
    groups = param_groups(model, weight_decay=0.1)
    table = [g for g in groups if any(p is model.projector.temporal for p in g["params"])]
    assert len(table) == 1 and table[0]["part"] == "projector" and table[0]["weight_decay"] == 0.0
    fmt = ChatFormatter(processor)
    mean = model.projector.latents_mean[:, :, None] + random_latents(2, 3, side=8)
    mm = model.gemma.config.mm_tokens_per_image
    batch = text_batch(
        [fmt.encode("Describe the image.", c) for c in ("a red circle .", "two squares .")],
        fmt.pad_id,
        latent_mean=mean,
        latent_logvar=torch.zeros_like(mean),
        siglip=torch.randn(2, mm, hidden, generator=torch.Generator().manual_seed(1)),
    )
    model.train()
    model(batch).loss.backward()
    grad = model.projector.temporal.grad
    assert all(grad[k].abs().sum() > 0 for k in range(3)) and not grad[3:].any()
    start = model.projector.temporal.detach().clone()
    torch.optim.AdamW(param_groups(model, 0.1), lr=1e-2).step()
    moved = (model.projector.temporal.detach() != start).any(-1)
    assert moved.tolist() == [True, True, True, False, False]
