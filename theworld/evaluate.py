"""`python -m theworld.evaluate --model RUN --data PATH [--protocol generate|loglik] [--baselines all|NAME,...]
[--split val] [--out FILE] [--no-shared-prefix] [--json]`: multiple-choice accuracy of a trained stage, with each
item's own world, with the world shuffled, and against baselines on the same items; `--task caption`: caption scores.

Protocols, conditions and statistics: theworld/infer/scoring.py, baselines.py, letters.py, stats.py; captions:
theworld/infer/captions.py; data formats: theworld/infer/benchmark_items.py. The default protocol is `generate` for
items that carry the benchmark's own prompt (BLINK) and `loglik` for the others (JSONL, the synthetic set), which have
never been asked in a lettered form. `--make-synthetic N` first writes N items from unseen synthetic scenes to
`--data` (images beside it); without `--model` it stops there. Evaluating a local run's final/ also writes the
result into its model card (final/README.md).
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

from theworld.core import atomic, location, log, paths
from theworld.core.config import ArgParser, DefaultsHelp
from theworld.core.errors import UserError, cli_entry, out_of_space, sigterm_as_exit
from theworld.infer import baselines, benchmark_items
from theworld.infer.scoring import PROTOCOLS
from theworld.model import device_map as dispatching

_log = log.get(__name__)


def parse(argv: list[str] | None):
    p = ArgParser(
        prog="theworld.evaluate",
        description="Evaluate a trained TheWorld stage: multiple choice or captions.",
        formatter_class=DefaultsHelp,
    )
    p.add_argument("--model", help="final/ or checkpoint-N/ folder, or a run's output_dir")
    p.add_argument(
        "--data",
        required=True,
        help="JSONL file, or BLINK's parquet folder (or one parquet file); "
        "captions: JSONL, or a latent cache (its held-out samples)",
    )
    p.add_argument(
        "--task",
        choices=("mc", "caption"),
        default="mc",
        help="mc: multiple choice; caption: JSONL {image, captions} scored by BLEU-4, ROUGE-L, CIDEr",
    )
    p.add_argument(
        "--protocol",
        choices=PROTOCOLS,
        default=None,
        help="multiple choice: generate (read the letter) or loglik (score each choice); default: generate "
        "when the items carry their own prompt (BLINK), else loglik",
    )
    p.add_argument(
        "--baselines",
        default="",
        metavar="all|NAME,...",
        help=f"baselines on the same items: {', '.join(baselines.KNOWN)} (no_rollout: stages trained with world "
        "rollouts only; all includes it for them)",
    )
    p.add_argument(
        "--split",
        default=None,
        help="which split's files of a BLINK folder to read (default val); a cache's held-out samples are val",
    )
    p.add_argument("--out", help="write one JSON line per item (outputs of every condition) to this file")
    p.add_argument("--no-shared-prefix", action="store_true", help="score every choice from the full sequence")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--limit", type=int, default=0, help="evaluate only the first N items (0: all)")
    p.add_argument("--batch-size", type=int, default=8, help="items per forward pass")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="generation length (default: 16 for a letter, 64 for a caption)",
    )
    p.add_argument("--ema", action="store_true", help="use the EMA weights (ema.safetensors)")
    p.add_argument(
        "--world-steps",
        type=int,
        default=None,
        help="roll out this many predicted latent frames (1 + 4N video frames) instead of the trained number, up to "
        "the stage's world.max_world_steps (stages trained with rollouts)",
    )
    p.add_argument(
        "--make-synthetic",
        type=int,
        default=0,
        metavar="N",
        help="first write N items from unseen synthetic scenes to --data (images in images/ beside it)",
    )
    p.add_argument("--synthetic-seed", type=int, default=1, help="scene seed of --make-synthetic (training uses 0)")
    dispatching.add_args(p)
    args = p.parse_args(argv)
    args.load = dispatching.load_kwargs(args)  # before the slow load: a missing device is one line
    if args.limit < 0 or args.batch_size < 1 or args.make_synthetic < 0 or (args.max_new_tokens or 1) < 1:
        raise UserError(
            "theworld.evaluate: --limit and --make-synthetic must be >= 0, --batch-size and --max-new-tokens >= 1"
        )
    if not args.model and not args.make_synthetic:
        raise UserError("theworld.evaluate: --model is required (unless only writing a set with --make-synthetic)")
    if args.task == "caption" and (args.protocol or args.baselines):
        flag = "--protocol" if args.protocol else "--baselines"
        raise UserError(
            f"theworld.evaluate: {flag} is for multiple choice (--task mc); captions are always generated and "
            "scored against the shuffled world"
        )
    args.baselines_spec, args.baselines = args.baselines, baselines.parse(args.baselines)  # names checked at once;
    # which ones `all` means, and whether a rollout baseline applies, once the stage's config is read (main)
    _check_split(args)
    return args


def _check_split(args) -> None:
    """--split chooses files of a BLINK folder (or a cache's held-out samples): given for one file that has no
    splits (JSONL) or another split, it would be ignored."""
    data = Path(args.data)
    if args.split is None or args.make_synthetic or data.is_dir():
        args.split = args.split or "val"
        return
    if data.suffix == ".parquet" and benchmark_items.split_of(data) == args.split:
        return
    raise UserError(
        f"theworld.evaluate: --split {args.split} chooses the files of a BLINK parquet folder, but --data {data} is "
        f"one {'parquet' if data.suffix == '.parquet' else 'JSONL'} file"
        + (f" of split {benchmark_items.split_of(data)!r}" if data.suffix == ".parquet" else " (it has no splits)")
        + "; leave --split out"
    )


def _readable(items: list, skipped: list[dict]) -> list:
    for s in skipped:
        _log.info(f"skipped {s['item']}: {s['field']}: {s['reason']}")
    bad = {s["item"] for s in skipped}
    return [it for it in items if it.name not in bad]


class _Out:
    """--out: every record written as it comes to `.tmp-NAME-PID` beside it, renamed over it when the evaluation
    ends (removed when it fails; one left by a killed run is removed by the next). A path that exists and is not a
    regular file (/dev/null, a FIFO) is written directly: nothing can be renamed over it."""

    def __init__(self, path: str):
        self.path = Path(path)
        kind = paths.path_kind(self.path)
        self.direct = kind is not None and kind != paths.REGULAR and not kind.startswith("a dangling")
        self.tmp = self.path if self.direct else atomic.partial_path(self.path)
        for stale in [] if self.direct else atomic.remove_stale(self.path.parent, self.path.name):
            _log.info(f"removed {stale} (the unfinished --out of a killed run)")
        try:
            self.file = open(self.tmp, "w", encoding="utf-8")
        except OSError as e:
            raise UserError(f"--out {path}: cannot write ({e.strerror})") from None

    def write(self, records: list[dict]) -> None:
        try:
            for r in records:
                self.file.write(json.dumps(r, ensure_ascii=False) + "\n")
            self.file.flush()
        except OSError as e:
            self.close(ok=False)
            if out_of_space(e, self.tmp.parent):
                raise UserError(
                    f"--out {self.path}: no space left on device (the file system holding {self.path.parent} is "
                    f"full); free space there or give --out another disk; {self.path} was not changed"
                ) from None
            raise UserError(f"--out {self.path}: cannot write ({e.strerror}); {self.path} was not changed") from None

    def close(self, ok: bool) -> None:
        with contextlib.suppress(OSError):
            self.file.close()
        if self.direct:
            return
        if ok:
            atomic.publish(self.tmp, self.path)
        else:
            self.tmp.unlink(missing_ok=True)


@cli_entry
def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.make_synthetic:
        if args.model:  # the set is written: never over the model's own files
            from theworld.model import stage_layout as layout

            paths.check_not_input(args.data, {"the model folder": layout.resolve(args.model)}, flag="--data")
        benchmark_items.make_synthetic(args.data, args.make_synthetic, seed=args.synthetic_seed)
        _log.info(f"wrote {args.make_synthetic} items to {args.data}")
        if not args.model:
            return 0
    if args.task == "caption":
        from theworld import cache_format as cf
        from theworld.infer import captions
        from theworld.model import stage_layout as layout

        data = location.place(args.data, "--data")
        if isinstance(data, location.Remote) or (Path(args.data) / cf.MANIFEST).is_file():  # a latent cache (a
            # URL: one in object storage): the run's held-out samples
            items = captions.read_cache(args.data, args.split, layout.resolve(args.model))
        else:
            items = captions.read(args.data)
        items = items[: args.limit or None]
    else:
        items = benchmark_items.read(args.data, args.split)[: args.limit or None]
    items = _readable(items, benchmark_items.unreadable(items))
    if not items:
        raise UserError(f"--data {args.data}: no item with readable images")
    from theworld.model import stage_layout as layout
    from theworld.model.rollout import steps_line
    from theworld.model.world import TheWorld

    folder = layout.resolve(args.model)  # before the slow load: a wrong folder is one line at once
    stage = layout.read_stage(folder)  # the stage's config, read once
    args.baselines = baselines.parse(args.baselines_spec, stage.sections.world.num_world_steps)
    if args.out:
        paths.check_not_input(args.out, {"--data": args.data, "the model folder": folder})
    out = _Out(args.out) if args.out else None  # before the slow load: an unwritable --out is one line at once
    ok = False
    try:
        with sigterm_as_exit():  # a kill removes --out's temporary file
            t = time.time()
            model, processor = TheWorld.from_pretrained(stage, ema=args.ema, world_steps=args.world_steps, **args.load)
            _log.info(f"loaded {args.model} in {time.time() - t:.1f} s; evaluating {len(items)} items")
            if model.rollout is not None:  # the unit, beside the count the plan and the original code give it
                _log.info(steps_line(model.rollout.num_world_steps, model.rollout.pipe.vae_scale_factor_temporal))
            init = baselines.InitProjector.for_stage(model, stage) if "init_projector" in args.baselines else None
            base = baselines.BaseGemma(model, stage) if "base_gemma" in args.baselines else None
            summary = _run(args, model, processor, items, (init, base), out, layout.trained_prompt(folder))
        ok = True
    finally:
        if out is not None:
            out.close(ok)
    if args.json:
        print(json.dumps({"model": args.model, "data": args.data, **summary}))
    else:
        print(_report(args.task, summary))
    if folder.name == layout.FINAL:
        from theworld.infer import card

        argv = sys.argv[1:] if argv is None else argv
        card.update(folder / layout.CARD, card.row(summary, args.data, args.task, argv, args.split, args.limit))
    return 0


def _run(args, model, processor, items: list, swaps: tuple, out, prompt: str) -> dict:
    from tqdm import tqdm

    conds = baselines.conditions(args.baselines)
    bar = tqdm(total=len(items), desc="evaluate", unit="item", file=sys.stderr, mininterval=1.0)

    def progress(records: list[dict]) -> None:
        bar.update(len(records))
        if out is not None:
            out.write(records)

    try:
        if args.task == "caption":
            from theworld.infer import captions

            records = captions.evaluate(
                model,
                processor,
                items,
                args.batch_size,
                progress,
                max_new_tokens=args.max_new_tokens or 64,
                prompt=prompt,
            )
            return captions.summarize(records)
        from theworld.infer import scoring

        protocol = args.protocol or scoring.default_protocol(items)
        records = scoring.evaluate(
            model,
            processor,
            model.image_config,
            items,
            args.batch_size,
            progress,
            protocol=protocol,
            conds=conds,
            init=swaps[0],
            base=swaps[1],
            shared_prefix=not args.no_shared_prefix,
            max_new_tokens=args.max_new_tokens or 16,
        )
        return scoring.summarize(records, args.baselines, protocol)
    finally:
        bar.close()


def _report(task: str, summary: dict) -> str:
    if task == "caption":
        from theworld.infer.captions import format_report
    else:
        from theworld.infer.scoring import format_report
    return format_report(summary)


if __name__ == "__main__":
    sys.exit(main())
