"""One trainer rank: a process that `TrainerRanks` (trainer_ranks.py) starts as
`python -m artrl.local.train.ranks.trainer_rank READ_FD WRITE_FD`.

It joins the torch.distributed group (the main process holds the TCPStore), loads the same model as the
main process, shards it with FSDP2 (`fully_shard` on each decoder layer, then on a root that holds the
embeddings, final norm and lm_head), and answers commands over two pipes: `step`, `sft`, `save_optimizer`,
`close`. Every rank receives every row of a step and trains its own share (row_shards.py); the loss is
normalised over all the step's rows, so the gradients FSDP sums across ranks are one process's gradients.
"""

from __future__ import annotations

import datetime
import os
import sys
import traceback
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from artrl.config import EngineConfig, LoraConfig, SFTConfig, TrainConfig
from artrl.local.models.loading import load_model_and_tokenizer
from artrl.local.train.adapters import attach_adapter
from artrl.local.train.batch import TrainingBatch
from artrl.local.train.logprobs import token_logprobs
from artrl.local.train.pack import MicroBatch
from artrl.local.train.ranks.row_shards import rank_micro_batches
from artrl.local.train.rows import Row
from artrl.local.train.trainer import Trainer


@dataclass(frozen=True)
class RankSpec:
    """What one rank needs to start (sent pickled over its pipe)."""

    rank: int
    ranks: int
    store_port: int  # the main process's TCPStore on 127.0.0.1
    backend: str  # "gloo" | "nccl"
    device: str
    base_model: str
    engine: EngineConfig
    lora: LoraConfig | None
    weights_from: str | None  # a full-weights checkpoint folder (lora=None), else the base weights
    adapter: bytes | None  # the main process's adapter (safetensors): its random init, or the resumed one
    optimizer_file: str | None  # optimizer.pt of the checkpoint resumed (one process's format)
    pad_id: int
    collective_timeout_s: float
    threads: int


class LogprobForward(nn.Module):
    """The FSDP root: `token_logprobs` as its forward, so the root's parameters (embeddings, final norm,
    lm_head; tied or not) are gathered for it and their gradients reduced after it."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, mb: MicroBatch, chunk: int | None, with_entropy: bool) -> Any:
        return token_logprobs(self.model, mb, chunk, with_entropy)


class AcrossRanks:
    """Metric sums and maxima over the ranks (all_reduce)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def _reduce(self, values: list[float], op: Any) -> list[float]:
        if not values:
            return values
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)  # (K,)
        dist.all_reduce(tensor, op=op)
        return tensor.tolist()

    def sum(self, values: list[float]) -> list[float]:
        return self._reduce(values, dist.ReduceOp.SUM)

    def max(self, values: list[float]) -> list[float]:
        return self._reduce(values, dist.ReduceOp.MAX)


def trainable_names(model: nn.Module) -> list[str]:
    """Names of the trained parameters, in the optimizer's order (the order of one process's Trainer)."""
    return [name for name, p in model.named_parameters() if p.requires_grad]


def optimizer_state_by_index(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """torch.distributed.checkpoint's full optimizer state (keyed by parameter name) in one process's
    `optimizer.state_dict()` format (keyed by the parameter's place in `names`): checkpoints stay one format."""
    place = {name: i for i, name in enumerate(names)}
    return {
        "state": {place[name]: value for name, value in state["state"].items()},
        "param_groups": [{**g, "params": [place[n] for n in g["params"]]} for g in state["param_groups"]],
    }


def optimizer_state_by_name(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The inverse of `optimizer_state_by_index`."""
    return {
        "state": {names[int(i)]: value for i, value in state["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]],
    }


class Rank:
    """This process's share of the model, its trainer, and the commands it answers."""

    def __init__(self, spec: RankSpec) -> None:
        from safetensors.torch import load as load_safetensors
        from torch.distributed.fsdp import FSDPModule, fully_shard

        self.spec = spec
        self.device = torch.device(spec.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        timeout = datetime.timedelta(seconds=spec.collective_timeout_s)
        store = dist.TCPStore("127.0.0.1", spec.store_port, spec.ranks, is_master=False, timeout=timeout)
        dist.init_process_group(
            spec.backend, store=store, rank=spec.rank, world_size=spec.ranks, timeout=timeout
        )
        engine = spec.engine.model_copy(update={"device": spec.device})
        model, _ = load_model_and_tokenizer(spec.base_model, engine, spec.weights_from)
        model = attach_adapter(model, spec.lora)
        if spec.adapter is not None:  # the served model's adapter, exactly (a fresh one is random)
            apply_trainable_state(model, load_safetensors(spec.adapter))
        inner = model.get_base_model() if spec.lora is not None else model
        layers = getattr(inner.get_decoder(), "layers", None)
        if not isinstance(layers, nn.ModuleList):
            raise ValueError(f"{type(inner).__name__}: no decoder `layers` to shard (FSDP2 shards per layer)")
        for layer in layers:
            fully_shard(layer)
        self.root = fully_shard(LogprobForward(model))
        for module in self.root.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)  # sum, not mean: each rank's loss is its share of L
                module.set_force_sum_reduction_for_comms(True)  # (gloo has no PREMUL_SUM)
        self.model = model
        self.names = trainable_names(self.root)  # ("model." + the name in `model`)
        self.trainer = Trainer(
            model,
            spec.pad_id,
            logprobs=lambda mb, chunk, with_entropy: self.root(mb, chunk, with_entropy),
            micro_batches=partial(rank_micro_batches, ranks=spec.ranks, rank=spec.rank),
            across=AcrossRanks(self.device if spec.backend == "nccl" else torch.device("cpu")),
            roll_back=False,  # (a rank that fails stops them all: TrainerRanksError, nothing to roll back)
        )
        if spec.optimizer_file is not None:
            self._load_optimizer(spec.optimizer_file)

    def step(self, rows: list[Row], config: TrainConfig) -> dict[str, Any]:
        batch = TrainingBatch(rows=rows)
        metrics = self.trainer.step(batch, config)
        mine = {
            i: (lp, batch.before_update[i]) for i, lp in enumerate(batch.trainer_logprobs) if lp
        }  # this rank's rows
        return {"metrics": metrics, "logprobs": mine, "weights": self._trained_weights()}

    def sft(self, steps: list[list[Row]], config: SFTConfig) -> dict[str, Any]:
        return {"metrics": self.trainer.sft(steps, config), "weights": self._trained_weights()}

    def _trained_weights(self) -> bytes | None:
        """Every trained parameter whole (a collective: all ranks), as safetensors bytes on rank 0. Only rank 0
        keeps the gathered tensors (with full fine-tuning, a whole copy of the model in CPU memory)."""
        from safetensors.torch import save

        state = {}
        for name, p in self.model.named_parameters():
            if p.requires_grad:
                whole = p.full_tensor() if hasattr(p, "full_tensor") else p  # (every rank joins the gather)
                if self.spec.rank == 0:
                    state[name] = whole.detach().to("cpu").contiguous()
                del whole
        return save(state) if self.spec.rank == 0 else None

    def save_optimizer(self, path: str) -> str | None:
        """The full (unsharded) optimizer state, written by rank 0 in one process's format. A file it cannot
        write (a full disk) is the reply, not a failure: nothing is half done, and the save can be retried."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_optimizer_state_dict(self.root, self.trainer.optimizer, options=options)
        if self.spec.rank == 0:
            try:
                torch.save(optimizer_state_by_index(state, self.names), path)
            except (OSError, RuntimeError) as exc:  # (torch.save reports some write errors as RuntimeError)
                return f"{type(exc).__name__}: {exc}"
        return None

    def _load_optimizer(self, path: str) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        state: dict[str, Any] = {}
        if self.spec.rank == 0:  # weights_only: a checkpoint is data, never code
            saved = torch.load(path, map_location="cpu", weights_only=True)
            state = optimizer_state_by_name(saved, self.names)
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_optimizer_state_dict(self.root, self.trainer.optimizer, state, options=options)


def apply_trainable_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy `state` (name -> whole tensor) into the model's trained parameters; its names must be exactly
    those parameters'."""
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    if state.keys() != params.keys():
        extra, missing = sorted(state.keys() - params.keys()), sorted(params.keys() - state.keys())
        raise ValueError(
            f"trained weights do not fit the model: unexpected {extra[:3]}, missing {missing[:3]}"
        )
    with torch.no_grad():
        for name, tensor in state.items():
            params[name].copy_(tensor)


def serve(inbox: Connection, outbox: Connection) -> None:
    """Start from the spec, then answer commands until `close` (or the main process is gone: EOF)."""
    spec: RankSpec = inbox.recv()
    torch.set_num_threads(spec.threads)
    try:
        rank = Rank(spec)
    except BaseException:
        outbox.send(("error", traceback.format_exc()))
        raise
    outbox.send(("ready", None))
    commands = {"step": rank.step, "sft": rank.sft, "save_optimizer": rank.save_optimizer}
    try:
        while True:
            try:
                command, args = inbox.recv()
            except EOFError:
                return
            if command == "close":
                return
            try:
                outbox.send(("ok", commands[command](*args)))
            except Exception:  # a collective may be half done: the main process stops every rank
                outbox.send(("error", traceback.format_exc()))
                return
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    read_fd, write_fd = int(sys.argv[1]), int(sys.argv[2])
    serve(Connection(read_fd, writable=False), Connection(write_fd, readable=False))
    sys.stdout.flush()
    os._exit(0)  # (no interpreter teardown races with torch's threads)
