"""A soak of the embedded engine's gateway: `sessions` concurrent multi-turn agent sessions (the tiny model,
in-process clients) for `minutes`, each session starting over when it ends; RSS (after freed memory is handed
back) and the call count every `every_s` seconds; errors counted. docs/reliability.md quotes its figures.

    .venv/bin/python scripts/soak.py --minutes 3 --sessions 256
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path

import artrl


def rss_mib() -> float:
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


async def main(args: argparse.Namespace) -> dict:
    folder = Path(tempfile.mkdtemp())
    backend = artrl.LocalBackend(path=folder / "run")
    model = artrl.TrainableModel(
        name="soak", project="soak", base_model=str(artrl.build_tiny_model(folder / "m"))
    )
    await model.register(backend)
    client = model.openai_client()
    end = time.monotonic() + 60 * args.minutes
    calls, errors, latencies = 0, [], []

    async def session(i: int) -> None:
        nonlocal calls
        round_ = 0
        while time.monotonic() < end:
            messages = [{"role": "user", "content": f"session {i}.{round_}: what is the weather in paris?"}]
            for turn in range(args.turns):
                started = time.perf_counter()
                try:
                    reply = await client.chat.completions.create(
                        model=model.name, messages=messages, max_tokens=args.tokens, seed=i * 1000 + turn
                    )
                except Exception as exc:  # (counted: the figure is how many)
                    errors.append(f"{type(exc).__name__}: {exc}"[:200])
                    break
                latencies.append(time.perf_counter() - started)
                calls += 1
                messages += [
                    {"role": "assistant", "content": reply.choices[0].message.content or ""},
                    {"role": "user", "content": "and tomorrow?"},
                ]
            round_ += 1

    async def sample(samples: list) -> None:
        while time.monotonic() < end:
            samples.append(
                {
                    "s": round(time.monotonic() - (end - 60 * args.minutes)),
                    "calls": calls,
                    "rss_mib": round(rss_mib()),
                }
            )
            await asyncio.sleep(args.every_s)

    samples: list[dict] = []
    start_rss = rss_mib()
    await asyncio.gather(sample(samples), *(session(i) for i in range(args.sessions)))
    samples.append({"s": round(60 * args.minutes), "calls": calls, "rss_mib": round(rss_mib())})
    await backend.close()
    after_first = [s["rss_mib"] for s in samples if s["s"] >= args.every_s]
    return {
        "sessions": args.sessions,
        "minutes": args.minutes,
        "calls": calls,
        "errors": len(errors),
        "first_errors": errors[:3],
        "p50_ms": round(statistics.median(latencies) * 1000) if latencies else None,
        "p95_ms": round(sorted(latencies)[int(0.95 * len(latencies))] * 1000) if latencies else None,
        "rss_start_mib": round(start_rss),
        "rss_after_first_sample_mib": after_first[0] if after_first else None,
        "rss_end_mib": samples[-1]["rss_mib"],
        "samples": samples,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--sessions", type=int, default=256)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--every-s", type=float, default=30.0)
    print(json.dumps(asyncio.run(main(parser.parse_args())), indent=1))
