"""Weighted mixtures of caches (`data: [{cache, weight}, ...]`): several caches read as one index, and each epoch's
draw from them by weight.

`MixedReader` concatenates the caches' samples (global index = the cache's offset + its own index) and answers the
part of `CacheReader`'s interface training uses, so the split, the order, the dataset and the collation need not know
whether there is one cache or several.

Each epoch holds as many samples as the caches' training samples together (N). Cache c gets a quota of
round(N x weight_c / sum of weights) of them (largest remainders, so the quotas add up to N), spread over its latent
shapes in proportion to their sizes. A (cache, shape) group whose quota is below its size gives a seeded random subset,
a different one each epoch; one whose quota is above its size repeats: whole seeded permutations of it, then part of
one more. The quotas are the same every epoch, so the number of global batches per epoch is too, and the draw is a pure
function of (seed, epoch): resuming and the process count do not change it. The epoch's order is then made from the
drawn samples as from one cache's (`order.epoch_batches`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from theworld import cache_format as cf
from theworld.core.errors import UserError
from train.data.order import seed_of


class MixedReader:
    """Several CacheReaders as one index (see the module docstring); picklable for loader workers."""

    def __init__(self, readers: list[cf.CacheReader]):
        self.readers = readers
        sizes = [len(r) for r in readers]
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.cache_of = np.repeat(np.arange(len(readers), dtype=np.int32), sizes)
        self.latent_hw = np.concatenate([r.latent_hw for r in readers]).reshape(-1, 2)
        self.cache_dir = readers[0].cache_dir  # for messages that name "the cache"; each reader names its own
        self.manifest = readers[0].manifest

    def locate(self, index: int) -> tuple[cf.CacheReader, int]:
        """The cache that mixture sample `index` comes from, and its index there."""
        c = int(self.cache_of[index])
        return self.readers[c], int(index - self.offsets[c])

    @property
    def members(self) -> tuple[str, ...] | None:
        return self.readers[0].members

    @members.setter
    def members(self, value: tuple[str, ...] | None) -> None:
        for r in self.readers:
            r.members = value

    @property
    def checksummed(self) -> bool:
        return all(r.checksummed for r in self.readers)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def key(self, index: int) -> str:
        reader, i = self.locate(index)
        return reader.key(i)

    def keys_digest(self) -> str:
        """sha256 (16 hex digits) of the caches' own key digests, in order."""
        return hashlib.sha256("\n".join(r.keys_digest() for r in self.readers).encode()).hexdigest()[:16]

    def raw(self, index: int) -> dict[str, bytes]:
        reader, i = self.locate(index)
        return reader.raw(i)

    def text(self, index: int) -> cf.Sample:
        reader, i = self.locate(index)
        return reader.text(i)

    def decode(self, index: int, members: dict[str, bytes], tensors: bool = True) -> cf.Sample:
        reader, i = self.locate(index)
        return reader.decode(i, members, tensors)

    def sample(self, index: int, tensors: bool = True) -> cf.Sample:
        reader, i = self.locate(index)
        return reader.sample(i, tensors)

    def close(self) -> None:
        for r in self.readers:
            r.close()

    def damaged(self, index: int, what: str):
        reader, i = self.locate(index)
        return reader.damaged(i, what)


def partner_groups(reader, indices: np.ndarray) -> np.ndarray:
    """What the shuffled-world eval pairs within: the latent shape, and in a mixture the cache too."""
    hw = reader.latent_hw[indices]
    if not isinstance(reader, MixedReader):
        return hw
    return np.column_stack([reader.cache_of[indices], hw])


def largest_remainder(shares: np.ndarray, total: int) -> np.ndarray:
    """Non-negative integers proportional to `shares` that add up to `total` (Hamilton's method; ties to the first)."""
    exact = np.asarray(shares, dtype=np.float64) * total / np.sum(shares)
    out = np.floor(exact).astype(np.int64)
    rest = np.argsort(-(exact - out), kind="stable")[: total - int(out.sum())]
    out[rest] += 1
    return out


@dataclass
class Draw:
    """Each epoch's samples of a mixture: `groups` (global training indices of one cache and latent shape each),
    their per-epoch `quotas`, and the cache of each group."""

    groups: list[np.ndarray]
    quotas: np.ndarray
    group_cache: np.ndarray
    cache_quotas: np.ndarray  # per cache
    cache_sizes: np.ndarray  # training samples per cache

    @classmethod
    def build(cls, reader: MixedReader, train_indices: np.ndarray, weights: list[float], buckets: np.ndarray) -> Draw:
        """`buckets[i]`: sample i's latent shape id (order.bucket_ids)."""
        cache = reader.cache_of[train_indices]
        sizes = np.bincount(cache, minlength=len(reader.readers))
        cache_quotas = largest_remainder(np.asarray(weights), len(train_indices))
        for c in np.flatnonzero(cache_quotas == 0):  # a weight too small against the others' to draw one sample
            least = float(np.sum(weights)) / len(train_indices)
            raise UserError(
                f"config key 'data': cache {reader.readers[c].cache_dir}'s weight {weights[c]:g} gives it none of "
                f"the {len(train_indices)} samples of an epoch (its share {weights[c] / np.sum(weights):.2g}); "
                f"give it a weight of at least {least:.3g} against the others, or leave it out"
            )
        groups, quotas, group_cache = [], [], []
        for c in range(len(reader.readers)):
            mine = train_indices[cache == c]
            shapes, of = np.unique(buckets[mine], return_inverse=True)
            per_shape = largest_remainder(np.bincount(of.reshape(-1)), int(cache_quotas[c]))
            for k in range(len(shapes)):
                groups.append(mine[of.reshape(-1) == k])
                quotas.append(int(per_shape[k]))
                group_cache.append(c)
        return cls(groups, np.array(quotas, dtype=np.int64), np.array(group_cache), cache_quotas, sizes)

    def epoch(self, seed: int, epoch: int) -> np.ndarray:
        """The epoch's drawn samples (global indices, with repeats), group after group; order.epoch_batches shuffles
        them."""
        out = []
        for g, (members, quota) in enumerate(zip(self.groups, self.quotas.tolist())):
            if quota == len(members):
                out.append(members)
                continue
            rounds = -(-quota // len(members))
            perms = [
                torch.randperm(
                    len(members), generator=torch.Generator().manual_seed(seed_of("mix", seed, epoch, g, r))
                ).numpy()
                for r in range(rounds)
            ]
            out.append(members[np.concatenate(perms)[:quota]])
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    def bucket_sizes(self, buckets: np.ndarray) -> np.ndarray:
        """Samples per latent shape in every epoch's draw (the same each epoch)."""
        shape_of_group = [int(buckets[g[0]]) for g in self.groups]
        return np.bincount(shape_of_group, weights=self.quotas, minlength=int(buckets.max(initial=0)) + 1).astype(
            np.int64
        )

    def describe(self, reader: MixedReader, weights: list[float]) -> str:
        """The start line: each cache's training samples, share and effective epochs per epoch of the mixture."""
        total = float(np.sum(weights))
        parts = [
            f"{r.cache_dir} {int(n)} samples, share {w / total:.1%}, {q / max(int(n), 1):.2f} epochs"
            for r, n, w, q in zip(reader.readers, self.cache_sizes, weights, self.cache_quotas)
        ]
        return "mixture per epoch: " + "; ".join(parts)
