"""How vLLM serves one model: the supervised servers artrl starts (one per replica, each on its share of the
cores or GPUs), or the running server(s) at `VLLMConfig.url`; the engine over them, serving a checkpoint."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Mapping
from concurrent.futures import Executor, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from artrl.config import EngineConfig, LoraConfig, VLLMConfig
from artrl.local.engine.vllm.engine import VLLMEngine
from artrl.local.engine.vllm.replicas import Replica
from artrl.local.engine.vllm.server import VLLMServer, replica_placement
from artrl.local.models.loading import pick_device, pick_dtype


@dataclass(frozen=True)
class VLLMShare:
    """A model on a vLLM server that several models share: its adapters' names there, `{adapter_name}@{step}`
    (unique among the models), and the one thread on which every model's training calls take turns."""

    adapter_name: str
    trainer_thread: Executor


@dataclass(frozen=True)
class VLLMLaunch:
    """How vLLM serves one model: started by artrl (on the base weights, or on a full-weights checkpoint), or
    the server at `VLLMConfig.url`."""

    served_name: str
    base_model: str
    engine_config: EngineConfig
    max_context: int
    lora: LoraConfig | None
    log_dir: Path | None
    share: VLLMShare | None = None  # a vLLM server several models share (a training server's)

    def engine(self, resume_from: Path | None) -> VLLMEngine:
        """The engine, with `resume_from`'s weights served: its adapter loaded, or its full weights."""
        config = self.engine_config.vllm
        start = None
        full_weights = resume_from if self.lora is None else None
        if config.urls:
            if self.lora is None:
                raise ValueError(
                    "full fine-tuning (lora=None) with a vLLM server artrl did not start (vllm_url) cannot "
                    "reload the weights after a step; train a LoRA, or let artrl start the server"
                )
            served = {served_model_of(url, config) for url in config.urls}
            if len(served) > 1:
                raise ValueError(f"the vLLM servers at {list(config.urls)} serve different models: {served}")
            replicas = [Replica(i, url.rstrip("/"), config.api_key) for i, url in enumerate(config.urls)]
            base = served.pop()
        else:
            with ThreadPoolExecutor(config.replicas) as pool:
                starts = [pool.submit(self.server, i, full_weights) for i in range(config.replicas)]
                wait(starts)
            if any(f.exception() for f in starts):
                for f in starts:
                    if f.exception() is None:
                        f.result().stop()
                raise next(f.exception() for f in starts if f.exception())  # type: ignore[misc]
            servers = [f.result() for f in starts]
            weights = str(full_weights) if full_weights else None
            replicas = [Replica(i, s.base_url, s.api_key, s, weights=weights) for i, s in enumerate(servers)]
            base = self.served_name

            def start(index: int, checkpoint: str | None, cancel: threading.Event) -> VLLMServer:
                return self.server(index, Path(checkpoint) if checkpoint else None, cancel)

        idle_s = self.engine_config.engine_thread_idle_s
        name = self.share.adapter_name if self.share is not None else self.served_name
        trainer_thread = self.share.trainer_thread if self.share is not None else None
        engine = VLLMEngine(replicas, base, name, self.max_context, config, start, idle_s, trainer_thread)
        engine.replicas.weights = str(full_weights) if full_weights else None
        if self.lora is not None and resume_from is not None:
            try:
                asyncio.run(engine.load_adapter(int(resume_from.name), str(resume_from)))
            except BaseException:
                asyncio.run(engine.close())
                raise
        return engine

    def server(
        self, index: int = 0, full_weights: Path | None = None, cancel: threading.Event | None = None
    ) -> VLLMServer:
        """Replica `index`'s supervised server on the base model (adapters enabled with a LoRA), or on a full
        checkpoint; several replicas on one machine get their own cores or GPUs (replica_placement)."""
        device = pick_device(self.engine_config)
        config = self.engine_config.vllm
        user_env = {**config.env, **(config.replica_env[index] if config.replica_env else {})}
        on_cpu, tensor_parallel = device.type == "cpu", config.tensor_parallel_size
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = visible.split(",") if visible else None
        if gpus is None and device.type == "cuda":
            import torch

            gpus = [str(i) for i in range(torch.cuda.device_count())]
        placement = replica_placement(
            index,
            config.replicas,
            tensor_parallel,
            on_cpu,
            sorted(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity")
            else list(range(os.cpu_count() or 1)),
            {**os.environ, **user_env} if on_cpu else user_env,
            gpus,
        )
        log_name = "vllm.log" if config.replicas == 1 else f"vllm-{index}.log"
        return VLLMServer.start(
            str(full_weights or self.base_model),
            self.served_name,
            (self.log_dir or Path(".")) / log_name,
            config,
            max_model_len=self.max_context,
            tokenizer=self.base_model if full_weights else None,
            lora_rank=self.lora.rank if self.lora else None,
            dtype=str(pick_dtype(self.engine_config, device)).removeprefix("torch."),
            on_cpu=on_cpu,
            load=self.engine_config.load,
            env={
                **placement,
                **cpu_process_env(on_cpu, tensor_parallel, {**os.environ, **placement, **user_env}),
                **user_env,
            },
            cancel=cancel,
        )


def cpu_process_env(on_cpu: bool, tensor_parallel: int, env: Mapping[str, str]) -> dict[str, str]:
    """vLLM's processes on a CPU host, where `env` (the user's, this process's and the replica placement's
    environment) does not say: one rank runs its model in vLLM's engine-core process
    (VLLM_ENABLE_V1_MULTIPROCESSING=0: vLLM's single-process executor), not in a worker process of its own.
    vLLM's CPU platform otherwise starts that worker, and its engine core then waits for each step's output
    spinning on sched_yield (shm_broadcast's reader, busy for 1 s after each read) on the cores vLLM leaves to
    everything else: on a small host it takes most of a core from the agents and the gateway: 64 agent sessions
    ran 3-7x slower in about one run of two. Without the worker (vLLM's CPU steps are synchronous: the engine
    core waited for each anyway) the same benchmark ran 1.8x (8 sessions) its tok/s on a 2-core host, with no
    slow runs (benchmarks/RESULTS.md, the vLLM path), and the server starts faster (one process fewer imports
    vLLM). vLLM binds its OpenMP threads to cores only in a worker process it starts: where cores are chosen
    (VLLM_CPU_OMP_THREADS_BIND: the user's, or each of several replicas' own), and for tensor-parallel ranks,
    vLLM's worker processes stay; on GPUs, vLLM's own choice."""
    if not on_cpu or tensor_parallel > 1:
        return {}
    if "VLLM_ENABLE_V1_MULTIPROCESSING" in env or "VLLM_CPU_OMP_THREADS_BIND" in env:
        return {}
    return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def served_model_of(url: str, config: VLLMConfig) -> str:
    """The model a running vLLM server serves (its first /v1/models entry that is not an adapter)."""
    import httpx

    try:
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        response = httpx.get(
            f"{url.rstrip('/')}/v1/models", timeout=config.connect_timeout_s, headers=headers
        )
        response.raise_for_status()
        models = response.json()["data"]
    except (httpx.HTTPError, KeyError, ValueError) as exc:
        raise RuntimeError(f"could not list the models of the vLLM server at {url}: {exc}") from exc
    bases = [m["id"] for m in models if not m.get("parent")]
    if not bases:
        raise RuntimeError(f"the vLLM server at {url} serves no base model: {models}")
    return bases[0]
