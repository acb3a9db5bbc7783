"""`python -m theworld.describe --model DIR --image IMG [IMG ...]`: what a trained stage says about some images.

stdout holds only the generated text, one line per image in the order given (a newline or backslash inside an answer
is written as `\\n` / `\\\\`, so one line per image always holds); logs go to stderr. `--shuffle-world` gives image i
the world latents of image i-1 (the first gets the last one's), to show what the world pathway changes.
"""

from __future__ import annotations

import argparse
import sys
import time

from theworld.core import log
from theworld.core.config import ArgParser, DefaultsHelp
from theworld.core.errors import UserError, cli_entry
from theworld.model import device_map as dispatching
from theworld.model import images
from theworld.model import stage_layout as layout
from theworld.model.config import DEFAULT_PROMPT
from theworld.model.control_text import text_problem

_log = log.get(__name__)


def escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")


def parse(argv: list[str] | None):
    p = ArgParser(
        prog="theworld.describe",
        description="Describe images with a trained TheWorld stage.",
        formatter_class=DefaultsHelp,
    )
    p.add_argument("--model", required=True, help="final/ or checkpoint-N/ folder, or a run's output_dir")
    p.add_argument("--image", required=True, nargs="+", help="image files")
    p.add_argument(
        "--prompt",
        default=argparse.SUPPRESS,
        help=f"default: the prompt the run trained with (final/{layout.PROMPT}), else {DEFAULT_PROMPT!r}",
    )
    p.add_argument("--max-new-tokens", type=int, default=64, help="at most this many new tokens per answer")
    p.add_argument("--batch-size", type=int, default=8, help="images per generate call")
    p.add_argument("--no-cache", action="store_true", help="recompute the whole sequence at every step")
    p.add_argument("--shuffle-world", action="store_true", help="give image i the world latents of image i-1")
    p.add_argument("--ema", action="store_true", help="use the EMA weights (ema.safetensors)")
    p.add_argument(
        "--world-steps",
        type=int,
        default=None,
        help="roll out this many predicted latent frames (1 + 4N video frames) instead of the trained number, up to "
        "the stage's world.max_world_steps (stages trained with rollouts)",
    )
    dispatching.add_args(p)
    args = p.parse_args(argv)
    args.load = dispatching.load_kwargs(args)  # before the slow load: a missing device is one line
    if args.max_new_tokens < 1 or args.batch_size < 1:
        raise UserError("theworld.describe: --max-new-tokens and --batch-size must be >= 1")
    args.prompt = getattr(args, "prompt", None)
    if args.prompt is not None and (problem := text_problem(args.prompt, "--prompt")):
        raise UserError(f"theworld.describe: {problem}")
    for img in args.image:  # before the model loads: a bad file costs a second
        if problem := images.path_problem(img):
            raise UserError(f"--image {img}: {problem}")
        try:
            images.decode(images.to_bytes(img))
        except (OSError, images.BadImage) as e:
            raise UserError(f"--image {img}: {e}") from None
    if args.shuffle_world and len(args.image) < 2:
        raise UserError("--shuffle-world needs at least 2 images (each takes another one's world)")
    return args


@cli_entry
def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from theworld.model.rollout import steps_line
    from theworld.model.world import TheWorld

    folder = layout.resolve(args.model)
    prompt = args.prompt if args.prompt is not None else layout.trained_prompt(folder)
    t = time.time()
    model, _ = TheWorld.from_pretrained(folder, ema=args.ema, world_steps=args.world_steps, **args.load)
    _log.info(f"loaded {args.model} in {time.time() - t:.1f} s")
    if model.rollout is not None:  # the unit, beside the count the plan and the original code give it
        _log.info(steps_line(model.rollout.num_world_steps, model.rollout.pipe.vae_scale_factor_temporal))
    paths = args.image
    world = paths[-1:] + paths[:-1] if args.shuffle_world else None
    for lo in range(0, len(paths), args.batch_size):
        chunk = slice(lo, lo + args.batch_size)
        texts = model.generate(
            paths[chunk],
            prompt,
            max_new_tokens=args.max_new_tokens,
            use_cache=not args.no_cache,
            world_images=world[chunk] if world else None,
        )
        for text in texts:
            print(escape(text), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
