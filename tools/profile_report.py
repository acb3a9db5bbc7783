"""`python -m tools.profile_report RUN_DIR [--top N] [--rank R]`: a markdown report of the trace `profile:` wrote
(RUN_DIR/profile/trace-rank<R>.json, torch.profiler's Chrome trace): the top operations by self time, the time of
each part of a step (the `theworld:` labels of theworld.model.world.PROFILE_LABELS, communication by operation name),
and
what the shares suggest. Times are host-side (CPU) time; on a GPU the top kernels by device time follow."""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

from theworld.core.config import ArgParser
from theworld.core.errors import UserError, cli_entry
from theworld.core.paths import REGULAR, path_kind
from theworld.model.world import PROFILE_LABELS

CATEGORIES = {
    "world_encoder": "world encoder (VAE)",
    "vision_tower": "vision tower (SigLIP)",
    "language_model": "language model forward",
    "backward": "backward",
    "projector": "world projector",
    "optimizer": "optimizer",
    "data": "data wait",
    "communication": "communication",
    "other": "other",
}
LABEL_TO_PART = {label: part for part, label in PROFILE_LABELS.items()}
COMM_WORDS = (
    "nccl",
    "gloo",
    "c10d::",
    "allreduce",
    "all_reduce",
    "allgather",
    "all_gather",
    "reduce_scatter",
    "broadcast_",
    "record_param_comms",
)
HOST_CATS = ("cpu_op", "user_annotation")
ADVICE = [  # (part, share above which it is worth saying, what to try)
    (
        "data",
        0.10,
        "the loader is behind: raise train.loader.num_workers, and keep latents and SigLIP features cached "
        "(precompute with cache.siglip: true)",
    ),
    ("world_encoder", 0.10, "the VAE runs live: train from cached latents (precompute them)"),
    ("vision_tower", 0.10, "the vision tower runs live: with freeze.vision, cache its features (cache.siglip: true)"),
    (
        "communication",
        0.15,
        "communication-bound: fewer, larger steps (raise train.micro_batch_size or accumulate), "
        "or train.hardware.sharding: ddp where the model fits",
    ),
    (
        "optimizer",
        0.15,
        "the optimizer step is heavy: fewer trainable parts (freeze), or train.hardware.sharding: fsdp to shard its "
        "state",
    ),
    ("projector", 0.15, "the world projector is a large share: a lighter world.projector or pooling (world.pool)"),
]


def load_trace(path: Path) -> list[dict]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: not a readable Chrome trace ({type(e).__name__})") from None
    events = data.get("traceEvents") if isinstance(data, dict) else None
    if not isinstance(events, list):
        raise UserError(f"{path}: no traceEvents (not a torch.profiler Chrome trace)")
    return [e for e in events if isinstance(e, dict) and e.get("ph") == "X" and "dur" in e]


def part_of(chain: list[str], name: str) -> str:
    """The part an operation belongs to: communication by name, else its innermost theworld: label."""
    if any(w in name.lower() for w in COMM_WORDS):
        return "communication"
    for outer in reversed(chain):
        if outer in LABEL_TO_PART:
            return LABEL_TO_PART[outer]
        if outer.startswith("autograd::engine::evaluate_function"):
            return "backward"
    return "other"


def host_times(events: list[dict]) -> tuple[dict[str, list[float]], dict[str, float], float]:
    """({op name: [calls, self µs]}, {part: self µs}, wall µs): self time is an event's duration less its children's
    on the same thread, so the parts add up to the busy time of the traced threads."""
    ops: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    parts: dict[str, float] = defaultdict(float)
    by_thread = defaultdict(list)
    for e in events:
        if e.get("cat") in HOST_CATS:
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
    start, end = float("inf"), float("-inf")
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [event, children's µs]
        for e in evs + [None]:
            while stack and (e is None or e["ts"] >= stack[-1][0]["ts"] + stack[-1][0]["dur"]):
                done, children = stack.pop()
                own = max(done["dur"] - children, 0.0)
                chain = [s[0]["name"] for s in stack]
                if done.get("cat") == "cpu_op":
                    ops[done["name"]][0] += 1
                    ops[done["name"]][1] += own
                parts[part_of(chain + [done["name"]], done["name"])] += own
                if stack:
                    stack[-1][1] += done["dur"]
            if e is not None:
                stack.append([e, 0.0])
                start, end = min(start, e["ts"]), max(end, e["ts"] + e["dur"])
    return ops, parts, (end - start if end > start else 0.0)


def kernel_times(events: list[dict]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("cat") == "kernel":
            out[e["name"]][0] += 1
            out[e["name"]][1] += e["dur"]
    return out


def _table(rows: dict[str, list[float]], total: float, top: int, what: str) -> list[str]:
    lines = [f"| {what} | calls | time (ms) | share |", "| --- | ---: | ---: | ---: |"]
    for name, (calls, us) in sorted(rows.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"| `{name.replace('|', '/')[:80]}` | {int(calls)} | {us / 1000:.2f} | {us / total:.1%} |")
    return lines


def advice(shares: dict[str, float]) -> list[str]:
    said = [
        f"- {CATEGORIES[part]} takes {shares.get(part, 0.0):.0%}: {text}"
        for part, limit, text in ADVICE
        if shares.get(part, 0.0) > limit
    ]
    lm = shares.get("language_model", 0.0) + shares.get("backward", 0.0)
    if lm >= 0.5:
        said.append(
            f"- the language model's forward and backward take {lm:.0%}: compute-bound where it should be; "
            "faster steps come from train.hardware.mixed_precision: bf16, train.hardware.compile, "
            "train.hardware.attention: flex_attention (GPU), and larger micro-batches"
        )
    return said or ["- no part stands out: the step is balanced"]


def report(run_dir: str | Path, top: int = 15, rank: int = 0) -> str:
    path = Path(run_dir) / "profile" / f"trace-rank{rank}.json"
    kind = path_kind(path)
    if kind is not None and kind != REGULAR:  # never opened: a FIFO would block
        raise UserError(f"{path} is {kind}, not a trace file (a run writes it as a regular file)")
    if kind is None:
        raise UserError(
            f"{run_dir}: no {path.relative_to(run_dir)} (run with profile.enabled: true, and at least "
            "profile.start_step + profile.steps steps)"
        )
    events = load_trace(path)
    ops, parts, wall = host_times(events)
    busy = sum(parts.values())
    if not busy:
        raise UserError(f"{path}: holds no host operations")
    shares = {p: t / busy for p, t in parts.items()}
    lines = [
        f"# Profile of {Path(run_dir).name} (rank {rank})",
        "",
        f"Trace `{path}`: {wall / 1000:.1f} ms of wall time, {busy / 1000:.1f} ms of host time on its threads.",
        "",
        "## Time per part of a step",
        "",
        "| part | time (ms) | share |",
        "| --- | ---: | ---: |",
    ]
    for part, us in sorted(parts.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {CATEGORIES[part]} | {us / 1000:.2f} | {us / busy:.1%} |")
    lines += ["", f"## Top {top} operations by self time (host)", "", *_table(ops, busy, top, "operation")]
    kernels = kernel_times(events)
    if kernels:
        gpu = sum(us for _, us in kernels.values())
        lines += [
            "",
            f"## Top {top} GPU kernels ({gpu / 1000:.1f} ms of device time)",
            "",
            *_table(kernels, gpu, top, "kernel"),
        ]
    lines += ["", "## What it suggests", "", *advice(shares)]
    return "\n".join(lines) + "\n"


@cli_entry
def main(argv: list[str] | None = None) -> int:
    p = ArgParser(
        prog="python -m tools.profile_report",
        description="Markdown report of a run's profiler trace (profile: in the config).",
    )
    p.add_argument("run_dir", help="the run's output_dir (holding profile/trace-rank<R>.json)")
    p.add_argument("--top", type=int, default=15, help="operations listed (default 15)")
    p.add_argument("--rank", type=int, default=0, help="the process whose trace to read (default 0)")
    args = p.parse_args(argv)
    if args.top < 1 or args.rank < 0:
        raise UserError(f"tools.profile_report: --top must be >= 1 and --rank >= 0, got {args.top} and {args.rank}")
    print(report(args.run_dir, args.top, args.rank), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
