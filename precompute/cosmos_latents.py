"""Precompute the frozen encoders' outputs into a crash-safe WebDataset cache.

    python -m precompute.cosmos_latents --config configs/precompute.yaml [--set key=value ...]
    accelerate launch -m precompute.cosmos_latents --config ...      (shard i goes to rank i % world_size)

The command: its config is read and checked first, before torch and the encoders are imported (a mistake is one line
at once, on every process of a launch), then `--print-config`, `--plan` (precompute/sizing.py) or the run
(precompute/pipeline.py).
"""

from __future__ import annotations

import sys

from precompute.config import PrecomputeConfig, load
from theworld.core.config import cli_parser, to_yaml
from theworld.core.errors import cli_entry


def run(cfg: PrecomputeConfig) -> dict:
    """precompute.pipeline.run of a checked config: torch and the encoders are imported here, not before."""
    from precompute import pipeline

    return pipeline.run(cfg)


@cli_entry
def main(argv: list[str] | None = None) -> int:
    parser = cli_parser("precompute.cosmos_latents", "Encode a dataset once into a WebDataset latent cache.")
    parser.add_argument(
        "--plan",
        action="store_true",
        help="print entries, shards and bytes per sample and in "
        "total, then exit (no model weights loaded, nothing written)",
    )
    args = parser.parse_args(argv)
    cfg = load(args.config, args.overrides)
    if args.print_config:
        print(to_yaml(cfg), end="")
        return 0
    if args.plan:
        from precompute import sizing

        print(sizing.report(sizing.estimate(cfg)))
        return 0
    run(cfg)
    from theworld.core.process_group import process_group

    # After a successful run only (on an error another process may still be in a collective). A process that exits
    # with its gloo group alive can abort in interpreter teardown ("terminate called without an active exception").
    process_group().destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
