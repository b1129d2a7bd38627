"""What artrl's gateway costs per call on the vLLM path, vLLM's compute left out: a scripted vLLM server
(scripted_vllm_server.py, its own process and core) answers with canned tokens at once, and the same agent
sessions as bench_vllm_path.py (a 2-tool list, 3 calls each, `ignore_eos`) run (i) through artrl's gateway
(`model.openai_client()`: the SDK and the gateway in this process, the gateway asking the server's
token-in/token-out wire) and (ii) straight to the server's chat endpoint (the SDK alone, reading a chat answer of
as many tokens), alternating, median of --runs. The measure is this process's CPU time per call (not wall time:
a 2-core host's noise moves tok/s by 10-20% between runs, CPU time a call much less): (i) - (ii) is what the
gateway adds to a call (rendering, tokenising, the request to vLLM, reading its stream, the answer), split by
thread (the gateway's event loop, the preparation thread, the caller's). On a CPU host the gateway and the
agents share the cores vLLM does not use: at 64 sessions this CPU is what held artrl+vLLM under vLLM direct
in bench_vllm_path.py.

    .venv/bin/python benchmarks/bench_gateway_cpu.py [--sessions 8,64] [--runs 7] [--profile 30] [--quick]

`--profile N`: one more run through the gateway with cProfile on its event loop's thread, the N functions of
most own time printed. It replaces the section `## The gateway's CPU per call (bench_gateway_cpu.py)` of --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness
from bench_rollouts import CALL_TIMEOUT_S, Endpoint, Workload, one_token_ms, run_sessions

SECTION_HEADING = "## The gateway's CPU per call (bench_gateway_cpu.py)"
LABELS = ("artrl gateway", "direct")
TICK = os.sysconf("SC_CLK_TCK")
THREADS = {"artrl-gateway": "gateway loop", "artrl-prepare": "preparation", "MainThread": "caller (SDK)"}


def thread_cpu_s() -> dict[str, float]:
    """CPU seconds so far of this process's threads, by role (THREADS; the rest as 'other')."""
    names = {t.native_id: THREADS.get(t.name, "other") for t in threading.enumerate()}
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # (a thread that ended meanwhile)
            continue
        role = names.get(int(tid), "other")
        out[role] = out.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / TICK
    return out


def start_server(ids: list[int], token_ms: float) -> tuple[subprocess.Popen, str]:
    """The scripted server on a free port, on core 0 where this process keeps off it; its url once it answers."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    script = Path(__file__).resolve().parent / "scripted_vllm_server.py"
    command = [sys.executable, str(script), str(port), json.dumps(ids), "--token-ms", str(token_ms)]
    server = subprocess.Popen(command)
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) > 1:  # the server on one core, this process (SDK and gateway) on the others
        os.sched_setaffinity(server.pid, {cores[0]})
        os.sched_setaffinity(0, set(cores[1:]))  # (before the gateway's threads start: they inherit it)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2).close()
            return server, url
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                server.kill()
                raise RuntimeError("the scripted vLLM server did not start (see its output above)") from None
            time.sleep(0.1)


async def measure(endpoints: dict[str, Endpoint], work: Workload, args: argparse.Namespace) -> dict[str, Any]:
    """CPU ms per call of each endpoint (per run), and the gateway's split by thread (medians)."""
    calls = work.sessions * work.turns
    per_call: dict[str, list[float]] = {label: [] for label in LABELS}
    split: dict[str, list[float]] = {}
    tok_s: dict[str, list[float]] = {label: [] for label in LABELS}
    for label in LABELS:
        await run_sessions(endpoints[label], work, "warm-up")
    for r in range(args.runs):
        for label in harness.alternating(LABELS, r):
            before, cpu = thread_cpu_s(), time.process_time()
            stats = await run_sessions(endpoints[label], work, f"run {r}")
            per_call[label].append(1000 * (time.process_time() - cpu) / calls)
            tok_s[label].append(stats.tok_s)
            if label == LABELS[0]:
                after = thread_cpu_s()
                for role in after:
                    split.setdefault(role, []).append(1000 * (after[role] - before.get(role, 0.0)) / calls)
    return {
        "per_call": per_call,
        "split": {role: statistics.median(v) for role, v in split.items()},
        "tok_s": {label: statistics.median(v) for label, v in tok_s.items()},
    }


async def profiled(endpoint: Endpoint, work: Workload, loop: asyncio.AbstractEventLoop, top: int) -> None:
    """One run with cProfile on the gateway's loop (its thread's CPU time): the `top` functions by own time."""
    import cProfile
    import pstats

    profile = cProfile.Profile(timer=time.thread_time)
    loop.call_soon_threadsafe(profile.enable)
    await run_sessions(endpoint, work, "profiled")
    stopped = threading.Event()
    loop.call_soon_threadsafe(lambda: (profile.disable(), stopped.set()))
    await asyncio.to_thread(stopped.wait, 10)
    pstats.Stats(profile).sort_stats("tottime").print_stats(top)


async def run(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    import openai
    from transformers import AutoTokenizer

    import artrl

    folder = harness.ensure_model("tiny", args.model_cache)
    text = "the order is on its way and it will arrive next week at your door"
    ids = AutoTokenizer.from_pretrained(folder).encode(text, add_special_tokens=False)
    server, url = start_server(ids, args.token_ms)
    rows, headline = [], []
    try:
        vllm = artrl.VLLMConfig(url=url, wire=args.wire)
        with tempfile.TemporaryDirectory(prefix="artrl-bench-gateway-cpu-") as tmp:
            engine = artrl.EngineConfig(kind="vllm", vllm=vllm)
            async with artrl.LocalBackend(path=tmp, engine=engine) as backend:
                model = artrl.TrainableModel(name="path", project="bench", base_model=str(folder))
                await model.register(backend)
                direct = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", timeout=CALL_TIMEOUT_S)
                endpoints = {
                    "artrl gateway": Endpoint(model.openai_client(), model.name, {"ignore_eos": True}),
                    "direct": Endpoint(direct, "base", {"ignore_eos": True}),
                }
                for sessions in args.sessions:
                    work = Workload("v", "tiny", sessions, args.turns, args.max_tokens)
                    found = await measure(endpoints, work, args)
                    rows.append(row(sessions, found))
                    ours, theirs = (statistics.median(found["per_call"][label]) for label in LABELS)
                    headline.append(
                        f"{ours - theirs:.2f} ms ({ours / theirs:.2f}x the SDK's {theirs:.2f}) at {sessions}"
                    )
                    print(rows[-1], flush=True)
                ms = {label: [] for label in LABELS}
                for r in range(args.runs):
                    for label in harness.alternating(LABELS, r):
                        ms[label] += await one_token_ms(endpoints[label], 20)
                one = {label: statistics.median(v) for label, v in ms.items()}
                rows.append(
                    f"| 1 (1-token calls, wall ms) | {one['artrl gateway']:.2f} ms | {one['direct']:.2f} ms | "
                    f"**{one['artrl gateway'] - one['direct']:+.2f} ms** | | |"
                )
                headline.append(f"{one['artrl gateway'] - one['direct']:+.2f} ms a 1-token call")
                if args.profile:
                    loop = backend.service(model).server.link._loop
                    work = Workload("v", "tiny", args.sessions[-1], args.turns, args.max_tokens)
                    await profiled(endpoints["artrl gateway"], work, loop, args.profile)
                await direct.close()
    finally:
        server.kill()
        server.wait(timeout=10)
    return rows, headline


def row(sessions: int, found: dict[str, Any]) -> str:
    ours, theirs = (found["per_call"][label] for label in LABELS)
    mine, sdk = statistics.median(ours), statistics.median(theirs)
    split = ", ".join(
        f"{role} {ms:.2f}" for role, ms in sorted(found["split"].items(), key=lambda kv: -kv[1])
    )
    return (
        f"| {sessions} | {mine:.2f} ({', '.join(f'{x:.2f}' for x in ours)}) | {sdk:.2f} "
        f"({', '.join(f'{x:.2f}' for x in theirs)}) | **{mine - sdk:.2f}** ({mine / sdk:.2f}x) | {split} | "
        f"{found['tok_s']['artrl gateway']:.0f} / {found['tok_s']['direct']:.0f} |"
    )


def section(args: argparse.Namespace, rows: list[str]) -> str:
    return "\n".join(
        [
            SECTION_HEADING,
            "",
            args.machine_line,
            f"- Command: `{harness.command_line()}`; {args.turns} calls per session, max_tokens={args.max_tokens}, "
            f"{args.token_ms} ms a token from the scripted server (its own core), median of {args.runs} runs, "
            f"endpoints alternating; the gateway's wire: `VLLMConfig(wire={args.wire!r})`",
            "- *CPU ms / call*: this process's CPU time per call (the SDK; for the gateway the SDK and the gateway); "
            "*gateway adds*: the difference, the gateway's own cost a call; *its threads*: the gateway run's "
            "CPU ms a call by thread",
            "",
            "| sessions | via the gateway: CPU ms / call (runs) | direct: CPU ms / call (runs) | gateway adds | "
            "its threads (ms / call) | tok/s gateway / direct |",
            "|---|---:|---:|---:|---|---:|",
            *rows,
            "",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="development sizes: 8 sessions, 3 runs, printed")
    parser.add_argument("--sessions", default="8,64", help="comma-separated session counts (default 8,64)")
    parser.add_argument("--runs", type=int, default=None, help="runs per endpoint (default 7)")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--token-ms", type=float, default=0.5, help="the scripted server's time a token")
    parser.add_argument(
        "--wire", default="generate", choices=("completions", "generate"), help="VLLMConfig.wire"
    )
    parser.add_argument(
        "--profile", type=int, default=0, help="print the gateway loop's N costliest functions"
    )
    parser.add_argument("--out", type=Path, default=harness.HERE / "RESULTS.md")
    parser.add_argument("--model-cache", type=Path, default=harness.HERE / "out" / "models")
    args = parser.parse_args(argv)
    args.sessions = (8,) if args.quick else tuple(int(n) for n in args.sessions.split(","))
    args.runs = args.runs or (3 if args.quick else 7)
    args.machine_line = harness.dated_machine_line()  # (before this process is pinned to fewer cores)
    started = time.perf_counter()
    rows, headline = asyncio.run(run(args))
    text = section(args, rows)
    print(f"({time.perf_counter() - started:.0f} s)")
    if args.quick or args.profile:
        print(text)
        return
    harness.publish(text, args.out, SECTION_HEADING)
    harness.write_summary_row(
        args.out,
        "bench_gateway_cpu.py",
        "the gateway's CPU a call on the vLLM path against a scripted vLLM (no model compute): SDK + gateway vs "
        "the SDK calling the server directly",
        "the gateway adds " + "; ".join(headline),
    )


if __name__ == "__main__":
    main()
