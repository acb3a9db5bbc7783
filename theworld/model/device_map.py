"""Big-model dispatch of a trained stage (`TheWorld.from_pretrained(..., device_map=...)`): Accelerate places each
module on a GPU, the CPU or disk (weights loaded on the fly from `offload_folder` at each forward), so a stage runs
inference split over several GPUs or larger than its GPU.

`device_map`: "auto" (Accelerate's `infer_auto_device_map` over the GPUs, then the CPU, then disk), "cpu", "disk"
(every weight read from `offload_folder`, computed on the CPU), or a mapping of TheWorld module names ("" for the
rest) to a device: "cpu", "disk", a GPU index or "cuda:N". A device this machine lacks is a one-line error naming it,
before any weight is loaded.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from theworld.core import paths
from theworld.core.errors import UserError

DeviceMap = str | int | dict
NAMED = ("auto", "cpu", "disk")
# Accelerate never splits these across devices: a layer's weights and its residual stream stay together
NO_SPLIT = ["Gemma3DecoderLayer", "SiglipEncoderLayer", "WanResidualBlock", "WanAttentionBlock", "WorldProjector"]
# Modules whose forward reads a child's weights without calling the child (nn.MultiheadAttention's out_proj): an
# offloaded one loads all its weights at once
PRELOAD = ["MultiheadAttention"]


def check(device_map: DeviceMap, offload_folder: str | Path | None) -> None:
    """A one-line UserError for a device_map that cannot run here (checked before anything loads)."""
    if isinstance(device_map, (str, int)):
        if device_map not in NAMED:
            check_device(device_map, "device_map")  # a single device for everything: "cuda:1"
    elif isinstance(device_map, dict):
        if not device_map:
            raise UserError("device_map: empty; give 'auto', 'cpu', 'disk' or module names mapped to devices")
        for name, device in device_map.items():
            if not isinstance(name, str):
                raise UserError(f"device_map: module names are text, got {name!r}")
            check_device(device, f"device_map[{name!r}]")
    else:
        raise UserError(
            f"device_map: 'auto', 'cpu', 'disk' or a mapping of module names to devices, got {device_map!r}"
        )
    disk = device_map == "disk" or (isinstance(device_map, dict) and "disk" in device_map.values())
    if disk and offload_folder is None:
        raise UserError("device_map: 'disk' needs an offload_folder (--offload-folder) to hold the offloaded weights")
    if offload_folder is not None:
        check_offload_folder(offload_folder)


def check_offload_folder(folder: str | Path) -> None:
    """`folder` is a folder or nothing yet (made at dispatch), else a one-line error naming what is there."""
    kind = paths.path_kind(folder)
    if kind not in (None, "a directory"):
        raise UserError(f"offload_folder: {folder} is {kind}; give a folder (made if missing) for offloaded weights")


def check_device(device, where: str) -> None:
    """`device` exists on this machine ("cpu", "disk", a CUDA index, "cuda[:N]"), or a one-line error naming it."""
    if device in ("cpu", "disk"):
        return
    if isinstance(device, bool) or not isinstance(device, (int, str, torch.device)):
        raise UserError(f"{where}: {device!r} is not a device ('cpu', 'disk', a GPU index or 'cuda:N')")
    text = str(device)
    index = int(text) if isinstance(device, int) else None
    m = re.fullmatch(r"cuda(?::(\d+))?", text)
    if m:
        index = int(m.group(1) or 0)
    if index is None:
        raise UserError(
            f"{where}: device {text!r} is not on this machine or not supported; use 'cpu', 'disk', a GPU index or "
            f"'cuda:N' ({_gpus()})"
        )
    if index < 0 or index >= torch.cuda.device_count():
        raise UserError(f"{where}: device {text!r} is not on this machine ({_gpus()})")


def _gpus() -> str:
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return f"it has {n} CUDA GPU{'s' if n != 1 else ''}" + (f": cuda:0 .. cuda:{n - 1}" if n > 1 else "")


def resolve(model: nn.Module, device_map: DeviceMap) -> dict[str, str | int]:
    """The module -> device mapping Accelerate dispatches `model` by."""
    if isinstance(device_map, dict):
        modules = dict(model.named_modules())
        for name in device_map:
            if name not in modules:
                raise UserError(
                    f"device_map: {name!r} is not a module of TheWorld (top level: "
                    f"{', '.join(n for n, _ in model.named_children())}; '' for the whole model)"
                )
        return device_map
    if device_map in ("cpu", "disk"):
        return {name: device_map for name, _ in model.named_children()}
    if device_map == "auto":
        from accelerate import infer_auto_device_map
        from accelerate.utils import get_max_memory

        return infer_auto_device_map(model, max_memory=get_max_memory(), no_split_module_classes=NO_SPLIT)
    return {"": device_map}


def dispatch(model: nn.Module, device_map: DeviceMap, offload_folder: str | Path | None) -> dict[str, str | int]:
    """Place `model` (weights loaded, on the CPU) as `device_map` says; returns the resolved mapping."""
    from accelerate import dispatch_model

    mapping = resolve(model, device_map)
    if "disk" in mapping.values() and offload_folder is None:
        raise UserError("device_map: 'auto' puts some weights on disk here; give an offload_folder (--offload-folder)")
    if offload_folder is not None:
        check_offload_folder(offload_folder)
        try:
            Path(offload_folder).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"offload_folder: cannot make {offload_folder} ({e.strerror})") from None
    try:
        dispatch_model(
            model,
            mapping,
            offload_dir=str(offload_folder) if offload_folder else None,
            preload_module_classes=PRELOAD,
            force_hooks=True,
        )
    except ValueError as e:  # a mapping that leaves parameters without a device
        raise UserError(f"device_map: {str(e).splitlines()[0]}") from None
    return mapping


def input_device(model: nn.Module) -> torch.device:
    """Where a dispatched model takes its inputs (its first executing device; never `meta` or disk)."""
    mapping = getattr(model, "hf_device_map", None)
    if not mapping:
        return next(model.parameters()).device
    devices = [d for d in mapping.values() if d != "disk"]
    first = devices[0] if devices else "cpu"
    return torch.device(f"cuda:{first}" if isinstance(first, int) else first)


def add_args(parser) -> None:
    """--device-map and --offload-folder of the commands that load a stage (describe, evaluate)."""
    parser.add_argument(
        "--device-map",
        help="big-model dispatch: auto, cpu, disk, cuda:N, or a JSON object of module names to devices, e.g. "
        '\'{"gemma.model.language_model": "disk", "": "cpu"}\' (default: the whole model on one device)',
    )
    parser.add_argument("--offload-folder", help="where --device-map puts the weights it offloads to disk")


def load_kwargs(args) -> dict:
    """from_pretrained's device_map and offload_folder from the parsed --device-map / --offload-folder, checked."""
    if args.device_map is None:
        if args.offload_folder is not None:
            raise UserError("--offload-folder needs --device-map (disk, auto, or a map naming 'disk')")
        return {}
    text = args.device_map.strip()
    device_map = text
    if text.startswith("{"):
        import json

        try:
            device_map = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"--device-map: not a JSON object ({e})") from None
    elif text.isdigit():
        device_map = int(text)
    check(device_map, args.offload_folder)
    return {"device_map": device_map, "offload_folder": args.offload_folder}
