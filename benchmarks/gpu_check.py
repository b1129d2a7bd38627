"""GPU check: rollouts and GRPO training steps of a Qwen2.5-1.5B-shaped model (random weights) on one GPU.

One command, a few minutes on one CUDA GPU (H100/H200 class):

    python benchmarks/gpu_check.py [--agents 32] [--tokens 128] [--steps 3] [--peak-tflops 989]

1. Builds a model folder offline: the tokenizer and chat template of `artrl.build_tiny_model(..., "tiny")`
   and a Qwen2 model of the Qwen2.5-1.5B shape (hidden 1536, 28 layers, 12 heads, 2 KV heads,
   intermediate 8960, vocab 151,936, tied embeddings) with random weights, saved in bfloat16. The prompt
   ids lie in the tokenizer's small vocabulary; sampled ids may fall outside it (they decode to nothing,
   and training uses the recorded ids, so that is harmless here).
2. Registers it with `artrl.LocalBackend(engine=artrl.EngineConfig(dtype="bfloat16"))` (LoRA r8 by
   default, `--full-finetune` for all weights).
3. Per step: `--agents` concurrent chat completions of exactly `--tokens` tokens (a completion that ends
   early is resampled with another seed; random weights almost never sample end-of-sequence) through
   `model.openai_client()`, grouped `--group-size` per prompt with random rewards, then one `model.train`
   call (one optimizer step). The first `--warmup` step(s) are not counted.

Reported (medians over the measured steps):
  - rollout tokens/s = completion tokens / wall seconds of the concurrent rollouts (timed from the first
    request to the last response: gateway + engine);
  - training: `metrics["train_seconds"]` (collate, forward, loss, backward, clipping, optimizer step, as
    timed inside artrl's trainer), trainable (completion) tokens/s, processed (prompt + completion)
    tokens/s, and the `model.train` call's wall time (which adds the checkpoint save);
  - MFU = 6 x parameters x processed tokens / train seconds / peak dense bf16 FLOP/s. The 6N rule counts
    the weight gradients too; with LoRA those are not computed (about 4N of real work), so the LoRA MFU
    understates the achieved FLOP/s by about a third. The peak is taken from the GPU name (H100/H200:
    989 TFLOP/s, A100: 312) or `--peak-tflops`;
  - peak GPU memory (`torch.cuda.max_memory_allocated`).

Without CUDA it stops with a message and exit code 2. `--dry-run-cpu` runs the same flow on the CPU with a
tiny shape (hidden 64, 2 layers, the same vocabulary) and a light workload, to test the code path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

EXIT_NO_CUDA = 2
QWEN25_15B_SHAPE = {
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "vocab_size": 151_936,
}
DRY_RUN_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 192,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 151_936,
}
# dense bf16 tensor-core peaks (FLOP/s), matched against torch.cuda.get_device_name()
KNOWN_PEAKS = [("H200", 989e12), ("H100", 989e12), ("H800", 989e12), ("A100", 312e12), ("A800", 312e12)]
MAX_RESEEDS = 20


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def detect_peak(device_name: str, override_tflops: float | None) -> tuple[float | None, str]:
    if override_tflops is not None:
        return override_tflops * 1e12, f"--peak-tflops {override_tflops:g}"
    for key, peak in KNOWN_PEAKS:
        if key in device_name:
            return peak, f"{key} dense bf16 ({peak / 1e12:g} TFLOP/s)"
    return None, "unknown GPU: pass --peak-tflops for MFU"


def build_model_folder(folder: Path, shape: dict[str, int], device: str) -> int:
    """Tiny tokenizer + chat template, and a random-weight Qwen2 model of `shape`; returns its parameters."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import artrl

    artrl.build_tiny_model(folder, "tiny")
    tiny = json.loads((folder / "config.json").read_text())
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    config = Qwen2Config(
        **shape,
        head_dim=head_dim,
        max_position_embeddings=4096,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        eos_token_id=tiny["eos_token_id"],
        pad_token_id=tiny["pad_token_id"],
        bos_token_id=None,
        use_sliding_window=False,
    )
    with torch.device(device), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    for stale in folder.glob("model*.safetensors*"):
        stale.unlink()
    model.generation_config.eos_token_id = tiny["eos_token_id"]
    model.generation_config.pad_token_id = tiny["pad_token_id"]
    model.save_pretrained(folder)  # config.json + weights; the tokenizer files stay
    (folder / "artrl_tiny_model.json").unlink(missing_ok=True)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return params


async def run(args: argparse.Namespace, device: str) -> dict[str, Any]:
    import torch

    import artrl

    shape = DRY_RUN_SHAPE if args.dry_run_cpu else QWEN25_15B_SHAPE
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="artrl-gpu-check-") as tmp:
        folder = Path(tmp) / "model"
        started = time.perf_counter()
        params = build_model_folder(folder, shape, device)
        log(f"built {params:,}-parameter model ({shape}) in {time.perf_counter() - started:.1f} s")
        engine = artrl.EngineConfig(dtype="bfloat16", device=device, max_batch_size=max(64, args.agents))
        backend = artrl.LocalBackend(path=Path(tmp) / "artrl", engine=engine)
        try:
            model = artrl.TrainableModel(
                name="gpu-check",
                project="gpu-check",
                base_model=str(folder),
                lora=None
                if args.full_finetune
                else artrl.LoraConfig(rank=args.lora_rank, alpha=2 * args.lora_rank),
            )
            started = time.perf_counter()
            await model.register(backend)
            served = backend.service(model).model
            trainable = sum(p.numel() for p in served.parameters() if p.requires_grad)
            log(
                f"registered in {time.perf_counter() - started:.1f} s on {device} "
                f"({next(served.parameters()).dtype}); trainable parameters {trainable:,}"
            )
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            client = model.openai_client()
            config = artrl.TrainConfig(learning_rate=args.learning_rate)
            steps: list[dict[str, Any]] = []
            reseeds = 0

            async def complete(messages: list[dict[str, str]], seed: int) -> Any:
                nonlocal reseeds
                for attempt in range(MAX_RESEEDS + 1):
                    response = await client.chat.completions.create(
                        model=model.name,
                        messages=messages,
                        max_tokens=args.tokens,
                        temperature=1.0,
                        seed=seed + 7919 * attempt,
                    )
                    if response.choices[0].finish_reason == "length":
                        break
                    reseeds += 1
                return response.choices[0]

            try:
                n_groups = args.agents // args.group_size
                for step in range(args.warmup + args.steps):
                    convs = [
                        [
                            {
                                "role": "user",
                                "content": f"Task {step}-{g}: find the secret number, then report it.",
                            }
                        ]
                        for g in range(n_groups)
                    ]
                    t0 = time.perf_counter()
                    choices = await asyncio.gather(
                        *(
                            complete(convs[g], 100_003 * step + 101 * g + k + 1)
                            for g in range(n_groups)
                            for k in range(args.group_size)
                        )
                    )
                    rollout_s = time.perf_counter() - t0
                    completion = [len(c.model_extra["token_ids"]) for c in choices]
                    prompt = [len(c.model_extra["prompt_token_ids"]) for c in choices]
                    groups = [
                        artrl.TrajectoryGroup(
                            artrl.Trajectory(messages_and_choices=[*convs[g], c], reward=rng.random())
                            for c in choices[g * args.group_size : (g + 1) * args.group_size]
                        )
                        for g in range(n_groups)
                    ]
                    t1 = time.perf_counter()
                    result = await model.train(groups, config=config)
                    call_s = time.perf_counter() - t1
                    m = result.metrics
                    train_s = float(m["train_seconds"])
                    processed = sum(prompt) + sum(completion)
                    row = {
                        "rollout_s": rollout_s,
                        "rollout_tokens": sum(completion),
                        "rollout_tok_s": sum(completion) / rollout_s,
                        "train_s": train_s,
                        "train_call_s": call_s,
                        "trainable_tokens": int(m["trainable_tokens"]),
                        "processed_tokens": processed,
                        "rows": int(m["rows"]),
                        "trainable_tok_s": int(m["trainable_tokens"]) / train_s,
                        "processed_tok_s": processed / train_s,
                        "loss": float(m.get("loss", float("nan"))),
                        "grad_norm": float(m.get("grad_norm", float("nan"))),
                    }
                    steps.append(row)
                    log(
                        f"step {step + 1}/{args.warmup + args.steps}{' (warm-up)' if step < args.warmup else ''}: "
                        f"rollouts {row['rollout_tokens']} tok in {rollout_s:.2f} s = "
                        f"{row['rollout_tok_s']:,.0f} tok/s; train {train_s:.3f} s "
                        f"({row['rows']} rows, {row['trainable_tokens']} trainable / {processed} processed "
                        f"tokens = {row['processed_tok_s']:,.0f} tok/s), train call {call_s:.2f} s, "
                        f"loss {row['loss']:.3g}, grad norm {row['grad_norm']:.3g}"
                    )
            finally:
                await client.close()
            peak_mem = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
        finally:
            await backend.close()
    return {
        "params": params,
        "trainable": trainable,
        "steps": steps,
        "reseeds": reseeds,
        "peak_mem_gib": peak_mem,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=None, help="concurrent rollouts per step (default 32)")
    parser.add_argument("--tokens", type=int, default=None, help="completion tokens each (default 128)")
    parser.add_argument("--group-size", type=int, default=4, help="rollouts per GRPO group (default 4)")
    parser.add_argument("--steps", type=int, default=None, help="measured steps (default 3)")
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
        help="run the same flow on the CPU with a tiny shape (hidden 64, 2 layers) and a light workload",
    )
    args = parser.parse_args(argv)
    light = args.dry_run_cpu
    args.agents = args.agents or (8 if light else 32)
    args.tokens = args.tokens or (16 if light else 128)
    args.steps = args.steps or (1 if light else 3)
    if args.group_size < 2 or args.agents < args.group_size or args.agents % args.group_size:
        parser.error("--agents must be a multiple of --group-size, and --group-size >= 2")
    if args.tokens < 1 or args.steps < 1 or args.warmup < 0:
        parser.error("--tokens >= 1, --steps >= 1, --warmup >= 0")
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
    log(
        f"device: {device_name}; torch {torch.__version__}; peak for MFU: {peak_source}; workload: "
        f"{args.agents} agents x {args.tokens} tokens, groups of {args.group_size}, {args.warmup} warm-up + "
        f"{args.steps} measured steps, {'full fine-tuning' if args.full_finetune else f'LoRA r{args.lora_rank}'}"
    )
    started = time.perf_counter()
    result = asyncio.run(run(args, device))
    measured = result["steps"][args.warmup :]

    def med(key: str) -> float:
        return statistics.median(s[key] for s in measured)

    flops_per_s = 6 * result["params"] * med("processed_tok_s")
    mfu = flops_per_s / peak if peak else None
    summary = {
        "device": device_name,
        "params": result["params"],
        "trainable_params": result["trainable"],
        "agents": args.agents,
        "tokens": args.tokens,
        "rollout_tok_s": med("rollout_tok_s"),
        "train_s": med("train_s"),
        "train_call_s": med("train_call_s"),
        "trainable_tok_s": med("trainable_tok_s"),
        "processed_tok_s": med("processed_tok_s"),
        "model_tflops_6n": flops_per_s / 1e12,
        "peak_tflops": peak / 1e12 if peak else None,
        "mfu_6n": mfu,
        "peak_gpu_mem_gib": result["peak_mem_gib"],
        "reseeded_completions": result["reseeds"],
        "wall_s": time.perf_counter() - started,
        "steps": result["steps"],
    }
    print()
    print(f"GPU check on {device_name}: {result['params']:,} parameters ({result['trainable']:,} trainable)")
    print(
        f"  rollouts: {summary['rollout_tok_s']:,.0f} tok/s ({args.agents} concurrent x {args.tokens} tokens)"
    )
    print(
        f"  training: {summary['train_s']:.3f} s/step, {summary['trainable_tok_s']:,.0f} trainable tok/s, "
        f"{summary['processed_tok_s']:,.0f} processed tok/s, {summary['model_tflops_6n']:.1f} TFLOP/s (6N)"
    )
    print(
        f"  MFU (6N, processed tokens): {f'{100 * mfu:.1f}%' if mfu is not None else 'n/a (' + peak_source + ')'}"
    )
    if summary["peak_gpu_mem_gib"] is not None:
        print(f"  peak GPU memory: {summary['peak_gpu_mem_gib']:.1f} GiB")
    print(f"  medians of {len(measured)} measured step(s); wall time {summary['wall_s']:.0f} s")
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(summary, indent=1))
        print(f"  wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
