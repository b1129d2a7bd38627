"""Typed configuration. Every default of the framework lives in this file.

Configs are frozen pydantic models: a knob that is not declared here does not exist, and a typo in a
keyword argument is an error, not a silently ignored setting.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class TinyModelConfig(_Frozen):
    """Shape of a model that `artrl tiny-model` builds offline (a Qwen3-architecture causal LM).

    head_dim stays >= 32 so that vLLM can serve the same folder.
    """

    vocab_size: int = 2048
    hidden_size: int = 64
    intermediate_size: int = 192
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    head_dim: int = 32
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    seed: int = 0


TINY_MODEL_PRESETS: dict[str, TinyModelConfig] = {
    # ~0.4M parameters: the test and demo model.
    "tiny": TinyModelConfig(),
    # ~27M parameters: the benchmark model (per-token cost of a real, if small, transformer).
    "small": TinyModelConfig(
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
    ),
}


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
        description="the key of the server at `url` (its --api-key); a server artrl starts gets a fresh random "
        "key, so no other local process can generate or swap its adapters",
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
        description="on CPU, artrl's attention (local/cpu_attention.py) where torch's flash kernel is slow: "
        "bf16/fp16 decode steps and training; everything else keeps sdpa (set when the model is loaded)",
    )
    merge_lora: Literal["auto", "always", "never"] = Field(
        default="auto",
        description="embedded engine: generate with a merged copy of the adapted weights (W + s·B·A, "
        "recomputed after each training step; one more copy of those weights in memory) instead of running the "
        "adapter on every forward. auto = on CPU, where it makes decoding ~1.3x and prefill ~2x faster",
    )
    prefix_cache_min_tokens: int = Field(
        default=32, ge=1, description="shortest shared prefix worth reusing (shorter ones are prefilled)"
    )


class GatewayConfig(_Frozen):
    """The OpenAI-compatible HTTP gateway.

    It listens on loopback by default. Bound anywhere else it needs an `api_key` (anyone who can reach the
    port could otherwise generate, read captures and change nothing less than the training data), unless
    `allow_unauthenticated=True` says that the network is trusted.
    """

    host: str = "127.0.0.1"
    port: int = Field(default=0, ge=0, le=65535, description="0 = a free port chosen at start")
    api_key: str | None = Field(
        default=None, min_length=1, description="if set, requests need `Authorization: Bearer <key>`"
    )
    allow_unauthenticated: bool = Field(
        default=False, description="serve on a non-loopback host without an api_key (a trusted network)"
    )
    completion_store_size: int = Field(
        default=20_000, ge=0, description="completions remembered for token-exact continuation (LRU)"
    )
    stored_responses: int = Field(
        default=1000, ge=0, description="Responses API: the last responses kept for `previous_response_id`"
    )
    startup_timeout_s: float = Field(default=60.0, gt=0)
    keep_alive_s: float = Field(
        default=75.0,
        gt=0,
        description="idle keep-alive connections are closed after this; it must exceed HTTP clients' own idle "
        "expiry (httpx: 5 s) or a request sent as the server closes the connection is lost",
    )
    max_request_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)
    in_process_clients: bool = Field(
        default=True,
        description="`model.openai_client()` reaches the gateway in its own process without a socket (the "
        "same routes, no TCP or HTTP parsing); False = over HTTP like any other client",
    )
    max_inflight_requests: int = Field(
        default=1024,
        ge=1,
        description="chat requests being prepared or generated at once; beyond, a 429 (clients retry later)",
    )
    max_open_captures: int = Field(default=4096, ge=1, description="`artrl.capture` blocks open at once")
    max_capture_records: int = Field(default=10_000, ge=1, description="calls recorded by one capture")
    max_capture_bytes: int = Field(
        default=256 << 20, ge=1024, description="bytes (as JSON) one capture holds"
    )
    max_captured_bytes: int = Field(default=2 << 30, ge=1024, description="bytes all open captures hold")
    capture_idle_expiry_s: float = Field(
        default=3600.0,
        ge=0,
        description="a capture nobody used for this long is dropped (a client that died)",
    )
    capture_close_grace_s: float = Field(
        default=120.0,
        ge=0,
        description="a closed capture's records stay this long (a close reply that was lost)",
    )

    @model_validator(mode="after")
    def _key_beyond_loopback(self) -> GatewayConfig:
        if not is_loopback(self.host) and self.api_key is None and not self.allow_unauthenticated:
            raise ValueError(
                f"GatewayConfig(host={self.host!r}) would serve on the network without a key: set "
                "api_key='...' (clients send it as a Bearer token), or allow_unauthenticated=True on a "
                "trusted network"
            )
        return self


def is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class ClientConfig(_Frozen):
    """How `TrainableModel.openai_client()` talks to the gateway."""

    timeout_s: float = Field(default=600.0, gt=0)
    max_retries: int = Field(default=2, ge=0)


class LoraConfig(_Frozen):
    """The adapter trained on top of the served base weights (fixed when the model is registered)."""

    rank: int = Field(default=8, ge=1)
    alpha: float = Field(default=16.0, gt=0)
    dropout: float = Field(default=0.0, ge=0, lt=1)
    target_modules: tuple[str, ...] = (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )


class TrainerConfig(_Frozen):
    """Where the trainer runs (`LocalBackend(trainer=...)`).

    ranks=1: in this process, on the very weights the embedded engine serves (no copy, no messages).
    ranks=N>1: N trainer processes (torch.distributed, FSDP2 `fully_shard` per decoder layer): each step's
    rows are split across them by tokens, the gradients reduced, and the new weights (the adapter, or every
    weight without one) loaded into the served model before the next rollout. Checkpoints keep one format,
    so a run resumes with any number of ranks. See docs/multi-gpu.md.
    """

    ranks: int = Field(default=1, ge=1, description="trainer processes; 1 = in this process")
    backend: Literal["auto", "gloo", "nccl"] = Field(
        default="auto", description="torch.distributed's backend; auto = nccl on CUDA, gloo on CPU"
    )
    devices: tuple[str, ...] | None = Field(
        default=None,
        description="one device per rank, e.g. ('cuda:1', 'cuda:2'); None = cuda:0..N-1 when the engine's "
        "device is CUDA, else cpu",
    )
    start_timeout_s: float = Field(default=600.0, gt=0, description="until every rank has loaded the model")
    call_timeout_s: float = Field(
        default=3600.0, gt=0, description="one train, train_sft or checkpoint call on the ranks, end to end"
    )
    collective_timeout_s: float = Field(
        default=600.0, gt=0, description="torch.distributed's timeout: a collective some rank never joins"
    )

    @model_validator(mode="after")
    def _one_device_per_rank(self) -> TrainerConfig:
        if self.devices is not None and len(self.devices) != self.ranks:
            raise ValueError(f"TrainerConfig: {len(self.devices)} devices for {self.ranks} ranks")
        return self


class TrainConfig(_Frozen):
    """One `model.train(groups, config=...)` call = one optimizer step over all the groups' rows.

    The rows are packed into micro-batches of at most `max_tokens_per_microbatch` tokens; gradients of all
    micro-batches are accumulated (the loss is normalised by the trainable tokens of the whole call) and
    AdamW steps once. Set `steps_per_call` > 1 to split the rows into that many optimizer steps instead.
    """

    learning_rate: float = Field(default=1e-4, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = Field(default=0.0, ge=0)
    max_grad_norm: float | None = Field(default=1.0, gt=0, description="None = no gradient clipping")
    loss: Literal["ppo", "cispo"] = "ppo"
    clip_low: float = Field(default=0.2, ge=0, description="PPO: ratio clipped below at 1 - clip_low")
    clip_high: float = Field(
        default=0.28, ge=0, description="PPO/CISPO: ratio clipped above at 1 + clip_high"
    )
    tis_cap: float | None = Field(
        default=None, gt=0, description="truncated importance sampling: cap on trainer/sampler ratio"
    )
    kl_coef: float = Field(default=0.0, ge=0, description="KL penalty to the base model (adapter disabled)")
    scale_rewards: bool = Field(
        default=True, description="divide advantages by the group std (False: Dr.GRPO)"
    )
    mismatch_threshold: float = Field(
        default=0.5,
        gt=0,
        description="a sampled token whose trainer and engine logprobs differ by more than this counts in "
        "the logprob_mismatch_fraction metric",
    )
    advantage_eps: float = Field(default=1e-6, gt=0)
    max_staleness: int | None = Field(
        default=None,
        ge=0,
        description="drop trajectories sampled by a policy more than this many steps older than the weights "
        "being updated (asynchronous rollouts, `artrl.rollouts_ahead`); None keeps all. The step's metrics "
        "report staleness_mean/max and trajectories_dropped_stale either way",
    )
    gradient_checkpointing: bool = Field(
        default=False,
        description="recompute each decoder layer's activations in the backward pass: the activations of one "
        "layer held instead of all of them, for about a third more compute (long sequences, big models)",
    )
    max_tokens_per_microbatch: int = Field(default=4096, ge=16)
    logprob_chunk_size: int | None = Field(
        default=None,
        ge=1,
        description="positions per lm_head chunk (None: as many as keep a chunk's fp32 logits within "
        "256 MiB, e.g. ~450 for a 150k vocabulary, all of them for a small one)",
    )
    steps_per_call: int = Field(default=1, ge=1)
    allow_rendered_turns: bool = Field(
        default=False,
        description="train assistant turns without recorded token ids by rendering them with the chat "
        "template (not token-exact; off by default)",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="template variables for rendering turns without recorded ids (e.g. enable_thinking)",
    )
    save_rows: bool = Field(
        default=True,
        description="write what the step trained, token by token (trajectories/train/NNNN.rows.jsonl.gz, "
        "shown by `artrl dashboard`): about 4 bytes per token gzipped",
    )


class SFTConfig(_Frozen):
    """`model.train_sft(trajectories, config=...)`: supervised fine-tuning on assistant tokens only.

    One call = `epochs` shuffled passes over the trajectories in optimizer steps of `batch_size`
    trajectories each, then one checkpoint (the call is one step of the model's history, split "sft").
    """

    learning_rate: float = Field(default=1e-3, gt=0)
    epochs: int = Field(default=1, ge=1)
    batch_size: int = Field(default=16, ge=1, description="trajectories per optimizer step")
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = Field(default=0.0, ge=0)
    max_grad_norm: float | None = Field(default=1.0, gt=0)
    gradient_checkpointing: bool = Field(
        default=False,
        description="recompute each decoder layer's activations in the backward pass: the activations of one "
        "layer held instead of all of them, for about a third more compute (long sequences, big models)",
    )
    max_tokens_per_microbatch: int = Field(default=4096, ge=16)
    logprob_chunk_size: int | None = Field(default=None, ge=1, description="as TrainConfig's")
    seed: int = 0
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="template variables for rendering the turns (e.g. enable_thinking)"
    )


TrackerName = Literal["wandb", "tensorboard", "trackio"]


class CheckpointRetention(_Frozen):
    """Which checkpoints a model keeps: `TrainableModel(retention=...)` applies it after every step, and
    `model.delete_checkpoints(...)` once. The latest checkpoint is always kept (training resumes from it)."""

    keep_last: int | None = Field(default=None, ge=1, description="the newest N checkpoints")
    keep_best: str | None = Field(
        default=None,
        description="'split/metric' of history.jsonl, e.g. 'val/reward_mean': the checkpoint whose step has the "
        "best value of that metric is kept as well",
    )
    best_mode: Literal["max", "min"] = Field(default="max", description="whether higher or lower is better")

    @model_validator(mode="after")
    def _metric_form(self) -> CheckpointRetention:
        if self.keep_best is not None and self.keep_best.count("/") != 1:
            raise ValueError(
                f"keep_best={self.keep_best!r}: name a metric as 'split/metric', e.g. 'val/reward_mean'"
            )
        return self


class DashboardConfig(_Frozen):
    """`artrl dashboard PATH`: a local web page over the runs under PATH."""

    host: str = Field(default="127.0.0.1", description="loopback by default: the page shows trajectories")
    port: int = Field(default=8765, ge=0, le=65535)
    poll_interval_s: float = Field(default=3.0, gt=0, description="how often the page refreshes a live run")
    max_tokens_shown: int = Field(default=20_000, ge=1, description="tokens of one row sent to the page")
