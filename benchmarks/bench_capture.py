"""Capture overhead: the same chat-completion call through the gateway, plain vs inside `artrl.capture`.

In one process, on the tiny model served by a real LocalBackend, each round makes the same --calls calls
(same messages, same seeds, max_tokens --max-tokens) three ways, in an order that rotates every round:

  plain     `model.openai_client()` outside any capture block;
  header    the same client inside `artrl.capture(model)` (the request hook adds the capture header, the
            gateway records each call);
  base_url  a client on the capture's own base URL (`cap.base_url`), for code that only takes a URL.

Opening and closing the capture (two small HTTP calls, and building the trajectory) is measured separately,
per capture. The figure is the median over --rounds of the mean seconds per call; the ratio is each mode's
median over plain's. Calls are sequential, so the per-call cost is not hidden by batching.

    .venv/bin/python benchmarks/bench_capture.py [--rounds 15] [--calls 20] [--max-tokens 8]

The section `## Capture overhead (bench_capture.py)` of benchmarks/RESULTS.md is replaced (or added).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import artrl

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from harness import write_section, write_summary_row  # noqa: E402

SECTION_HEADING = "## Capture overhead (bench_capture.py)"
MODES = ("plain", "header", "base_url")


async def calls(client, model: str, n: int, max_tokens: int) -> float:
    """Seconds per call of n sequential calls (a two-message conversation, fixed seeds)."""
    started = time.perf_counter()
    for i in range(n):
        await client.chat.completions.create(
            model=model,
            messages=[
                {"role": "system", "content": "You are a shop assistant."},
                {"role": "user", "content": f"item {i}?"},
            ],
            max_tokens=max_tokens,
            seed=i,
        )
    return (time.perf_counter() - started) / n


async def run(args: argparse.Namespace) -> tuple[str, str]:
    with tempfile.TemporaryDirectory() as tmp:
        tiny = artrl.ensure_tiny_model(Path(tmp) / "tiny")
        async with artrl.LocalBackend(path=Path(tmp) / "artrl") as backend:
            model = artrl.TrainableModel(name="tiny", project="bench", base_model=str(tiny))
            await model.register(backend)
            client = model.openai_client()
            await calls(client, model.name, args.calls, args.max_tokens)  # warm-up
            per_call: dict[str, list[float]] = {m: [] for m in MODES}
            open_close: list[float] = []
            for r in range(args.rounds):
                for mode in MODES[r % 3 :] + MODES[: r % 3]:
                    if mode == "plain":
                        per_call[mode].append(await calls(client, model.name, args.calls, args.max_tokens))
                        continue
                    t = time.perf_counter()
                    async with artrl.capture(model) as cap:
                        opened = time.perf_counter() - t
                        target = client if mode == "header" else cap.openai_client()
                        per_call[mode].append(await calls(target, model.name, args.calls, args.max_tokens))
                        t = time.perf_counter()
                    open_close.append(opened + time.perf_counter() - t)
                    assert len(cap.records) == args.calls, "every call must be recorded"
    median = {m: statistics.median(v) for m, v in per_call.items()}
    lines = [
        SECTION_HEADING,
        "",
        f"Run {dt.date.today()} on {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}; tiny preset; {args.rounds} rounds x {args.calls} sequential "
        f"calls per mode, max_tokens {args.max_tokens}; median over rounds of the mean time per call.",
        f"Command: `.venv/bin/python benchmarks/bench_capture.py --rounds {args.rounds} --calls {args.calls} "
        f"--max-tokens {args.max_tokens}`",
        "",
        "| mode | ms per call (median) | vs plain |",
        "|---|---|---|",
        *(f"| {m} | {1000 * median[m]:.1f} | {median[m] / median['plain']:.3f} |" for m in MODES),
        "",
        f"Opening + closing a capture (records -> trajectory): median {1000 * statistics.median(open_close):.1f} "
        f"ms per capture ({args.calls} records each).",
        "",
    ]
    headline = (
        f"a call under capture: {median['header'] / median['plain']:.3f}x (header), "
        f"{median['base_url'] / median['plain']:.3f}x (base_url) the plain call's time; open + close "
        f"{1000 * statistics.median(open_close):.1f} ms"
    )
    return "\n".join(lines), headline


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--out", type=Path, default=HERE / "RESULTS.md")
    args = parser.parse_args()
    text, headline = asyncio.run(run(args))
    print(text)
    write_section(args.out, text, SECTION_HEADING)
    write_summary_row(
        args.out, "bench_capture.py", "`artrl.capture` around chat calls vs plain calls (`tiny`)", headline
    )


if __name__ == "__main__":
    main()
