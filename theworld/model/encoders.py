"""Loading the base models (Gemma 3, the Cosmos/Wan VAE) and the world encoder that runs the VAE.

`tiny`, a local folder and a hub id all go through `from_pretrained`; only where the weights come from differs.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from theworld.core import location
from theworld.core.errors import UserError, one_line
from theworld.embedded import tiny

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def load_errors() -> tuple[type[BaseException], ...]:
    """What loading a model folder raises for a broken config.json (not JSON, a missing or mistyped field:
    transformers validates fields with huggingface_hub's strict dataclasses) or missing files: one line each."""
    from huggingface_hub.errors import StrictDataclassError

    return OSError, ValueError, KeyError, TypeError, StrictDataclassError


def cannot_load(key: str, spec: str, e: BaseException) -> UserError:
    """The one line for a model folder or hub id that `load_errors` refused."""
    return UserError(f"{key}: cannot load {spec!r}: {one_line(e, 300)}")


def _quiet_hf() -> None:
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    diffusers_logging.set_verbosity_error()


def resolve_gemma(spec: str) -> str:
    return pretrained(spec, tiny.TINY_GEMMA_DIR)[0]


def pretrained(spec: str, tiny_dir: str) -> tuple[str, dict]:
    """(what from_pretrained takes, its revision keyword) for a model spec: the tiny model's folder (built once), a
    hub id's repo and revision (`user/name@rev`), or the spec itself (a local folder)."""
    where = location.model(spec)
    if isinstance(where, location.Tiny):
        return str(tiny.ensure(tiny_dir)), {}
    if isinstance(where, location.HubId) and where.revision:
        return where.repo, {"revision": where.revision}
    return spec, {}


def resolve_vae(spec: str) -> tuple[str, str | None]:
    """(path or hub id, subfolder) for a VAE spec: tiny, a VAE folder, a pipeline folder with vae/, or a hub id."""
    if location.is_tiny(spec):
        return str(tiny.ensure(tiny.TINY_VAE_DIR)), None
    p = Path(spec)
    if p.is_dir():
        if (p / "config.json").is_file():
            return spec, None
        if (p / "vae" / "config.json").is_file():
            return spec, "vae"
        raise UserError(f"model.vae: {spec} has neither config.json nor vae/config.json")
    where = location.model(spec)  # a hub id: the pipeline repo (nvidia/Cosmos-Predict2-2B-Video2World), VAE in vae/
    return (where.repo if isinstance(where, location.HubId) else spec), "vae"


def _offline() -> bool:
    from huggingface_hub import constants

    flags = (os.environ.get(k, "") for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return constants.HF_HUB_OFFLINE or any(f.upper() in ("1", "ON", "YES", "TRUE") for f in flags)


def check_available(spec: str, key: str, config_file: str = "config.json") -> None:
    """Before from_pretrained: a spec that is neither a folder here nor (offline) in the Hugging Face cache gets a
    line saying exactly that, not the loader's "does not appear to have a file named config.json"."""
    where = location.model(spec)
    if isinstance(where, location.Local) and not where.path.exists():
        raise UserError(f"{key}: {spec!r} is not a folder here (nor a hub id of the form org/name)")
    if not isinstance(where, location.HubId) or not _offline():
        return
    from huggingface_hub import constants, try_to_load_from_cache

    if not isinstance(try_to_load_from_cache(where.repo, config_file, revision=where.revision), str):
        raise UserError(
            f"{key}: {spec!r} is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and "
            "HF_HUB_OFFLINE is set, so it cannot be downloaded: download it once where the network is "
            f"reachable ({hub_download_command()} download {spec}), or give a local folder"
        )


def hub_download_command() -> str:
    """The download command the installed huggingface_hub provides: `hf` since 0.34, `huggingface-cli` before."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        scripts = {e.name for e in distribution("huggingface_hub").entry_points if e.group == "console_scripts"}
    except PackageNotFoundError:
        scripts = set()
    return "hf" if "hf" in scripts or "huggingface-cli" not in scripts else "huggingface-cli"


def load_gemma(spec: str, dtype: str = "bfloat16"):
    """(Gemma3ForConditionalGeneration, Gemma3Processor) from `tiny`, a local folder or a hub id."""
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    _quiet_hf()
    check_available(spec, "model.gemma")
    path, revision = pretrained(spec, tiny.TINY_GEMMA_DIR)
    try:
        model = Gemma3ForConditionalGeneration.from_pretrained(path, dtype=DTYPES[dtype], **revision)
        processor = AutoProcessor.from_pretrained(path, **revision)
    except load_errors() as e:
        raise cannot_load("model.gemma", spec, e) from None
    return model.eval(), processor


def load_vae(spec: str, dtype: str = "bfloat16"):
    from diffusers import AutoencoderKLWan
    from diffusers.utils import logging as diffusers_logging

    _quiet_hf()
    check_available(spec, "model.vae", "vae/config.json")  # a hub id is the pipeline repo, the VAE in vae/
    path, subfolder = resolve_vae(spec)
    revision = pretrained(spec, tiny.TINY_VAE_DIR)[1]
    level = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity(diffusers_logging.CRITICAL)  # it logs each failed try: our one line says it
    try:
        vae = AutoencoderKLWan.from_pretrained(path, subfolder=subfolder, torch_dtype=DTYPES[dtype], **revision)
    except load_errors() as e:
        raise cannot_load("model.vae", spec, e) from None
    finally:
        diffusers_logging.set_verbosity(level)
    return vae.eval()


def weights_hash(module: nn.Module) -> str:
    """sha256 over parameter names, dtypes, shapes and bytes: two modules hash equal iff their weights are equal."""
    h = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def config_digest(config: dict) -> str:
    drop = {"_name_or_path", "_diffusers_version", "transformers_version", "_commit_hash", "torch_dtype", "dtype"}
    clean = {k: v for k, v in config.items() if k not in drop}
    return hashlib.sha256(json.dumps(clean, sort_keys=True, default=str).encode()).hexdigest()[:16]


@functools.cache
def _single_frame_conv_class() -> type:
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

    class SingleFrameCausalConv3d(WanCausalConv3d):
        """A causal conv3d that sees one frame and no cached frames pads that frame with kt-1 zero frames in front, so
        only the kernel's last time tap ever touches data: a conv2d with that slice is the same function with 1/kt of
        the multiply-adds (and cuDNN's 2-D kernels are much faster than its 3-D ones). Anything else, as before."""

        def forward(self, x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
            kt = self.kernel_size[0]
            if x.shape[2] != 1 or cache_x is not None or self._padding[4] != kt - 1 or self.stride[0] != 1:
                return super().forward(x, cache_x)
            pad_w, pad_h = self._padding[0], self._padding[2]
            y = F.conv2d(
                x[:, :, 0],
                self.weight[:, :, -1],
                self.bias,
                stride=self.stride[1:],
                padding=(pad_h, pad_w),
                dilation=self.dilation[1:],
            )
            return y.unsqueeze(2)

    return SingleFrameCausalConv3d


def use_single_frame_convs(vae: nn.Module) -> int:
    """Switch the VAE's causal convs to the single-frame fast path (same weights, same state_dict); returns how many
    were switched. Images are one-frame videos, so every encoder conv takes the fast path."""
    fast = _single_frame_conv_class()
    n = 0
    for m in vae.modules():
        if type(m) is fast.__base__:  # diffusers' WanCausalConv3d
            m.__class__ = fast
            n += 1
    return n


class WorldEncoder(nn.Module):
    """The Cosmos (Wan 2.1) VAE as an image -> posterior (mean, logvar) function, batched.

    Input: (B, 3, H, W) uint8 RGB (what the loaders produce) or float already in [-1, 1]. Output: mean and logvar,
    each (B, 16, 1, H/8, W/8) in the VAE's dtype. Runs under no_grad while the VAE is frozen.
    """

    def __init__(self, vae: nn.Module):
        super().__init__()
        self.vae = vae
        use_single_frame_convs(vae)
        self.channels_last = False
        cfg = vae.config
        self.register_buffer("latents_mean", torch.tensor(cfg.latents_mean, dtype=torch.float32), persistent=False)
        self.register_buffer("latents_std", torch.tensor(cfg.latents_std, dtype=torch.float32), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.vae.parameters()).dtype

    @property
    def frozen(self) -> bool:
        return not any(p.requires_grad for p in self.vae.parameters())

    @staticmethod
    def to_unit_range(pixels: torch.Tensor) -> torch.Tensor:
        """uint8 [0, 255] -> float [-1, 1] (float input is assumed to be in [-1, 1] already)."""
        return pixels.float() / 127.5 - 1.0 if pixels.dtype == torch.uint8 else pixels

    def forward(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.to_unit_range(pixels).to(self.dtype).unsqueeze(2)  # frame axis: one image is a 1-frame video
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last_3d)
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.frozen):
            posterior = self._posterior(x)
        return posterior.mean, posterior.logvar

    def _posterior(self, x: torch.Tensor):
        from diffusers import AutoencoderKLWan
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

        vae = self.vae
        if (
            not isinstance(vae, AutoencoderKLWan)
            or vae.config.get("patch_size") is not None
            or vae.use_tiling
            or vae.use_slicing
        ):
            return vae.encode(x).latent_dist
        # Wan's encode runs the encoder with a temporal feature cache, which a single frame never reads (every conv's
        # cached input is None on the first chunk); without it the function is the same, minus a clone of every
        # conv's input, and the graph has no list mutation for torch.compile to trace.
        return DiagonalGaussianDistribution(vae.quant_conv(vae.encoder(x)))

    def optimize_for_inference(self, channels_last: bool, compile: bool) -> None:
        """For a frozen encoder. `channels_last` (GPU): conv weights in channels-last layout (cuDNN's bf16
        convolutions are NHWC) and, with `compile`, torch.compile of the VAE
        encoder, which fuses the fp32 RMS norms and SiLUs that eager mode runs as separate passes over every activation
        (docs/performance.md). Outputs match the eager ones to bf16 rounding."""
        self.channels_last = channels_last
        for p in self.vae.parameters() if channels_last else ():
            if p.dim() in (4, 5):
                p.data = p.data.contiguous(
                    memory_format=torch.channels_last if p.dim() == 4 else torch.channels_last_3d
                )
        if compile:
            self.vae.encoder.compile()
