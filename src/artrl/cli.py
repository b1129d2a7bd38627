"""The `artrl` command."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="artrl", description="artrl: RL for multi-turn tool-using agents")
    commands = parser.add_subparsers(dest="command", required=True)
    tiny = commands.add_parser("tiny-model", help="build a small Qwen3-architecture model folder offline")
    tiny.add_argument("directory", help="output folder (Hugging Face format)")
    tiny.add_argument("--preset", default="tiny", help="tiny (~0.2M params) or small (~27M)")
    tiny.add_argument("--seed", type=int, default=None, help="override the preset's seed")
    args = parser.parse_args(argv)

    if args.command == "tiny-model":
        from artrl.config import TINY_MODEL_PRESETS
        from artrl.local.tiny_model import build_tiny_model

        if args.preset not in TINY_MODEL_PRESETS:
            parser.error(f"unknown preset {args.preset!r}; choose one of {sorted(TINY_MODEL_PRESETS)}")
        config = TINY_MODEL_PRESETS[args.preset]
        if args.seed is not None:
            config = config.model_copy(update={"seed": args.seed})
        path = build_tiny_model(args.directory, config)
        print(f"built {args.preset} model in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
