"""Rendering conversations through the chat template: train_sft's rows and the gateway's prompts.

Side by side in one process run, on the tiny model's tokenizer:
- train_sft's rows of the demo's pretraining stand-in (examples/tool_reading.py, 4096 conversations, each
  turn rendered and tokenised as the gateway would have recorded it): control-token marks walked and every
  text encoded piecewise on one thread (before), the marks checked first on one thread, and the same with the
  render workers (`SFTConfig.render_workers`, default one per CPU beyond the first);
- the gateway's preparation of a forced tool call (the maze agent's request, 10 messages): marks walked
  (before) and checked first, with the number of chat-template renders per request.

    .venv/bin/python benchmarks/bench_sft_rows.py [--rounds 3] [--conversations 4096] [--out benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import harness
import maze_env
import tool_reading
from transformers import AutoTokenizer

from artrl.local.chat_format import ChatFormat, control_marks
from artrl.local.gateway.names import ServedNames
from artrl.local.gateway.prompts import CompletionStore, PromptBuilder
from artrl.local.gateway.protocol import parse_request
from artrl.local.gateway.serving import ChatServing
from artrl.local.train.row_renderer import RowRenderer, default_workers

SECTION_HEADING = "## Rendering through the chat template: SFT rows and gateway prompts (bench_sft_rows.py)"
BEFORE, CHECKED = "marks walked, piecewise encode, 1 thread (before)", "marks checked, 1 thread"


class Context:
    """What ChatServing.prepare reads of an engine."""

    max_context = 2048


def walked(on: bool) -> None:
    """The marks as before this change (walk every value, encode every text piecewise) or checked first."""
    control_marks.MARKERS = None if on else MARKERS


MARKERS = control_marks.MARKERS


def maze_request() -> bytes:
    scenario = maze_env.scenarios("val", 1, 0)[0]
    messages = maze_env.start(scenario).messages()
    for k in range(4):
        call = {
            "id": f"call_{k}",
            "type": "function",
            "function": {"name": "move", "arguments": '{"direction": "north"}'},
        }
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": '{"position": 1, "breeze": "east"}'},
        ]
    body = {
        "model": "m",
        "messages": messages,
        "tools": maze_env.TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "move"}},
        "max_tokens": 32,
    }
    return json.dumps(body).encode()


def prepare_ms(fmt: ChatFormat, raw: bytes, n: int) -> tuple[float, int]:
    """Median ms of ChatServing.prepare over n calls, and the chat-template renders one call makes."""
    builder = PromptBuilder(fmt, CompletionStore(0))
    serving = ChatServing(Context(), fmt, builder, ServedNames(["m"]), 32, 8)  # type: ignore[arg-type]
    renders = 0
    render = fmt.render

    def counted(*args, **kwargs):
        nonlocal renders
        renders += 1
        return render(*args, **kwargs)

    fmt.render = counted  # type: ignore[method-assign]
    times = []
    for _ in range(n):
        started = time.perf_counter()
        serving.prepare(parse_request(raw))
        times.append(time.perf_counter() - started)
    fmt.render = render  # type: ignore[method-assign]
    return 1000 * statistics.median(times), renders // n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--conversations", type=int, default=4096)
    parser.add_argument("--out", default=str(harness.HERE / "RESULTS.md"))
    args = parser.parse_args()
    started = time.perf_counter()
    folder = harness.ensure_model("tiny", harness.HERE / "out" / "models")
    fmt = ChatFormat.for_tokenizer(AutoTokenizer.from_pretrained(folder))
    corpus = tool_reading.corpus(args.conversations)
    workers = default_workers()
    with_workers = f"marks checked, 1 thread + {workers} render worker(s)"
    modes = (BEFORE, CHECKED, with_workers)
    seconds: dict[str, list[float]] = {m: [] for m in modes}
    prepare: dict[str, list[float]] = {BEFORE: [], CHECKED: []}
    renders = 0
    renderer = RowRenderer()
    reference = None
    raw = maze_request()
    try:
        renderer.rows(
            corpus[: 2 * 256], fmt.clone(), {}, workers
        )  # (the workers' start, outside the timings)
        for round_index in range(args.rounds):
            for mode in harness.alternating(modes, round_index):
                walked(mode == BEFORE)
                t = time.perf_counter()
                rows = renderer.rows(corpus, fmt.clone(), {}, workers if mode == with_workers else 0)
                seconds[mode].append(time.perf_counter() - t)
                data = [[(r.ids, r.mask) for r in rs] for rs in rows]
                assert reference is None or data == reference, "the modes rendered different rows"
                reference = data
            for mode in harness.alternating((BEFORE, CHECKED), round_index):
                walked(mode == BEFORE)
                ms, renders = prepare_ms(fmt.clone(), raw, 300)
                prepare[mode].append(ms)
    finally:
        walked(False)
        renderer.close()
    info = harness.machine_info()
    base = statistics.median(seconds[BEFORE])
    lines = [
        SECTION_HEADING,
        "",
        f"- Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; machine: nproc={info['nproc']}, CPU: "
        f"{info['cpu']}, Python {info['python']}",
        f"- {args.conversations} conversations of examples/tool_reading.py (the demo's pretraining stand-in) into "
        f"train_sft rows, tiny model's tokenizer; {args.rounds} rounds, modes alternating; the rows are the same in "
        "every mode (checked)",
        f"- Command: `{harness.command_line()}`; wall time {time.perf_counter() - started:.0f} s",
        "",
        "| SFT rows | seconds (median) | speed vs before | per round |",
        "|---|---:|---:|---|",
    ]
    for mode in modes:
        median = statistics.median(seconds[mode])
        runs = ", ".join(f"{v:.2f}" for v in seconds[mode])
        lines.append(f"| {mode} | {median:.2f} | {base / median:.2f}x | {runs} |")
    before_ms = statistics.median(prepare[BEFORE])
    lines += [
        "",
        f"Gateway preparation of a forced tool call (maze agent, 10 messages; {renders} chat-template renders per "
        "request, one fewer than before: the forced call's opening is read off the prompt already rendered):",
        "",
        "| gateway prepare | ms (median of 300) | speed vs before |",
        "|---|---:|---:|",
    ]
    for mode in (BEFORE, CHECKED):
        median = statistics.median(prepare[mode])
        lines.append(f"| {mode.replace(', 1 thread', '')} | {median:.2f} | {before_ms / median:.2f}x |")
    lines.append("")
    harness.write_summary_row(
        args.out,
        "bench_sft_rows.py",
        "rendering 4096 conversations into SFT rows, and a gateway request, through the chat template",
        f"SFT rows {base / statistics.median(seconds[with_workers]):.2f}x (with {workers} render worker(s)), "
        f"gateway prepare {before_ms / statistics.median(prepare[CHECKED]):.2f}x the code before",
    )
    return harness.publish("\n".join(lines), args.out, SECTION_HEADING)


if __name__ == "__main__":
    raise SystemExit(main())
