"""`python -m theworld.evaluate --model DIR --data FILE [--json] [--limit N] [--batch-size B]`: multiple-choice
accuracy of a trained stage, with the world pathway intact and with it shuffled.

Each choice is scored by the summed log-probability of its answer tokens (the choice and the model turn's
<end_of_turn>, the tokens training supervises) after the question; the highest wins (ties: the first).
`accuracy_shuffled_world` scores the same items with item i given the world latents of item i-1 (the first gets the
last one's). Both come with a 95% Wilson interval, overall and per category. Scoring: theworld/infer/scoring.py;
data formats: theworld/infer/benchmarks.py.
`--make-synthetic N` first writes N items from unseen synthetic scenes to `--data` (images beside it); without
`--model` it stops there.
"""
from __future__ import annotations

import json
import sys
import time

from theworld.config import ArgParser
from theworld.errors import UserError, cli_entry
from theworld.infer import benchmarks
from theworld.infer.scoring import evaluate, format_report, summarize


def parse(argv: list[str] | None):
    p = ArgParser(prog="theworld.evaluate", description="Multiple-choice accuracy of a trained TheWorld stage.")
    p.add_argument("--model", help="final/ or checkpoint-N/ folder, or a run's output_dir")
    p.add_argument("--data", required=True, help="JSONL file, or BLINK's parquet folder (or one parquet file)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--limit", type=int, default=0, help="score only the first N items (0: all)")
    p.add_argument("--batch-size", type=int, default=8, help="items per forward pass")
    p.add_argument("--ema", action="store_true", help="use the EMA weights (ema.safetensors)")
    p.add_argument("--make-synthetic", type=int, default=0, metavar="N",
                   help="first write N items from unseen synthetic scenes to --data (images in images/ beside it)")
    p.add_argument("--synthetic-seed", type=int, default=1, help="scene seed of --make-synthetic (training uses 0)")
    args = p.parse_args(argv)
    if args.limit < 0 or args.batch_size < 1 or args.make_synthetic < 0:
        raise UserError("theworld.evaluate: --limit and --make-synthetic must be >= 0, --batch-size >= 1")
    if not args.model and not args.make_synthetic:
        raise UserError("theworld.evaluate: --model is required (unless only writing a set with --make-synthetic)")
    return args


@cli_entry
def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.make_synthetic:
        benchmarks.make_synthetic(args.data, args.make_synthetic, seed=args.synthetic_seed)
        print(f"wrote {args.make_synthetic} items to {args.data}", file=sys.stderr)
        if not args.model:
            return 0
    items = benchmarks.read(args.data)[: args.limit or None]
    skipped = benchmarks.unreadable(items)
    for s in skipped:
        print(f"skipped {s['item']}: {s['field']}: {s['reason']}", file=sys.stderr)
    bad = {s["item"] for s in skipped}
    items = [it for it in items if it.name not in bad]
    if not items:
        raise UserError(f"--data {args.data}: no item with readable images")
    from theworld.model import TheWorld

    t = time.time()
    model, processor = TheWorld.from_pretrained(args.model, ema=args.ema)
    print(f"loaded {args.model} in {time.time() - t:.1f} s; scoring {len(items)} items", file=sys.stderr)
    tty = sys.stderr.isatty()  # a progress line only where it can be redrawn in place
    records = evaluate(model, processor, model.image_config, items, args.batch_size,
                       progress=(lambda k: print(f"\r{k}/{len(items)}", end="", file=sys.stderr)) if tty else None)
    if tty:
        print(file=sys.stderr)
    summary = {**summarize(records), "skipped": skipped}
    if args.json:
        print(json.dumps({"model": args.model, "data": args.data, **summary}))
    else:
        print(format_report(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
