"""The adapter, the training calls (GRPO and SFT), the trainer processes, and checkpoint retention."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import AliasChoices, Field, model_validator

from artrl.config.frozen import _Frozen


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
    progress: bool | None = Field(
        default=None,
        description="a live bar of each train / train_sft call on stderr (its phase, rows trained of its rows); "
        "None: when stderr is a terminal (or $ARTRL_PROGRESS=1)",
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        default="auto", description="torch.distributed's backend; auto = nccl on CUDA, gloo on CPU"
    )
    devices: tuple[str, ...] | None = Field(
        default=None,
        description="one device per rank, e.g. ('cuda:1', 'cuda:2'); None = cuda:0..N-1 when the engine's "
        "device is CUDA, else cpu",
    )
    fused_lora: bool = Field(
        default=True,
        description="ranks=1: each plain LoRA linear trains through one fused autograd product (local/train/fused_lora.py: "
        "the adapter's product added into the base output, its scale folded into B, no input casts) instead of "
        "PEFT's layer forward: the same gradients, 1.14x faster bf16 steps on a 2-core CPU. Layers with dropout, DoRA or "
        "a LoRA bias keep PEFT's forward either way",
    )
    fused_norms: bool = Field(
        default=True,
        description="ranks=1: each RMS norm of the Llama/Qwen kind trains through one autograd function with its "
        "backward pass in closed form (local/train/fused_norm.py) instead of a dozen autograd nodes: the same forward, "
        "bit for bit, and gradients equal to rounding. Norms that compute anything else keep their forward",
    )
    share_prompts: bool = Field(
        default=True,
        description="ranks=1: rows that begin with the same prompt (a group's rollouts of one scenario) train in "
        "micro-batches of their own that compute the prompt once, its keys and values shared by every row "
        "(local/train/logprobs.py): the same loss and gradients for fewer tokens (the maze demo's rows: 46% fewer). Not "
        "under gradient_checkpointing, nor for models with recurrent state or linear-attention layers",
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
    kl_coef: float = Field(
        default=0.0,
        ge=0,
        validation_alias=AliasChoices("kl_coef", "beta"),  # (ART's name: TrainConfig(beta=...))
        description="KL penalty to the base model (adapter disabled)",
    )
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
    final_lr_fraction: float = Field(
        default=1.0,
        gt=0,
        le=1,
        description="the learning rate of the call's last optimizer step as a fraction of learning_rate, reached "
        "linearly from learning_rate at its first (1.0: constant)",
    )
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
    render_workers: int | None = Field(
        default=None,
        ge=0,
        description="processes that render conversations given as plain messages into rows beside the training "
        "process, from 256 trajectories on (None: one per CPU beyond the first, at most 4; 0: none)",
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
