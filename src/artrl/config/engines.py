"""The engines: the embedded one, vLLM (one server or several replicas), and how the base model is loaded."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from artrl.config.frozen import _Frozen


class VLLMConfig(_Frozen):
    """The vLLM engine (`EngineConfig(kind="vllm")`): a vLLM OpenAI server driven token-in/token-out.

    artrl starts and supervises the server as a subprocess in vLLM's own environment (`bash
    scripts/setup_vllm.sh` makes `.venv-vllm`), or connects to one that is already running (`url`).
    """

    url: str | tuple[str, ...] | None = Field(
        default=None,
        description="an already running vLLM server (e.g. http://host:8000), or several (a list: replicas of one "
        "model, one key); None = start `replicas` servers. Training needs them started with --enable-lora and "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, on this filesystem",
    )
    replicas: int = Field(
        default=1,
        ge=1,
        description="vLLM servers artrl starts, behind the one gateway: a conversation's next call goes to the "
        "server that served its previous one (its prefix cache), a new conversation to the least loaded",
    )
    tensor_parallel_size: int = Field(
        default=1, ge=1, description="vLLM's --tensor-parallel-size: devices (GPUs) each replica spans"
    )
    replica_env: tuple[dict[str, str], ...] = Field(
        default=(),
        description="per replica, environment on top of `env` (e.g. its CUDA_VISIBLE_DEVICES); () = artrl "
        "places several replicas itself unless `env` says: on GPUs, replica i gets the i-th group of "
        "tensor_parallel_size visible GPUs (CUDA_VISIBLE_DEVICES); on CPU, its own share of the cores "
        "(VLLM_CPU_OMP_THREADS_BIND, unless the environment sets it)",
    )
    health_check_interval_s: float = Field(
        default=2.0, gt=0, description="how often the supervisor checks every replica (process, /health)"
    )
    health_failures_before_restart: int = Field(
        default=3,
        ge=1,
        description="failed /health checks in a row (process alive) before a restart: no answer or a 5xx; a "
        "check that times out counts only if no token came from that replica since the previous check",
    )
    max_restarts: int = Field(
        default=5,
        ge=0,
        description="restarts in a row per replica (reset once it serves tokens again); beyond, it stays "
        "down (the others go on serving)",
    )
    affinity_entries: int = Field(
        default=100_000, ge=0, description="served sequences remembered to route their continuations (LRU)"
    )
    api_key: str | None = Field(
        default=None,
        min_length=1,
        description="the key of the server at `url` (its --api-key); a server artrl starts gets this key, or "
        "when None a fresh random one, so no other local process can generate or swap its adapters",
    )
    python: str | None = Field(
        default=None,
        description="the interpreter of vLLM's environment; None = $ARTRL_VLLM_PYTHON, else .venv-vllm/bin/python "
        "in the working directory or the artrl checkout",
    )
    startup_timeout_s: float = Field(default=600.0, gt=0, description="until /health answers 200")
    request_timeout_s: float = Field(default=600.0, gt=0, description="one generation request, end to end")
    connect_timeout_s: float = Field(default=10.0, gt=0)
    lora_window: int = Field(
        default=3, ge=1, description="adapters kept loaded: the latest step and the ones before it"
    )
    max_lora_rank: int | None = Field(
        default=None, description="--max-lora-rank; None = the model's LoRA rank rounded up to vLLM's sizes"
    )
    max_loras: int | None = Field(
        default=None,
        ge=1,
        description="--max-loras (adapters in one batch); None = lora_window, or on a training server's shared "
        "vLLM server 8 (several models' adapters batched together)",
    )
    gpu_memory_utilization: float | None = Field(
        default=None, gt=0, le=1, description="GPU only: vLLM's share of the GPU (leave room for the trainer)"
    )
    cpu_kv_cache_gib: float = Field(default=1.0, gt=0, description="CPU builds: VLLM_CPU_KVCACHE_SPACE")
    sleep_while_training: bool = Field(
        default=False,
        description="GPU only: put vLLM to sleep (level 1) around each training step, so that one GPU holds "
        "the trainer and vLLM in turn (starts the server with --enable-sleep-mode and VLLM_SERVER_DEV_MODE=1)",
    )
    chunked_prefill: bool | None = Field(
        default=None,
        description="None = vLLM's default on a GPU, off on CPU: vllm-cpu 0.32 kills its engine when a seeded "
        "request's prompt is split across steps ('CPU Generator does not use offset')",
    )
    wire: Literal["auto", "completions", "generate"] = Field(
        default="auto",
        description="how the gateway asks vLLM for tokens: 'generate' = vLLM's token-in/token-out "
        "/inference/v1/generate (token ids as integers, nothing detokenized or formatted as text on "
        "vLLM's side; vLLM >= 0.32 started with --enable-scale-out, as artrl starts it: an older vLLM needs "
        "'completions'); 'completions' = "
        "/v1/completions with a prompt of ids (any vLLM server); 'auto' = generate on the servers artrl starts, "
        "completions on a server at `url` (one that may lack the flag). Both cost vLLM about the same; generate "
        "gives the gateway less to read (no text, no token strings)",
    )
    stream_interval: int = Field(
        default=16,
        ge=1,
        description="tokens per streamed chunk that the gateway asks vLLM for (vLLM's per-request "
        "stream_interval, >= 0.32; older servers ignore it, logging that they did): reading vLLM's stream costs "
        "the gateway CPU per chunk, not per token. The first and last chunks come at once, so a call that runs "
        "to its end takes as long; one the gateway ends itself (a stop string, parallel_tool_calls=false) lets "
        "vLLM run up to this many tokens past its stop. 1 = the server's own interval (one token a chunk unless "
        "it was started with a larger --stream-interval)",
    )
    extra_args: tuple[str, ...] = Field(default=(), description="more vLLM server arguments, passed as given")
    env: dict[str, str] = Field(
        default_factory=dict,
        description="environment for the server only, e.g. {'CUDA_VISIBLE_DEVICES': '1'} to give vLLM its own "
        "GPU while the trainer uses EngineConfig(device='cuda:0')",
    )
    log_tail_lines: int = Field(default=40, ge=1, description="lines of the server log quoted in errors")
    stop_grace_s: float = Field(
        default=20.0, gt=0, description="a server asked to stop gets this long before SIGKILL"
    )
    drain_timeout_s: float = Field(
        default=60.0,
        ge=0,
        description="full fine-tuning's rolling restart: a replica's requests in flight get this long to end "
        "before it restarts on the new weights",
    )

    @property
    def urls(self) -> tuple[str, ...]:
        """The running servers given by `url` (none: artrl starts its own)."""
        if self.url is None:
            return ()
        return (self.url,) if isinstance(self.url, str) else tuple(self.url)

    @model_validator(mode="after")
    def _replicas_agree(self) -> VLLMConfig:
        if isinstance(self.url, tuple) and not self.url:
            raise ValueError("VLLMConfig(url=[]): give at least one server, or url=None to start them")
        if self.url is not None and "replicas" in self.model_fields_set and self.replicas != len(self.urls):
            raise ValueError(
                f"VLLMConfig(replicas={self.replicas}) with {len(self.urls)} server url(s): artrl starts no server "
                "when url is set; list every running server in url=[...] (replicas is then their number)"
            )
        if self.replica_env and len(self.replica_env) != self.replica_count:
            raise ValueError(
                f"VLLMConfig(replica_env=...) has {len(self.replica_env)} entries for {self.replica_count} replicas"
            )
        return self

    def wire_for(self, started: bool) -> Literal["completions", "generate"]:
        """The wire a server gets: `wire`, 'auto' resolved (generate where artrl started the server)."""
        if self.wire != "auto":
            return self.wire
        return "generate" if started else "completions"

    @property
    def replica_count(self) -> int:
        return len(self.urls) or self.replicas


class LoadConfig(_Frozen):
    """How the base model is loaded: what `from_pretrained` gets (and vLLM, where it applies)."""

    revision: str | None = Field(
        default=None, description="a hub model's branch, tag or commit (None: its default branch)"
    )
    trust_remote_code: bool = Field(
        default=False,
        description="run the Python code a model folder or hub repo ships (its `auto_map`); only models you "
        "trust, and only when asked",
    )
    attn_implementation: str | None = Field(
        default=None,
        description="transformers' attention ('sdpa', 'eager', 'flash_attention_2', ...); None: its default, "
        "with artrl's CPU attention on a CPU (EngineConfig.cpu_attention). Set, it is used as given",
    )
    device_map: str | dict[str, int | str] | None = Field(
        default=None,
        description="accelerate's placement of the model's modules across devices ('auto', 'balanced', or "
        "{module: device}), for a model too big for one GPU: the trainer's copy with EngineConfig(kind='vllm') "
        "(vLLM spreads its own with tensor_parallel_size); the embedded engine needs the model on one device; "
        "None = the whole model on EngineConfig.device",
    )
    quantization: Literal["none", "4bit"] = Field(
        default="none",
        description="4bit: NF4 base weights for LoRA training (QLoRA, bitsandbytes), compute in the engine's "
        "dtype; needs a CUDA GPU and `pip install bitsandbytes`, and a LoRA adapter",
    )


class EngineConfig(_Frozen):
    """Which engine generates tokens, and its settings.

    kind="hf": the embedded engine, in-process PyTorch sharing one copy of the weights with the trainer.
    kind="vllm": a vLLM server (see VLLMConfig); the trainer keeps its own copy and the new weights are
    loaded into vLLM after every step.
    """

    kind: Literal["hf", "vllm"] = "hf"
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)
    load: LoadConfig = Field(default_factory=LoadConfig)
    max_batch_size: int = Field(default=64, ge=1, description="sequences decoded together at most")
    max_prefill_tokens: int = Field(
        default=16384, ge=1, description="padded prompt tokens one batched prefill holds at most (memory)"
    )
    max_context: int | None = Field(
        default=None, description="prompt + completion tokens; None = the model's max_position_embeddings"
    )
    kv_cache_budget_bytes: int | None = Field(
        default=16 * 1024**3,
        ge=1,
        description="embedded engine: the running batch's KV cache at most, every row padded to the longest "
        "(rows × the longest row's prompt + max_tokens × the keys and values of a token across layers); a request "
        "that would exceed it waits, in order, for rows to finish (one alone always runs). None = no limit",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = Field(default="auto", description="'auto' picks cuda when available, else cpu")
    default_max_tokens: int = Field(default=1024, ge=1, description="when a request sets no max_tokens")
    stream_idle_timeout_s: float = Field(
        default=1800.0,
        gt=0,
        description="a sequence that gets no token for this long fails instead of hanging its client; longer "
        "than a training step, which pauses the embedded engine",
    )
    max_n: int = Field(default=32, ge=1, description="largest `n` one request may ask for")
    prefix_cache_bytes: int = Field(
        default=512 * 1024 * 1024,
        ge=0,
        description="embedded engine: keys and values of finished sequences kept for prompts that continue "
        "them (an agent's next call, another rollout of the same prompt); 0 = off. Cleared by training",
    )
    cpu_attention: bool = Field(
        default=True,
        description="on CPU, artrl's attention (local/kernels/cpu_attention.py) where torch's flash kernel is slow: "
        "bf16/fp16 decode steps and training (local/kernels/chunked_attention.py); everything else keeps sdpa (set when the "
        "model is loaded)",
    )
    merge_lora: Literal["auto", "always", "never"] = Field(
        default="auto",
        description="embedded engine: generate with a merged copy of the adapted weights (W + s·B·A, "
        "recomputed after each training step; one more copy of those weights in memory) instead of running the "
        "adapter on every forward. auto = on CPU, where it makes decoding ~1.3x and prefill ~2x faster",
    )
    fused_decode: bool = Field(
        default=True,
        description="embedded engine on CPU, Llama/Qwen2/Qwen3/Mistral layouts: decode steps and prefills through "
        "artrl's own forward (local/engine/hf/fused_decode.py: q/k/v and gate/up in one product each, weights packed for "
        "oneDNN once per training step) instead of the transformers forward: 1.5x (bf16) to 2x (fp32) faster "
        "decode steps at 8 sequences on the 27M model. One more copy of the decoder's linear weights in memory",
    )
    generation_threads: int | None = Field(
        default=None,
        ge=1,
        description="embedded engine: torch threads for its prefill and decode steps (training steps on its "
        "thread keep torch's default). None = torch's default, one per core. 1 pays on a small model whose "
        "products are too small to split, where a second thread only waits at every operation and takes a core "
        "from the gateway and the agents: the demo's maze rollouts (0.23M parameters, service in a child "
        "process) ~1.15x faster. Larger models want the default",
    )
    engine_thread_idle_s: float = Field(
        default=2.0,
        gt=0,
        description="embedded engine: its compute thread ends after this long with nothing to do and starts "
        "again with the next request or training step. An idle thread keeps its OpenMP team, and with more "
        "OpenMP threads than CPUs libgomp throttles every team's spin-waiting: a second engine (a judge, a "
        "baseline) idling in the process slowed the first by ~20% on CPU (benchmarks/bench_idle_backend.py). A "
        "new thread pays ~30 ms of first-use setup (oneDNN primitives) on the 27M model",
    )
    prefix_cache_min_tokens: int = Field(
        default=32, ge=1, description="shortest shared prefix worth reusing (shorter ones are prefilled)"
    )
