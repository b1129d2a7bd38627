"""The `artrl` command."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path


def _tiny_model(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.family is not None:
        from artrl.local.families.family_models import FAMILY_MODELS, build_family_model

        if args.family not in FAMILY_MODELS:
            parser.error(f"unknown family {args.family!r}; choose one of {sorted(FAMILY_MODELS)}")
        path = build_family_model(args.directory, args.family, seed=args.seed or 0)
        print(f"built a tiny {args.family} model in {path}")
        return 0
    from artrl.config import TINY_MODEL_PRESETS
    from artrl.local.models.tiny_model import build_tiny_model

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
    from artrl.local.families.template_check import check_template
    from artrl.local.models.loading import load_tokenizer, stop_ids_of

    try:
        kwargs = json.loads(args.kwargs) if args.kwargs else {}
    except json.JSONDecodeError as exc:
        parser.error(f"--kwargs is not JSON: {exc}")
    if not isinstance(kwargs, dict):
        parser.error("--kwargs must be a JSON object, e.g. '{\"enable_thinking\": false}'")
    try:
        hub = {"revision": args.revision, "trust_remote_code": args.trust_remote_code}
        tokenizer = load_tokenizer(args.model, **{k: v for k, v in hub.items() if v})
        stops = stop_ids_of(args.model, args.revision)
        fmt = ChatFormat.for_tokenizer(tokenizer, args.chat_format, extra_stop_ids=stops)
        fmt.check_kwargs(kwargs)
    except ValueError as exc:
        print(f"artrl check-template: {exc}", file=sys.stderr)
        return 2
    report = check_template(fmt, args.model, kwargs)
    print(json.dumps(report.as_dict(), indent=2) if args.json else report.text())
    return 0 if report.ok else 1


def _history(args: argparse.Namespace) -> int:
    from artrl.history.tables import render

    metrics = [m.strip() for m in args.metrics.split(",") if m.strip()] if args.metrics else None
    print(render(Path(args.path), args.split, metrics))
    return 0


def _export(args: argparse.Namespace) -> int:
    from artrl.local.runs.hf_export import export_step, merge_step
    from artrl.local.runs.run_folder import open_run

    run = open_run(args.run_dir)
    step, out = (merge_step if args.command == "merge" else export_step)(run, args.out, args.step)
    what = "merged model" if args.command == "merge" else "adapter" if run.is_lora else "full model"
    print(f"wrote step {step} of {run.project}/{run.name} to {out} ({what} + tokenizer)", flush=True)
    if args.push_to_hub:
        from artrl.local.runs.hub_push import push_folder, use_hub_timeouts

        use_hub_timeouts()

        message = f"artrl {args.command}: step {step} of {run.project}/{run.name} ({what})"
        print(f"pushed to {args.push_to_hub}: {push_folder(out, args.push_to_hub, args.private, message)}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from artrl.config import EngineConfig, GatewayConfig, LoadConfig
    from artrl.local.runs.run_folder import RunError, open_run
    from artrl.local.runs.serve_run import serve_model, serve_run

    if args.api_key is not None:
        raise ValueError(
            "--api-key puts the key on the command line, where `ps` shows it to every user of this machine: "
            "give it in a file (--api-key-file FILE) or in $ARTRL_API_KEY"
        )
    key = (
        Path(args.api_key_file).read_text().strip() if args.api_key_file else os.environ.get("ARTRL_API_KEY")
    )
    gateway = GatewayConfig(host=args.host, port=args.port, api_key=key or None)
    say = lambda line: print(line, flush=True)  # noqa: E731
    target = Path(args.target)
    if (target / "model.json").is_file():  # a run folder: one of its saved steps
        if args.revision or args.trust_remote_code or args.name:
            raise RunError(
                f"{target} is a run folder: it is served as it was trained (its model.json says how its base "
                "was loaded and its name); --revision, --trust-remote-code and --name are for a model folder "
                "or hub id"
            )
        serve_run(open_run(target), args.step, gateway, say=say, engine=args.engine)
        return 0
    if args.step is not None:
        raise RunError(
            f"--step picks a checkpoint of a run folder; {target} is not one (it has no model.json)"
        )
    if target.exists() and not (target / "config.json").is_file():
        open_run(target)  # (says what it is not, and the runs below it)
    load = LoadConfig(revision=args.revision, trust_remote_code=args.trust_remote_code)
    serve_model(args.target, args.name, EngineConfig(kind=args.engine, load=load), gateway, say=say)
    return 0


def _server(args: argparse.Namespace) -> int:
    from artrl.config import EngineConfig, ServerConfig
    from artrl.local.server.run import run_server

    config = ServerConfig(
        base_model=args.base_model, host=args.host, port=args.port, path=args.path, keys=args.keys
    )
    with contextlib.suppress(KeyboardInterrupt):
        run_server(config, EngineConfig(kind=args.engine), say=lambda line: print(line, flush=True))
    return 0


def _dashboard(args: argparse.Namespace) -> int:
    from artrl.config import DashboardConfig
    from artrl.local.dashboard import serve_dashboard

    if not Path(args.path).is_dir():
        raise ValueError(f"{args.path} is not a folder; give the root of your runs (LocalBackend's path)")
    config = DashboardConfig(host=args.host, port=args.port)
    with contextlib.suppress(KeyboardInterrupt):
        serve_dashboard(args.path, config)
    return 0


def _one_line(exc: Exception) -> str:
    """A pydantic error's messages, or any error's text, on one line."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        return "; ".join(": ".join(filter(None, (".".join(map(str, e["loc"])), e["msg"]))) for e in errors())
    return " ".join(str(exc).split())


def _add_run_commands(commands) -> None:
    history = commands.add_parser(
        "history", help="a run's history.jsonl as a table (or every run under PATH)"
    )
    history.add_argument("path", help="a run folder ({root}/{project}/{model}) or a root holding several")
    history.add_argument("--split", default=None, help="only the rows of this split (train, sft, val...)")
    history.add_argument("--metrics", default=None, help="comma-separated metric names to show")
    for name, text in (
        ("export", "a step as a Hugging Face folder: the PEFT adapter (or full weights) + tokenizer"),
        ("merge", "a LoRA step merged into its base: a full Hugging Face model folder + tokenizer"),
    ):
        command = commands.add_parser(name, help=text)
        command.add_argument("run_dir", help="a run folder ({root}/{project}/{model})")
        command.add_argument("out", help="the output folder (new, or empty)")
        command.add_argument("--step", type=int, default=None, help="the checkpoint (default: the latest)")
        command.add_argument(
            "--push-to-hub",
            metavar="REPO_ID",
            default=None,
            help="then upload the folder to this hub model repo (created if missing; token: HF_TOKEN or "
            "`hf auth login`; endpoint: HF_ENDPOINT)",
        )
        command.add_argument("--private", action="store_true", help="a repo it creates is private")
    server = commands.add_parser(
        "server",
        help="a training server: many tenants' models trained and served on BASE_MODEL, for artrl.RemoteBackend "
        "(`serve` instead serves one saved step for inference)",
    )
    server.add_argument(
        "base_model", help="a hub id or a model folder: the base every hosted model trains on"
    )
    server.add_argument("--host", default="127.0.0.1", help="another host than loopback needs --keys")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--keys", default=None, help="a file of `TENANT KEY` lines (tenant `admin` sees all)")
    server.add_argument("--path", default=".artrl-server", help="run folders: PATH/TENANT/PROJECT/MODEL")
    server.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    serve = commands.add_parser(
        "serve",
        help="the OpenAI-compatible gateway on a run's saved step, or on a model folder or hub id, for "
        "inference, until Ctrl-C (`server` instead trains models for remote clients)",
    )
    serve.add_argument(
        "target", help="a run folder ({root}/{project}/{model}), a Hugging Face model folder, or a hub id"
    )
    serve.add_argument("--step", type=int, default=None, help="a run's checkpoint (default: the latest)")
    serve.add_argument("--engine", choices=("hf", "vllm"), default="hf", help="the embedded engine, or vLLM")
    serve.add_argument(
        "--name", default=None, help="a model's served name (default: its folder or repo name)"
    )
    serve.add_argument("--revision", default=None, help="a hub model's branch, tag or commit")
    serve.add_argument(
        "--trust-remote-code", action="store_true", help="run the Python code the model ships (its auto_map)"
    )
    serve.add_argument("--host", default="127.0.0.1", help="another host than loopback needs --api-key")
    serve.add_argument("--port", type=int, default=0, help="0 (default) = a free port, printed at start")
    serve.add_argument(
        "--api-key-file",
        default=None,
        help="a file holding the key clients must send ('Authorization: Bearer KEY'); or set $ARTRL_API_KEY",
    )
    serve.add_argument("--api-key", default=None, help=argparse.SUPPRESS)  # (refused: `ps` shows it)
    dashboard = commands.add_parser("dashboard", help="a local web page over the runs under PATH")
    dashboard.add_argument("path", nargs="?", default=".artrl", help="the root of the runs (default .artrl)")
    dashboard.add_argument("--host", default="127.0.0.1")
    dashboard.add_argument("--port", type=int, default=8765)


_RUN_COMMANDS = {
    "history": _history,
    "export": _export,
    "merge": _export,
    "serve": _serve,
    "server": _server,
    "dashboard": _dashboard,
}


def _env(args: argparse.Namespace) -> int:
    from artrl.env_report import as_text, environment

    report = environment(args.vllm_python)
    print(json.dumps(report, indent=2) if args.json else as_text(report))
    return 0


def main(argv: list[str] | None = None) -> int:
    from importlib.metadata import version

    parser = argparse.ArgumentParser(prog="artrl", description="artrl: RL for multi-turn tool-using agents")
    parser.add_argument("--version", action="version", version=f"artrl {version('artrl')}")
    commands = parser.add_subparsers(dest="command", required=True)
    env = commands.add_parser("env", help="versions and devices, for a bug report")
    env.add_argument("--json", action="store_true", help="as JSON")
    env.add_argument("--vllm-python", default=None, help="vLLM's environment's python (default .venv-vllm's)")
    tiny = commands.add_parser("tiny-model", help="build a small model folder offline")
    tiny.add_argument("directory", help="output folder (Hugging Face format)")
    tiny.add_argument("--preset", default="tiny", help="tiny (~0.23M parameters) or small (~27M)")
    tiny.add_argument(
        "--family",
        default=None,
        help="instead: a tiny model with a real family's chat template and special tokens, fine-tuned to "
        "call tools in its format (qwen2_5, qwen3, qwen3_5, llama3_1, gpt_oss, gemma4, glm4_5)",
    )
    tiny.add_argument("--seed", type=int, default=None, help="override the preset's seed")
    check = commands.add_parser(
        "check-template", help="what artrl does with a model's chat template (exit 1 if it cannot train it)"
    )
    check.add_argument("model", help="a model folder or a hub id (only the tokenizer is loaded)")
    check.add_argument("--chat-format", default=None, help="a family name instead of detecting it")
    check.add_argument("--kwargs", default=None, help="chat_template_kwargs as JSON")
    check.add_argument("--json", action="store_true", help="print the report as JSON")
    check.add_argument("--revision", default=None, help="a hub model's branch, tag or commit")
    check.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the Python code the tokenizer ships (its auto_map)",
    )
    _add_run_commands(commands)
    args = parser.parse_args(argv)
    if args.command == "tiny-model":
        return _tiny_model(parser, args)
    if args.command == "check-template":
        return _check_template(parser, args)
    if args.command == "env":
        return _env(args)
    try:  # bad input: one line saying what was wrong and what to do, exit code 2, never a traceback
        return _RUN_COMMANDS[args.command](args)
    except (ValueError, OSError) as exc:
        print(f"artrl {args.command}: {_one_line(exc)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
