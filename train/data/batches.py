"""Batch assembly (in loader workers): tokenised text, cached tensors decoded together and stacked pixels, a
`ModelInputs` (theworld/model/inputs.py) packed into one buffer (`Batch`) that the main process receives and copies to
the
device in one piece."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import torch

from theworld import cache_format as cf
from theworld.core.errors import UserError
from theworld.model import objective
from theworld.model.arch import latent_side
from theworld.model.control_text import ControlText
from theworld.model.inputs import PARTNER, ModelInputs, text_batch
from theworld.model.packing import plan_rows
from theworld.model.projector import world_tokens
from theworld.model.text import ChatFormatter, PromptTooLong


class Batch:
    """A collated micro-batch packed into one flat byte buffer.

    A tensor a loader worker returns crosses to the main process as a shared-memory block of its own: created in the
    worker, its file descriptor asked of the worker by the main process (a round trip each), then pinned and
    copied to the GPU on its own. One block per batch, allocated shared in the worker so that sending it copies
    nothing, keeps that cost per batch rather than per tensor (docs/performance.md). `to(device)` gives the named
    tensors back as views of the copied buffer.
    """

    ALIGN = 64  # bytes: every tensor starts on a boundary its dtype (and vector loads) can view

    def __init__(self, tensors: dict[str, torch.Tensor], num_tokens: int):
        """`tensors`: `ModelInputs.to_tensors()`; `num_tokens`: its answer tokens (objective.token_count)."""
        self.num_tokens = num_tokens
        self.size = len(next(iter(tensors.values())))  # samples: the first tensor is the rows' input_ids
        self.layout: list[tuple[str, torch.dtype, int, tuple[int, ...]]] = []  # name, dtype, byte offset, shape
        nbytes = 0
        for name, t in tensors.items():
            self.layout.append((name, t.dtype, nbytes, tuple(t.shape)))
            nbytes += -(-t.numel() * t.element_size() // self.ALIGN) * self.ALIGN
        self.buffer = _byte_buffer(nbytes)
        for (_name, dtype, offset, shape), t in zip(self.layout, tensors.values()):
            self._view(self.buffer, dtype, offset, shape).copy_(t)

    @staticmethod
    def _view(buffer: torch.Tensor, dtype: torch.dtype, offset: int, shape: tuple[int, ...]) -> torch.Tensor:
        return buffer[offset : offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)

    def pin_memory(self) -> Batch:  # called by DataLoader(pin_memory=True)'s pinning thread
        self.buffer = self.buffer.pin_memory()
        return self

    @classmethod
    def of(cls, inputs: ModelInputs) -> Batch:
        return cls(inputs.to_tensors(), objective.token_count(inputs.labels))

    def tensors(self, device: torch.device | str) -> dict[str, torch.Tensor]:
        """The named tensors, views of the buffer copied to `device`."""
        buffer = self.buffer.to(device, non_blocking=True)
        return {name: self._view(buffer, dtype, offset, shape) for name, dtype, offset, shape in self.layout}

    def to(self, device: torch.device | str) -> ModelInputs:
        return ModelInputs.from_tensors(self.tensors(device))


def _byte_buffer(nbytes: int) -> torch.Tensor:
    if torch.utils.data.get_worker_info() is None:
        return torch.empty(nbytes, dtype=torch.uint8)
    # in a loader worker: allocate in shared memory now, as torch's default_collate does, rather than have pickling
    # copy the batch into a new shared block when it is sent
    new_shared = getattr(torch.UntypedStorage, "_new_shared", None)  # private: keep working if it goes
    if new_shared is None:
        return torch.empty(nbytes, dtype=torch.uint8).share_memory_()
    return torch.empty(0, dtype=torch.uint8).set_(new_shared(nbytes))


@dataclass(frozen=True)
class Packing:
    """train.loader.packing: each micro-batch's samples laid out several to a row of at most `pack_length` fused tokens
    (theworld/model/packing.py). `pool`, `frames`: the world block's pooling and frames (1 + world.num_world_steps)."""

    pack_length: int
    pool: int
    frames: int

    def rows(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """(B,) each sample's row, planned on its fused length: its text and its world block (one latent shape a
        micro-batch, from its cached latents or its pixels)."""
        if "latent_mean" in batch:
            h, w = batch["latent_mean"].shape[-2:]
        else:
            h, w = (latent_side(n) for n in batch["images"].shape[-2:])
        lengths = batch["attention_mask"].sum(1) + world_tokens(h, w, self.pool, self.frames)
        return torch.tensor(plan_rows(lengths.tolist(), self.pack_length), dtype=torch.long)


class Collate:
    """List of samples -> one packed Batch: tokenised and padded text, the cached tensors decoded together, stacked
    pixels, the answer-token count; with `packing`, each sample's row."""

    # cache member -> {tensor name in the member: ModelInputs field}
    CACHED = {cf.LATENT: {"mean": "latent_mean", "logvar": "latent_logvar"}, cf.SIGLIP: {"features": "siglip"}}
    OPTIONAL = {"logvar"}  # a mean-only cache (cache.latents: mean)

    def __init__(self, formatter: ChatFormatter, packing: Packing | None = None):
        self.formatter = formatter
        self.packing = packing

    def __call__(self, items: list[dict]) -> Batch:
        batch = text_batch(encode_texts(self.formatter, [it["text"] for it in items]), self.formatter.pad_id)
        batch = batch.to_tensors()
        for k in items[0]:
            prefix, member = (PARTNER, k.removeprefix(PARTNER)) if k.startswith(PARTNER) else ("", k)
            if member in self.CACHED:
                stacked = _load_stacked(k, items, tuple(self.CACHED[member]), self.OPTIONAL)
                if missing := self.CACHED[member].keys() - stacked.keys() - self.OPTIONAL:
                    raise ValueError(f"cache member {member} holds no tensor {', '.join(sorted(missing))}")
                batch.update(
                    {prefix + key: stacked[name] for name, key in self.CACHED[member].items() if name in stacked}
                )
            elif member == "rollout_questions":  # UTF-8 bytes of different lengths, zero-padded
                batch[k] = torch.nn.utils.rnn.pad_sequence([it[k] for it in items], batch_first=True)
            elif k not in ("text", "origin", PARTNER + "origin"):
                batch[k] = torch.stack([it[k] for it in items])
        if self.packing is not None:
            batch["pack_rows"] = self.packing.rows(batch)
        return Batch.of(ModelInputs.from_tensors(batch))


def _load_stacked(member: str, items: list[dict], names, optional=frozenset()) -> dict[str, torch.Tensor]:
    """cf.load_stacked; bytes that do not decode to the tensors `names` (those in `optional` may be absent; a cache
    written before member checksums) raise CacheDamaged naming the sample."""
    try:
        return cf.load_stacked([it[member] for it in items])
    except BaseException as e:
        if not isinstance(e, Exception) and type(e).__name__ != "PanicException":  # safetensors' Rust panics
            raise
        origin = PARTNER + "origin" if member.startswith(PARTNER) else "origin"
        signatures = []
        for it in items:  # find the sample at fault, for the error line
            reader, index = it[origin]
            try:
                t = cf.st_load(it[member])
                if odd := [n for n in names if n not in t and n not in optional] + [n for n in t if n not in names]:
                    raise KeyError(odd[0])
                signatures.append(tuple(sorted((n, tuple(v.shape), v.dtype) for n, v in t.items())))
            except BaseException as inner:  # noqa: BLE001 - KeyError for a missing tensor, or a decode failure
                if not isinstance(inner, Exception) and type(inner).__name__ != "PanicException":
                    raise
                raise reader.damaged(
                    index, f"member {member} does not decode to tensors {', '.join(names)} ({type(inner).__name__})"
                ) from None
        common = Counter(signatures).most_common(1)[0][0]
        odd = next((it[origin] for it, sig in zip(items, signatures) if sig != common), None)
        if odd is None:
            raise
        raise odd[0].damaged(odd[1], f"member {member} holds tensors unlike the batch's others") from None


def encode_texts(formatter: ChatFormatter, conversations: list[tuple[tuple[str, str], ...]]) -> list:
    """Each sample's conversation ((prompt, answer) turns) as ids and labels."""
    try:
        return formatter.encode_conversations(conversations)
    except PromptTooLong as e:  # in a loader worker too: cli_entry prints the error's own line
        raise UserError(f"config key 'train.loader.max_length': {e}") from None
    except ControlText as e:  # data.check_texts refuses such a cache at start; this is the last guard
        raise UserError(f"cache sample text: {e}") from None
