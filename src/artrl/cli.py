"""The `artrl` command."""

from __future__ import annotations

import argparse
import json
import sys


def _tiny_model(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.family is not None:
        from artrl.local.family_models import FAMILY_MODELS, build_family_model

        if args.family not in FAMILY_MODELS:
            parser.error(f"unknown family {args.family!r}; choose one of {sorted(FAMILY_MODELS)}")
        path = build_family_model(args.directory, args.family, seed=args.seed or 0)
        print(f"built a tiny {args.family} model in {path}")
        return 0
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


def _check_template(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from artrl.local.chat_format import ChatFormat
    from artrl.local.loading import load_tokenizer, stop_ids_of
    from artrl.local.template_check import check_template

    try:
        kwargs = json.loads(args.kwargs) if args.kwargs else {}
    except json.JSONDecodeError as exc:
        parser.error(f"--kwargs is not JSON: {exc}")
    if not isinstance(kwargs, dict):
        parser.error("--kwargs must be a JSON object, e.g. '{\"enable_thinking\": false}'")
    try:
        tokenizer = load_tokenizer(args.model)
        fmt = ChatFormat.for_tokenizer(tokenizer, args.chat_format, extra_stop_ids=stop_ids_of(args.model))
        fmt.check_kwargs(kwargs)
    except ValueError as exc:
        print(f"artrl check-template: {exc}", file=sys.stderr)
        return 2
    report = check_template(fmt, args.model, kwargs)
    print(json.dumps(report.as_dict(), indent=2) if args.json else report.text())
    return 0 if report.ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="artrl", description="artrl: RL for multi-turn tool-using agents")
    commands = parser.add_subparsers(dest="command", required=True)
    tiny = commands.add_parser("tiny-model", help="build a small model folder offline")
    tiny.add_argument("directory", help="output folder (Hugging Face format)")
    tiny.add_argument("--preset", default="tiny", help="tiny (~0.4M params) or small (~27M)")
    tiny.add_argument(
        "--family",
        default=None,
        help="instead: a tiny model with a real family's chat template and special tokens, fine-tuned to "
        "call tools in its format (qwen2_5, qwen3, qwen3_5, llama3_1, gpt_oss, glm4_5)",
    )
    tiny.add_argument("--seed", type=int, default=None, help="override the preset's seed")
    check = commands.add_parser(
        "check-template", help="what artrl does with a model's chat template (exit 1 if it cannot train it)"
    )
    check.add_argument("model", help="a model folder or a hub id (only the tokenizer is loaded)")
    check.add_argument("--chat-format", default=None, help="a family name instead of detecting it")
    check.add_argument("--kwargs", default=None, help="chat_template_kwargs as JSON")
    check.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    if args.command == "tiny-model":
        return _tiny_model(parser, args)
    return _check_template(parser, args)


if __name__ == "__main__":
    sys.exit(main())
