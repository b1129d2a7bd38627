"""The vLLM path like for like: the same vLLM server and weights called (i) directly, through its own chat
endpoint, and (ii) through artrl's gateway (token-in/token-out to the same server), side by side in one run.

One `LocalBackend(engine="vllm")` registers the `tiny` preset (or `--preset small`) on vLLM with the hermes
tool parser (so its own chat endpoint parses tool calls as the gateway does). Phase *base*: both serve the
base weights (the gateway asks vLLM for the base; the direct client names the base). Phase *adapter*: after
one GRPO step the trained LoRA is loaded into vLLM as `NAME@1`: the gateway serves it, the direct client names
it. In each phase: 1, 8 and 64 concurrent agent sessions (bench_rollouts.py's: a 2-tool list, 3 calls,
max_tokens each, `ignore_eos`, temperature 1, a seed per call; each run's sessions name their endpoint and run
in their first message, so that no endpoint finds another's prompts in vLLM's prefix cache), endpoints
alternating, median of --runs (5x that at 1 and 8 sessions), and the median of each round's own ratio (its
runs back to back: the host's drift between rounds, which moves a ratio of medians by 0.1-0.2 on a 2-core
host, cancels); then sequential 1-token calls (the time a call costs beyond vLLM's). *client CPU s / 1k tok*:
this process's CPU time per 1,000 generated tokens: the SDK's work for vLLM direct; the SDK's and the
gateway's for artrl (the gateway runs here, `model.openai_client()` reaches it without a socket), so the
difference is the gateway's. *vLLM direct + logprobs*: the same direct calls asking for each sampled token's
logprob too, as artrl's gateway always asks vLLM (an RL trainer's request: GRPO's importance weights need
them), so that vLLM does the same work for both.

    .venv/bin/python benchmarks/bench_vllm_path.py [--quick] [--preset small] [--out benchmarks/RESULTS.md]

It replaces the section `## The vLLM path: artrl's gateway vs vLLM direct (bench_vllm_path.py)` of --out
(`... (bench_vllm_path.py --preset small)` for `small`).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness
from bench_rollouts import CALL_TIMEOUT_S, Endpoint, RunStats, Workload, one_token_ms, run_sessions

SECTION_HEADING = "## The vLLM path: artrl's gateway vs vLLM direct (bench_vllm_path.py)"
LABELS = ("artrl+vLLM", "vLLM direct", "vLLM direct + logprobs")
DIRECT = LABELS[1:]


class Run(NamedTuple):
    """One measured run: its stats, and the CPU seconds of this process (SDK, gateway) and of vLLM's server."""

    stats: RunStats
    client_cpu_s: float
    vllm_cpu_s: float


def heading(preset: str) -> str:
    """The RESULTS section of a preset's run (`tiny`'s is the benchmark's own)."""
    return SECTION_HEADING if preset == "tiny" else f"{SECTION_HEADING[:-1]} --preset {preset})"


def summary_name(preset: str) -> str:
    return "bench_vllm_path.py" if preset == "tiny" else f"bench_vllm_path.py --preset {preset}"


def runs_at(sessions: int, runs: int) -> int:
    """Runs per endpoint at a session count: a run of 1 or 8 sessions lasts about a second, and on a 2-core host
    either endpoint's runs then vary 2-3x (389-1,281 tok/s in one process): 5x the runs below 64."""
    return runs * 5 if sessions < 64 else runs


async def measured(ep: Endpoint, work: Workload, run: str, server_pid: int) -> Run:
    """One run; this process's CPU seconds during it, and vLLM's (its server's process tree)."""
    cpu, served = time.process_time(), harness.process_tree_cpu_s(server_pid)
    stats = await run_sessions(ep, work, run)
    return Run(stats, time.process_time() - cpu, harness.process_tree_cpu_s(server_pid) - served)


async def phase(name: str, endpoints: dict[str, Endpoint], args: argparse.Namespace) -> list[str]:
    """The phase's table rows; its headline (ratios per session count, ms added per call) into args.headline."""
    rows: list[str] = []
    ratios: dict[str, list[str]] = {label: [] for label in DIRECT}
    paired_ratios_of: dict[str, list[str]] = {label: [] for label in DIRECT}
    for sessions in args.sessions:
        work = Workload("v", args.preset, sessions, args.turns, args.max_tokens)
        for label in LABELS:  # warm-up
            await run_sessions(endpoints[label], work, f"warm-up {name} {label}")
        runs: dict[str, list[Run]] = {label: [] for label in LABELS}
        for r in range(runs_at(sessions, args.runs)):
            for label in harness.alternating(LABELS, r):
                await harness.settle(at_least_s=0.5)
                # (the run's label is in every session's first message: its own per endpoint, or the endpoints
                # after the first of a round would reuse its prompts from vLLM's prefix cache)
                run = await measured(
                    endpoints[label], work, f"{name} {r}.{LABELS.index(label)}", args.server_pid
                )
                runs[label].append(run)
                print(
                    f"[{name} x{sessions}] {label:<12} {run.stats.tok_s:7.1f} tok/s, cpu {run.client_cpu_s:.2f} s, "
                    f"vLLM {run.vllm_cpu_s:.2f} s",
                    flush=True,
                )
        tok_s = {label: statistics.median(run.stats.tok_s for run in runs[label]) for label in LABELS}
        # each round's own ratio (its runs side by side, minutes apart at most): the host's drift cancels
        paired = {
            label: statistics.median(paired_ratios(runs["artrl+vLLM"], runs[label])) for label in LABELS
        }
        for label in DIRECT:
            ratios[label].append(f"{tok_s['artrl+vLLM'] / tok_s[label]:.2f}x")
            paired_ratios_of[label].append(f"{paired[label]:.2f}x")
        for label in LABELS:
            stats = [run.stats for run in runs[label]]
            calls = [ms for s in stats for ms in s.latencies_ms]
            cpu_per_k = statistics.median(
                1000 * run.client_cpu_s / max(1, run.stats.tokens) for run in runs[label]
            )
            vllm_per_k = statistics.median(
                1000 * run.vllm_cpu_s / max(1, run.stats.tokens) for run in runs[label]
            )
            rows.append(
                f"| {name} | {sessions} | {label} | {tok_s[label]:.0f} | "
                f"{tok_s['artrl+vLLM'] / tok_s[label]:.2f}x | {paired[label]:.2f}x | {harness.percentile(calls, 50):.0f} | "
                f"{harness.percentile(calls, 95):.0f} | {cpu_per_k:.2f} | {vllm_per_k:.2f} | {', '.join(f'{s.tok_s:.0f}' for s in stats)} |"
            )
    ms: dict[str, list[float]] = {label: [] for label in LABELS}
    for label in LABELS:
        await one_token_ms(endpoints[label], 3)  # warm-up
    for r in range(args.runs):
        for label in harness.alternating(LABELS, r):
            ms[label] += await one_token_ms(endpoints[label], args.calls)
    ours = statistics.median(ms["artrl+vLLM"])
    added = {label: ours - statistics.median(ms[label]) for label in DIRECT}
    sessions = "/".join(str(n) for n in args.sessions)
    args.headline.append(
        f"{name} {'/'.join(ratios['vLLM direct'])} ({sessions} sessions; per round "
        f"{'/'.join(paired_ratios_of['vLLM direct'])}), {added['vLLM direct']:+.1f} ms a "
        f"1-token call (against direct + logprobs: {'/'.join(ratios['vLLM direct + logprobs'])}, "
        f"{added['vLLM direct + logprobs']:+.1f} ms)"
    )
    rows.append(
        f"| {name} | 1-token calls | | | | {ours:.1f} ms vs "
        + ", ".join(f"{statistics.median(ms[label]):.1f} ms ({label})" for label in DIRECT)
        + f": **{added['vLLM direct']:+.1f} ms per call** | | | | | |"
    )
    return rows


def paired_ratios(ours: list[Run], theirs: list[Run]) -> list[float]:
    """Round r's tok/s ratio, ours / theirs (the two runs of a round ran one after the other)."""
    return [a.stats.tok_s / b.stats.tok_s for a, b in zip(ours, theirs, strict=True)]


async def trained_one_step(model: Any) -> None:
    import artrl

    client = model.openai_client()
    ask = [{"role": "user", "content": "where is my order?"}]
    choices = [
        (await client.chat.completions.create(model=model.name, messages=ask, max_tokens=8, seed=i)).choices[
            0
        ]
        for i in range(4)
    ]
    group = artrl.TrajectoryGroup(
        artrl.Trajectory(messages_and_choices=[*ask, c], reward=float(i % 2)) for i, c in enumerate(choices)
    )
    await model.train([group], config=artrl.TrainConfig(learning_rate=1e-2))


async def run(args: argparse.Namespace) -> list[str]:
    import openai

    import artrl

    folder = harness.ensure_model(args.preset, args.model_cache)
    vllm = artrl.VLLMConfig(
        extra_args=("--enable-auto-tool-choice", "--tool-call-parser", "hermes"),
        wire=args.wire,
        **({} if args.stream_interval is None else {"stream_interval": args.stream_interval}),
    )
    rows: list[str] = []
    with tempfile.TemporaryDirectory(prefix="artrl-bench-vllm-path-") as tmp:
        async with artrl.LocalBackend(path=tmp, engine=artrl.EngineConfig(kind="vllm", vllm=vllm)) as backend:
            model = artrl.TrainableModel(name="path", project="bench", base_model=str(folder))
            await model.register(backend)
            engine = backend.service(model).engine
            args.wire_used = engine.wire  # ('auto' resolved)
            args.server_pid = engine.server.process.pid
            if args.pin and engine.server is not None:
                bound, ours = harness.pin_away_from(engine.server.process.pid)
                args.pinned = (
                    f"vLLM computes on cores {sorted(bound)}, this process on {sorted(ours)}" if bound else ""
                )
            direct = openai.AsyncOpenAI(
                base_url=f"{engine.base_url}/v1", api_key=engine.server.api_key, timeout=CALL_TIMEOUT_S
            )
            gateway = Endpoint(model.openai_client(), model.name, {"ignore_eos": True})

            def endpoints(served: str) -> dict[str, Endpoint]:
                """The gateway, and vLLM's chat endpoint naming `served` (without and with logprobs)."""
                return {
                    "artrl+vLLM": gateway,
                    "vLLM direct": Endpoint(direct, served, {"ignore_eos": True}),
                    "vLLM direct + logprobs": Endpoint(
                        direct, served, {"ignore_eos": True, "logprobs": True}
                    ),
                }

            try:
                rows += await phase("base", endpoints(engine.served_name), args)
                await trained_one_step(model)
                assert engine.target == f"{model.name}@1", engine.target
                rows += await phase("adapter", endpoints(engine.target), args)
            finally:
                await direct.close()
    return rows


def section(args: argparse.Namespace, rows: list[str]) -> str:
    return "\n".join(
        [
            heading(args.preset),
            "",
            f"{args.machine_line}; {harness.vllm_version() or 'vLLM ?'}",
            f"- Command: `{harness.command_line()}`; {args.turns} calls per session, max_tokens={args.max_tokens}, "
            f"median of {args.runs} runs ({runs_at(8, args.runs)} at 1 and 8 sessions), endpoints alternating; "
            f"`{args.preset}` preset; the gateway's wire to vLLM: "
            f"`VLLMConfig(wire={args.wire!r}, stream_interval={args.interval})` ({args.wire_used!r} used); {args.pinned or 'threads not pinned'}",
            "- *artrl / this*: tok/s ratio (acceptance: >= 0.95x vLLM direct at 8 and 64 sessions; <= 2 ms added per "
            "1-token call); *client CPU s / 1k tok*: this process's CPU per 1,000 generated tokens (the SDK; "
            "for artrl the SDK and the gateway); *vLLM CPU s / 1k tok*: the vLLM server's processes' (API server, "
            "engine core) CPU per 1,000 generated tokens",
            "",
            "| weights | sessions | endpoint | tok/s | artrl / this | per round (median) | p50 ms/call | p95 ms/call | client CPU s / 1k tok | vLLM CPU s / 1k tok | tok/s per run |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
            *rows,
            "",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="development sizes: 1 and 8 sessions, 1 run")
    parser.add_argument("--runs", type=int, default=None)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument(
        "--preset",
        default="tiny",
        choices=("tiny", "small"),
        help="the model (`small`: more compute a token, so vLLM's per-step costs weigh less; its own section)",
    )
    parser.add_argument("--calls", type=int, default=20, help="1-token calls per endpoint and run")
    parser.add_argument("--sessions", default=None, help="comma-separated session counts (default 1,8,64)")
    parser.add_argument(
        "--wire", default="auto", choices=("auto", "completions", "generate"), help="VLLMConfig.wire"
    )
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=None,
        help="VLLMConfig.stream_interval: tokens per chunk the gateway asks vLLM for (default: artrl's default)",
    )
    parser.add_argument(
        "--no-pin",
        dest="pin",
        action="store_false",
        help="leave this process's threads on every core (default: off the cores vLLM computes on, for both "
        "endpoints' clients alike: on a small CPU host their wake-ups would preempt vLLM's forward passes)",
    )
    parser.add_argument("--out", type=Path, default=harness.HERE / "RESULTS.md")
    parser.add_argument("--model-cache", type=Path, default=harness.HERE / "out" / "models")
    args = parser.parse_args(argv)
    default = (1, 8) if args.quick else (1, 8, 64)
    args.sessions = tuple(int(n) for n in args.sessions.split(",")) if args.sessions else default
    args.runs = args.runs or (1 if args.quick else 5)
    args.headline, args.pinned = [], ""
    args.machine_line = harness.dated_machine_line()  # (before this process is pinned to fewer cores)
    started = time.perf_counter()
    import artrl

    args.interval = args.stream_interval or artrl.VLLMConfig().stream_interval
    rows = asyncio.run(run(args))
    text = section(args, rows)
    print(f"({time.perf_counter() - started:.0f} s)")
    if args.quick:
        print(text)
    else:
        harness.publish(text, args.out, heading(args.preset))
        harness.write_summary_row(
            args.out,
            summary_name(args.preset),
            "one vLLM server, the same weights: artrl's gateway (token-in/token-out) vs vLLM's own chat endpoint",
            "artrl+vLLM / vLLM direct tok/s: " + "; ".join(args.headline),
        )


if __name__ == "__main__":
    main()
