"""train/data/cache.py: the datasets a run reads (flip augmentation of latents and captions, held-out items carrying
their partner's world)."""

from __future__ import annotations

import torch

from tests.conftest import base_args


def test_flipped_samples_get_the_flipped_latents_and_swapped_text(cache, tmp_path):
    """A batch mixing flipped and unflipped samples: each row holds the cache's latents for its own flip decision."""
    from theworld.core.config import load_config
    from train import components
    from train.config import TrainConfig
    from train.data import batches, flip, loader, order
    from train.data import cache as data

    cfg = load_config(
        TrainConfig,
        None,
        [a for a in base_args(cache, tmp_path / "run") if a != "--set"]
        + ["train.loader.flip=true", "train.micro_batch_size=16"],
    )
    reader, plan = data.open_cache(cfg)
    c = components.build(cfg, components.make_accelerator(cfg), 1)
    ctx = loader.DataContext.build(cfg, reader, plan, c.processor)
    ds = ctx.dataset(cfg, ctx.train_indices[:16], epoch=3)
    batch = batches.Collate(ctx.formatter)([ds[i] for i in range(16)]).to("cpu")
    flips = [order.flip_of(cfg.seed, 3, i) for i in ds.indices]
    assert any(flips) and not all(flips)
    for row, (index, flipped) in enumerate(zip(ds.indices, flips)):
        s = reader[index]
        mean, logvar = (s.flip_mean, s.flip_logvar) if flipped else (s.mean, s.logvar)
        assert torch.equal(batch.latent_mean[row], mean) and torch.equal(batch.latent_logvar[row], logvar)
        caption = flip.swap_left_right(s.caption) if flipped else s.caption
        prompt = flip.swap_left_right(s.prompt) if flipped else s.prompt
        expected = ctx.formatter.encode(prompt, caption).input_ids
        assert batch.input_ids[row, : len(expected)].tolist() == expected


def test_eval_items_carry_the_world_of_the_next_held_out_sample(cache):
    import torch

    from theworld import cache_format as cf
    from theworld.cache_format import held_out
    from theworld.core.config import load_config
    from train.config import TrainConfig
    from train.data import batches, loader
    from train.data import cache as data

    cfg = load_config(
        TrainConfig,
        None,
        [
            f"cache_dir={cache}",
            "model.dtype=float32",
            "train.eval.samples=5",
            "train.micro_batch_size=2",
            "train.global_batch_size=16",
        ],
    )
    reader, plan = data.open_cache(cfg)
    _, held = held_out.split(reader, 5)

    class Fmt:  # the dataset only keeps it for Collate
        pass

    pixels = lambda images, return_tensors: {"pixel_values": torch.zeros(1, 3, 4, 4)}
    ds = loader.CacheDataset(reader, held, Fmt(), plan, 64, "crop", pixels, flip=False, partner=True)
    for pos in range(5):
        item = ds[pos]
        nxt = held[(pos + 1) % 5]
        assert item[batches.PARTNER + cf.LATENT] == reader.raw(nxt)[cf.LATENT] != item[cf.LATENT]
