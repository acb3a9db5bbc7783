"""LoRA adapters on TheWorld's Gemma, through peft (config section `lora`, docs/training.md "LoRA").

peft injects the adapters into the Gemma module in place, so TheWorld keeps its structure and parameter names: an
adapted layer `gemma.<path>.q_proj` holds its frozen base weight as `q_proj.base_layer.weight` and the adapters as
`q_proj.lora_A.default.weight` / `lora_B`. A LoRA stage's trainable tensors are the adapters (plus the projector and any
fully trained part); `adapter_files` writes the language/vision adapters as a peft adapter folder for the plain Gemma.
"""

from __future__ import annotations

import json
import re

import torch
from torch import nn

from theworld.model.arch import PARTS
from theworld.model.config import LoraConfig

ADAPTER = "default"  # peft's adapter name inside the model
ADAPTER_CONFIG = "adapter_config.json"  # peft's adapter folder layout
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # peft's prefix of a Gemma tensor name in an adapter folder
ADAPTER_NAME = re.compile(rf"^gemma\.(.+\.lora_[AB])\.{ADAPTER}\.weight$")


def peft_config(lora: LoraConfig, base: str | None = None):
    """The peft LoraConfig for `lora` on a Gemma3ForConditionalGeneration: one regex restricted to the LoRA parts, so
    a name shared by both towers (q_proj) is adapted only where asked."""
    from peft import LoraConfig as PeftLoraConfig

    # the parts' module paths inside Gemma3ForConditionalGeneration: the names peft matches
    parts = "|".join(
        re.escape(path.removeprefix("gemma.")) for p in lora.parts for path in PARTS[p] if path.startswith("gemma.")
    )
    names = "|".join(re.escape(m) for m in lora.target_modules)
    return PeftLoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=rf"({parts})\..*\.({names})",
        base_model_name_or_path=base,
    )


def apply(gemma: nn.Module, lora: LoraConfig) -> int:
    """Inject adapters into `gemma` in place (initialised from the global torch RNG: lora_A random, lora_B zero, so
    the model's output is unchanged). Returns the number of adapted layers. Trainability is TheWorld.set_freeze's."""
    try:
        from peft.tuners.lora import LoraModel
    except ImportError:
        from theworld.core.errors import UserError

        raise UserError(
            "config section 'lora': LoRA adapters need peft, which is not installed (pip install -e .[lora])"
        ) from None
    flags = {n: p.requires_grad for n, p in gemma.named_parameters()}
    LoraModel(gemma, peft_config(lora), ADAPTER)
    for n, p in gemma.named_parameters():  # peft froze everything but its adapters: give the caller's flags back
        p.requires_grad_(flags.get(_base_name(n), p.requires_grad))
    return len(adapted_layers(gemma))


def adapted_layers(module: nn.Module) -> dict[str, nn.Module]:
    if not any(is_adapter(n) for n, _ in module.named_parameters()):
        return {}  # a plain model, where peft need not be installed
    from peft.tuners.tuners_utils import BaseTunerLayer

    return {n: m for n, m in module.named_modules() if isinstance(m, BaseTunerLayer)}


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def adapted_name(name: str, params: dict) -> str:
    """`name` of a plain model's tensor as this model calls it: `x.q_proj.weight` is `x.q_proj.base_layer.weight`
    where the layer carries adapters."""
    if name in params:
        return name
    head, _, leaf = name.rpartition(".")
    base = f"{head}.base_layer.{leaf}"
    return base if base in params else name


def _base_name(name: str) -> str:
    """A LoRA-adapted layer's base parameter name as the plain model has it."""
    return name.replace(".base_layer.", ".")


def merge(gemma: nn.Module) -> int:
    """Fold every adapter into its base weight (peft's merge) and put the plain layer back, in place: the result is a
    plain Gemma with the plain parameter names. Returns the number of layers merged."""
    layers = adapted_layers(gemma)
    for name, layer in layers.items():
        layer.merge(adapter_names=[ADAPTER])
        parent_name, _, child = name.rpartition(".")
        setattr(gemma.get_submodule(parent_name) if parent_name else gemma, child, layer.get_base_layer())
    if hasattr(gemma, "peft_config"):
        del gemma.peft_config
    return len(layers)


def merge_into(gemma: nn.Module, lora: LoraConfig, adapters: dict[str, torch.Tensor]) -> int:
    """A LoRA stage's adapters (TheWorld names, whole tensors) merged into a plain `gemma`'s base weights, in place;
    requires_grad flags are kept. Returns the number of layers merged."""
    flags = {n: p.requires_grad for n, p in gemma.named_parameters()}
    apply(gemma, lora)
    params = dict(gemma.named_parameters())
    with torch.no_grad():
        for name, t in adapters.items():
            own = name.removeprefix("gemma.")
            if own not in params or params[own].shape != t.shape:
                from theworld.core.errors import UserError

                raise UserError(f"LoRA adapter {name} does not fit this model (no such layer, or another shape)")
            params[own].copy_(t.to(params[own].dtype))
    n = merge(gemma)
    for name, p in gemma.named_parameters():
        p.requires_grad_(flags[name])
    return n


def adapter_files(lora: LoraConfig, base: str, weights: dict[str, torch.Tensor]) -> dict:
    """{file name: writer(path)} of a peft adapter folder (adapter_config.json, adapter_model.safetensors) holding
    the adapters in `weights` (TheWorld names): `PeftModel.from_pretrained(gemma, folder)` reads it."""
    from safetensors.torch import save_file

    tensors = {
        PEFT_PREFIX + m.group(1) + ".weight": t.contiguous() for n, t in weights.items() if (m := ADAPTER_NAME.match(n))
    }
    config = peft_config(lora, base).to_dict()
    return {
        ADAPTER_CONFIG: lambda p: p.write_text(json.dumps(_jsonable(config), indent=2, sort_keys=True)),
        ADAPTER_WEIGHTS: lambda p: save_file(tensors, str(p), metadata={"format": "pt"}),
    }


def _jsonable(value):
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (set, tuple, list)):
        return [_jsonable(v) for v in value]
    return value if value is None or isinstance(value, (str, int, float, bool)) else str(value)


def count(module: nn.Module) -> int:
    """Adapter parameters in `module`."""
    return sum(p.numel() for n, p in module.named_parameters() if is_adapter(n))


__all__ = ["adapter_files", "apply", "count", "is_adapter", "merge", "merge_into", "peft_config"]
