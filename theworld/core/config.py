"""Strict YAML -> dataclass configs.

Every command loads its config through `load_config`, before any model is touched: an unknown key, a wrong type or a
value outside its choices is a `UserError` naming the dotted key, so a typo costs a second, not a model load.
The model's sections live in theworld/model/config.py; each command's top-level dataclass lives with the command
(precompute/config.py, train/config.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import keyword
import logging
import math
import os
import re
import reprlib
import types
import typing
from dataclasses import field
from pathlib import Path
from typing import Any, Literal, TypeVar

import numpy as np
import yaml

from theworld.core import compat, location, log, paths
from theworld.core.errors import UserError, one_line

T = TypeVar("T")
_log = log.get(__name__)

LINE = 200  # the most of a value an error line echoes
_SHOWN = reprlib.Repr()
_SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlong, _SHOWN.maxlist, _SHOWN.maxdict, _SHOWN.maxlevel = 60, 60, 40, 6, 6, 3


def shown(value: Any) -> str:
    """`repr(value)` cut to a line, with an ellipsis where it was cut (a value may be megabytes of text or a
    deeply nested list), so an error line stays one readable line."""
    return _SHOWN.repr(value)


# ----------------------------------------------------------------------------------------------------------------------
# Loading


class _Text:
    """A `--set` value YAML reads as a number or a bool. A key that takes text gets it as typed (output_dir=007,
    mixed_precision=no); any other key gets the YAML value."""

    def __init__(self, raw: str, parsed: Any):
        self.raw, self.parsed = raw, parsed

    def __repr__(self) -> str:  # inside a mapping an error line shows
        return repr(self.parsed)


def _takes_text(tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return all(isinstance(c, str) for c in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return any(_takes_text(a) for a in typing.get_args(tp))
    return tp is str


def _check_value(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if isinstance(value, _Text) and origin not in (typing.Union, types.UnionType):  # a union asks each member
        value = value.raw if _takes_text(tp) else value.parsed
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise UserError(f"config key '{key}': expected a mapping, got {type(value).__name__}")
        return _build(tp, value, key + ".")
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices or type(value) is not type(choices[0]):
            raise UserError(f"config key '{key}': must be one of {list(choices)}, got {shown(value)}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _check_value(value, arg, key)
            except UserError as e:
                if dataclasses.is_dataclass(arg) and isinstance(value, dict):  # a section's own keys: its own error
                    raise
                errors.append(str(e))
        raise UserError(errors[0] if len(errors) == 1 else f"config key '{key}': {shown(value)} has the wrong type")
    if tp is dict:  # a mapping passed on as it is (storage.options: the keys are the library's)
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise UserError(f"config key '{key}': expected a mapping with text keys, got {shown(value)}")
        return _plain(value)
    if origin is list:
        if not isinstance(value, list):
            raise UserError(f"config key '{key}': expected a list, got {type(value).__name__}")
        (item,) = typing.get_args(tp)
        return [_check_value(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        value = _check_int(value, key)
        return float(value)
    if tp is float and isinstance(value, str):  # YAML 1.1 reads "1e-3" (no dot) as a string
        try:
            value = float(value)
        except ValueError:
            pass
    if tp in (int, float, str, bool):
        if type(value) is not tp:
            raise UserError(f"config key '{key}': expected {tp.__name__}, got {type(value).__name__} {shown(value)}")
        if tp is float and not math.isfinite(value):  # .inf / .nan would train to NaN or disable a check silently
            raise UserError(f"config key '{key}': must be a finite number, got {shown(value)}")
        if tp is float and abs(value) > FLOAT32_MAX:  # the tensors it multiplies are float32 (or narrower): inf
            raise UserError(f"config key '{key}': {value:g} does not fit float32 (at most {FLOAT32_MAX:.4g})")
        return _check_int(value, key) if tp is int else value
    raise TypeError(f"unsupported config type {tp} for {key}")


def _plain(value: Any) -> Any:
    """A free-form config value with `--set` values as YAML read them."""
    if isinstance(value, _Text):
        return value.parsed
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


FLOAT32_MAX = float(np.finfo(np.float32).max)
INT_LIMIT = 2**63 - 1  # what numpy, torch and the C libraries under them hold; any key's own limit is lower


def _check_int(value: int, key: str) -> int:
    if abs(value) > INT_LIMIT:
        raise UserError(f"config key '{key}': {shown(value)} is too large (at most {INT_LIMIT})")
    return value


def config_key(name: str) -> str:
    """The config key of a dataclass field: its name, but a Python keyword's field carries a trailing underscore
    (`async_` is the key `async`)."""
    stem = name[:-1]
    return stem if name.endswith("_") and keyword.iskeyword(stem) else name


def _build(cls: type[T], data: dict, prefix: str = "") -> T:
    hints = typing.get_type_hints(cls)
    names = {config_key(f.name): f.name for f in dataclasses.fields(cls)}
    for k in data:
        if k not in names:
            raise UserError(f"unknown config key {shown(prefix + str(k))} (known here: {', '.join(sorted(names))})")
    kwargs = {names[k]: _check_value(v, hints[names[k]], prefix + k) for k, v in data.items()}
    return cls(**kwargs)


def _parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise UserError(f"--set expects key=value, got {shown(text)}")
    key, raw = text.split("=", 1)
    try:
        value = yaml_load(raw, f"--set {key.strip()}") if raw != "" else ""
    except RecursionError:
        raise UserError(f"--set {key.strip()}: value nested too deeply to be a config value") from None
    except yaml.YAMLError as e:
        raise UserError(
            f"--set {key.strip()}: value {shown(raw)} is not valid YAML ({str(e).splitlines()[0]}); quote it"
        ) from None
    return key.strip().split("."), _Text(raw, value) if isinstance(value, (bool, int, float)) else value


def _apply_override(data: dict, path: list[str], value: Any) -> None:
    node = data
    for part in path[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise UserError(f"--set {'.'.join(path)}: '{part}' is not a section")
    node[path[-1]] = value


MAX_YAML_VALUES = 100_000  # scalars, lists and mappings of a config once its aliases are expanded (a config has
# a few hundred; an alias bomb of a few hundred bytes has billions)


def _expanded_size(node: yaml.Node, sizes: dict[int, int], open_: set[int], where: str) -> int:
    """How many nodes `node` stands for once every alias is expanded, memoised by node (an alias is the same node
    object), so the count costs one visit per distinct node however far the aliases would expand."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_:
        raise UserError(f"{where}: a YAML alias refers to its own anchor (an endless value)")
    open_.add(key)
    if isinstance(node, yaml.MappingNode):
        children = [n for pair in node.value for n in pair]
    elif isinstance(node, yaml.SequenceNode):
        children = node.value
    else:
        children = []
    total = 1
    for child in children:
        total += _expanded_size(child, sizes, open_, where)
        if total > MAX_YAML_VALUES:
            break
    open_.discard(key)
    sizes[key] = total
    return total


def yaml_load(text: str, where: str) -> Any:
    """`yaml.safe_load`, refusing a document whose aliases expand beyond MAX_YAML_VALUES values (checked on the
    composed node graph, before anything is built). `where` names the source in the error line."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if _expanded_size(node, {}, set(), where) > MAX_YAML_VALUES:
            raise UserError(
                f"{where}: more than {MAX_YAML_VALUES:,} values once its YAML aliases are expanded; a "
                "config has a few hundred (an alias bomb?)"
            )
        try:
            return loader.construct_document(node)
        except ValueError as e:  # an integer of thousands of digits (Python's int-from-text limit)
            raise UserError(f"{where}: a value YAML cannot build ({one_line(str(e), LINE)})") from None
    finally:
        loader.dispose()


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, which a scheduler's allocation narrows)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


# Upper bounds of the size-like keys: each sizes an allocation or a loop, so a mistyped value (a few zeros too many)
# would exhaust memory or never end instead of failing. Each bound is far above any real use; the hint says what is.
SIZE_LIMITS: dict[str, tuple[int, str]] = {
    "lora.r": (4096, "LoRA ranks are 4-256 (default 16)"),
    "train.eval.caption_tokens": (4096, "a caption is tens of tokens (default 32)"),
    "train.eval.captions": (4096, "a few held-out samples are captioned at each eval (default 8)"),
    "train.eval.samples": (10_000_000, "a few hundred held-out samples are enough (default 256)"),
    "train.global_batch_size": (1 << 20, "global batches are tens to thousands (default 32)"),
    "train.max_micro_batch_size": (1 << 16, "what one forward fits in memory (default 32)"),
    "train.micro_batch_size": (1 << 16, "what one forward fits in memory, or auto"),
    "train.eval.batch_size": (1 << 16, "what one forward fits in memory (0: train.micro_batch_size)"),
    "train.loader.max_length": (1 << 20, "Gemma 3 reads at most 131072 tokens (0: no cap)"),
    "train.eval.plateau.window_evals": (1 << 20, "a few evals (0: the last 5,000 steps)"),
    "world.rollout.inference_steps": (1000, "the Video2World sampler takes tens of denoising steps (default 35)"),
    "profile.steps": (1000, "a few steps make a readable trace (default 5)"),
    "profile.top": (10_000, "the operations printed (default 15)"),
    "shard_size": (1 << 20, "samples per cache shard (default 512)"),
    "batch_size": (1 << 16, "images per VAE forward (default 32)"),
}


def check_sizes(section: object, prefix: str = "") -> None:
    """SIZE_LIMITS for the keys of one config section (`prefix`: its dotted name, "" at the top level): a one-line
    error with what a real value is."""
    for key, (limit, hint) in SIZE_LIMITS.items():
        head, _, name = key.rpartition(".")
        value = getattr(section, name, None) if head == prefix.rstrip(".") else None
        if isinstance(value, int) and not isinstance(value, bool) and value > limit:
            raise UserError(f"config key '{key}': {shown(value)} is too large (at most {limit:,}; {hint})")


def at_least(section: object, prefix: str, least: int, *names: str) -> None:
    """Each of `names` in `section` (dotted name `prefix`) is >= `least`: the one-line error otherwise."""
    for name in names:
        value = getattr(section, name)
        if value < least:
            need = "positive" if least == 1 else f">= {least}"
            raise UserError(f"config key '{prefix}.{name}': must be {need}, got {value}")


WORKERS_PER_CORE = 8  # loader workers mostly wait on I/O and decoding: a few per core help, thousands only thrash


def check_workers(key: str, value: int) -> None:
    """A count of worker processes the machine can hold: every one is a process with its own memory."""
    limit = WORKERS_PER_CORE * usable_cores()
    if value > limit:
        raise UserError(
            f"config key '{key}': {shown(value)} worker processes on a machine with {usable_cores()} "
            f"usable CPU cores; at most {limit} ({WORKERS_PER_CORE} per core)"
        )


def check_threads(key: str, value: int) -> None:
    """A thread count: more threads than cores only makes them wait for each other."""
    if value > usable_cores():
        raise UserError(
            f"config key '{key}': {shown(value)} threads on a machine with {usable_cores()} usable CPU "
            f"cores; at most {usable_cores()}"
        )


def require_path(key: str, value: str) -> None:
    """A folder a run writes or reads: a blank value would mean the current directory, where a cache's or a run's files
    would land among the user's own."""
    if not value.strip():
        raise UserError(f"config key '{key}': empty; give a folder path")
    location.place(value, f"config key '{key}':")  # a URL that names no object: one line now, not at its first use


def load_config(cls: type[T], path: str | Path | None, overrides: list[str] = ()) -> T:
    """Read YAML at `path` (or nothing), apply `key.sub=value` overrides, validate strictly into `cls`."""
    data: dict = {}
    if path is not None:
        p = resolve_config_path(path)
        try:
            data = yaml_load(p.read_bytes().decode("utf-8"), f"config file {p}") or {}
        except UnicodeDecodeError as e:
            raise UserError(
                f"config file {p} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start})"
            ) from None
        except OSError as e:
            raise UserError(f"config file {p}: cannot read it ({e.strerror})") from None
        except RecursionError:
            raise UserError(f"config file {p} is nested too deeply to be a config") from None
        except yaml.YAMLError as e:
            raise UserError(f"config file {p} is not valid YAML: {str(e).splitlines()[0]}") from None
        if not isinstance(data, dict):
            raise UserError(f"config file {p}: top level must be a mapping")
    moves, renamed = moved_keys(cls), {}
    data = _move_keys(data, moves, renamed)  # first, so that a --set of either name wins over the file
    given: dict[str, str] = {}  # old key -> the name a --set gave it by
    for text in overrides:
        key, value = _parse_override(text)
        _one_name(key, moves, given)
        _apply_override(data, _moved_path(key, moves, renamed), value)
    return from_dict(cls, data, renamed)


def _one_name(path: list[str], moves: dict[str, compat.Move], given: dict[str, str]) -> None:
    """Two --set of one key under its old and its new name are refused as a file with both is: which one wins would
    depend on their order."""
    dotted = ".".join(path)
    for old, move in moves.items():
        new = move.new
        name = next((n for n in (old, new) if dotted == n or dotted.startswith(n + ".")), None)
        if name is None:
            continue
        if given.setdefault(old, name) != name:
            raise UserError(f"config keys '{old}' and '{new}' are one key ({old} is its earlier name); give only {new}")
        return


def from_dict(cls: type[T], data: dict, renamed: dict[str, str] | None = None) -> T:
    """Validate a mapping strictly into `cls` (what `load_config` does after reading the YAML). Keys of earlier
    releases (`cls.MOVED`) load under their new names, said in one warning line; `renamed`: those already moved."""
    renamed = {} if renamed is None else renamed
    data = _move_keys(data, moved_keys(cls), renamed)
    if renamed:
        _log.warning(
            one_line(
                "config: keys of an earlier release, read under their new names: "
                + ", ".join(f"{old} -> {new}" for old, new in renamed.items()),
                4 * LINE,
            )
        )
    try:
        return _build(cls, data)
    except TypeError as e:  # a required field missing, etc.
        raise UserError(one_line(f"config: {e}", 4 * LINE)) from None
    except RecursionError:
        raise UserError("config: a value is nested too deeply to be a config value") from None
    except UserError as e:  # a check that echoed a huge value (a megabyte string, a long list) still gives one line
        raise type(e)(one_line(_as_given(str(e), renamed), 4 * LINE)) from None


def moved_keys(cls: type) -> dict[str, compat.Move]:
    """`cls.MOVED`: each key of an earlier release (dotted), the key it is now and the release that moved it, read
    while theworld/core/compat.py's rule says so."""
    return getattr(cls, "MOVED", {})


def _moved_path(path: list[str], moves: dict[str, compat.Move], renamed: dict[str, str]) -> list[str]:
    """A --set key, or a key under it, that an earlier release named otherwise, under its new name."""
    dotted = ".".join(path)
    for old, move in moves.items():
        if dotted == old or dotted.startswith(old + "."):
            compat.refuse_expired(old, move)
            renamed[old] = move.new
            return (move.new + dotted[len(old) :]).split(".")
    return path


def _move_keys(data: dict, moves: dict[str, compat.Move], renamed: dict[str, str]) -> dict:
    """`data` with each old key of `moves` put where its new key lives; both given at once is an error."""
    for old, move in moves.items():
        *parents, last = old.split(".")
        node = data
        for p in parents:
            node = node.get(p) if isinstance(node, dict) else None
        if not isinstance(node, dict) or last not in node:
            continue
        compat.refuse_expired(old, move)
        new = move.new
        value = node.pop(last)
        *parents, last = new.split(".")
        target = data
        for i, p in enumerate(parents):
            target = target.setdefault(p, {})
            if not isinstance(target, dict):
                raise UserError(f"config key '{'.'.join(parents[: i + 1])}': expected a mapping, got {shown(target)}")
        if last in target:
            raise UserError(f"config keys '{old}' and '{new}' are one key ({old} is its earlier name); give only {new}")
        target[last] = value
        renamed[old] = new
    return data


def _as_given(message: str, renamed: dict[str, str]) -> str:
    """An error about a key the user gave by its earlier name names it as given, and the new name beside it."""
    for old, new in renamed.items():
        message = re.sub(rf"'{re.escape(new)}((?:\.[^']*)?)'", rf"'{old}\1' (now '{new}\1')", message)
    return message


CONFIGS_DIR = "configs"  # where the shipped configs live, under the repository root


def resolve_config_path(path: str | Path) -> Path:
    """`path` itself when it is a file; a bare name that is not (e.g. `stage1.yaml`, the design's own command) is
    looked up in ./configs/ and then in this checkout's configs/, and the run says which file it used."""
    p = Path(path)
    if p.is_file():
        return p
    if p.parent == Path(".") and p.name:
        for folder in (Path.cwd() / CONFIGS_DIR, Path(__file__).resolve().parents[2] / CONFIGS_DIR):
            if (folder / p.name).is_file():
                found = folder / p.name
                rel = found.relative_to(Path.cwd()) if found.is_relative_to(Path.cwd()) else found
                if int(os.environ.get("RANK", "0")) == 0:  # once under a launcher
                    _log.info(f"config: {p} is not a file in {Path.cwd()}; using {rel}")
                return found
    what = paths.path_kind(p)
    if what is None:
        raise UserError(f"config file not found: {p}")
    raise UserError(f"config file {p} is {what}, not a regular file")


_SECRET = re.compile(r"secret|token|password|passwd|credential|key", re.IGNORECASE)


def to_dict(cfg: Any) -> dict:
    """The config as plain data, as it is shown and saved: secrets in `storage.options` left out."""
    d = _keyed(dataclasses.asdict(cfg), cfg)
    storage = d.get("storage")
    if isinstance(storage, dict) and isinstance(storage.get("options"), dict):
        storage["options"] = {k: "<redacted>" if _SECRET.search(k) else v for k, v in storage["options"].items()}
    return d


def _keyed(d: Any, obj: Any) -> Any:
    """`dataclasses.asdict`'s plain data with each field under its config key (`config_key`)."""
    if dataclasses.is_dataclass(obj):
        return {config_key(f.name): _keyed(d[f.name], getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list):
        return [_keyed(x, o) for x, o in zip(d, obj)]
    return d


def to_yaml(cfg: Any) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


class _LogLevel(argparse.Action):
    """--quiet / --verbose: the level applies as the flag is parsed, before the command says anything."""

    def __init__(self, option_strings, dest, const, help):
        super().__init__(option_strings, dest, nargs=0, const=const, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        log.set_level(self.const)


class ArgParser(argparse.ArgumentParser):
    """argparse whose usage errors are a `UserError`: one line naming the command, exit 2 (through `cli_entry`).
    Every command gets --quiet and --verbose (theworld/core/log.py)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        levels = self.add_mutually_exclusive_group()
        levels.add_argument("--quiet", action=_LogLevel, const=logging.WARNING, help="only warnings and errors")
        levels.add_argument("--verbose", action=_LogLevel, const=logging.DEBUG, help="also debugging lines")

    def error(self, message: str) -> typing.NoReturn:
        raise UserError(f"{self.prog}: {message}")


class DefaultsHelp(argparse.HelpFormatter):
    """--help shows each option's default, where it has one worth showing (not a flag's False, not None)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False, "", argparse.SUPPRESS) or "%(default)" in text or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)".lstrip()


def add_config_args(p: argparse.ArgumentParser, config_help: str = "YAML config file") -> None:
    p.add_argument("--config", help=config_help)
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set train.optimizer.lr=1e-3 (repeatable)",
    )


def cli_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The `--config CFG [--set key=value ...]` front every command shares."""
    p = ArgParser(prog=prog, description=description)
    add_config_args(p)
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    return p


__all__ = [
    "at_least",
    "load_config",
    "from_dict",
    "to_dict",
    "to_yaml",
    "ArgParser",
    "add_config_args",
    "cli_parser",
    "field",
]
