"""`TrainerRanks`: training in N processes (TrainerConfig(ranks=N > 1)), seen from the main process.

The main process keeps serving its own model. It starts N trainer ranks (trainer_rank.py: torch.distributed +
FSDP2), holds the TCPStore they meet at, and talks to each over a pair of pipes. A step sends every rank the
step's rows; the ranks train, rank 0 sends back the trained weights (the adapter, or every weight when
fine-tuning fully) and the main process loads them into the served model (`load_update`, on the engine's
thread). A checkpoint is written once: the weights by the main process (`save_pretrained`, as with one
process) and the full optimizer state by rank 0, in one process's format, so a run resumes with any N.

Every wait has a deadline, and a rank that exits or fails stops them all with an error that says what to do.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import subprocess
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import torch

from artrl.config import EngineConfig, LoraConfig, SFTConfig, TrainConfig, TrainerConfig
from artrl.local.concurrency.piped_process import start_piped
from artrl.local.concurrency.shielded import to_thread_to_the_end
from artrl.local.models.loading import pick_device
from artrl.local.train.adapters import save_weights
from artrl.local.train.batch import TrainingBatch
from artrl.local.train.progress import TrainProgress
from artrl.local.train.ranks.trainer_rank import RankSpec, apply_trainable_state
from artrl.local.train.rows import Row
from artrl.local.train.trainer import check_train_config

LOG_TAIL_LINES = 30


class TrainerRanksError(RuntimeError):
    """A trainer rank died, failed or did not answer in time; every rank has been stopped."""


FSDP2_FEATURES = (
    "fully_shard",
    "FSDPModule.set_gradient_divide_factor",
    "FSDPModule.set_force_sum_reduction_for_comms",
)


def missing_fsdp2_features(fsdp: Any) -> list[str]:
    """What the ranks use of `torch.distributed.fsdp` (the module, or a stand-in) and it lacks."""
    missing = []
    for feature in FSDP2_FEATURES:
        owner: Any = fsdp
        for part in feature.split("."):
            owner = getattr(owner, part, None)
        if owner is None:
            missing.append(feature)
    return missing


def check_fsdp2(fsdp: Any = None) -> None:
    """A clear error here, instead of an AttributeError in every rank, when this torch is too old."""
    if fsdp is None:
        try:
            import torch.distributed.fsdp as fsdp
        except ImportError:
            fsdp = None
    missing = missing_fsdp2_features(fsdp) if fsdp is not None else list(FSDP2_FEATURES)
    if missing:
        raise RuntimeError(
            f"TrainerConfig(ranks > 1) needs FSDP2's public API in torch.distributed.fsdp ({', '.join(missing)} "
            f"missing in torch {torch.__version__}): install a newer torch (2.13 has them all), or train in "
            "one process with TrainerConfig(ranks=1)"
        )


def rank_devices(config: TrainerConfig, engine_device: torch.device) -> list[str]:
    if config.devices is not None:
        return list(config.devices)
    return [f"cuda:{r}" if engine_device.type == "cuda" else "cpu" for r in range(config.ranks)]


class TrainerRanks:
    """The `Trainer` interface (step, sft, save, has_adapter, close) over N rank processes."""

    def __init__(
        self,
        model: Any,
        base_model: str,
        engine: EngineConfig,
        lora: LoraConfig | None,
        config: TrainerConfig,
        pad_id: int,
        resume_from: Path | None,
        log_dir: Path,
    ) -> None:
        self.progress = TrainProgress()  # (its phase: the training server streams it)
        from safetensors.torch import save

        check_fsdp2()
        self.model, self.config, self.has_adapter = model, config, lora is not None
        self.lock = threading.Lock()  # one request/replies exchange at a time on the pipes
        self.procs: list[subprocess.Popen] = []
        self.inboxes: list[Connection] = []
        self.outboxes: list[Connection] = []
        self.logs = [log_dir / "trainer-ranks" / f"rank{r}.log" for r in range(config.ranks)]
        self.broken: str | None = None
        self._senders: list[threading.Thread] = []  # sends to the ranks' pipes (see _send_within)
        self._update: bytes | None = None
        # (the engine's device, not the model's: next to vLLM the main process's copy is on the CPU)
        devices = rank_devices(config, pick_device(engine))
        backend = config.backend if config.backend != "auto" else "nccl" if "cuda" in devices[0] else "gloo"
        self.store: Any = torch.distributed.TCPStore(  # the rendezvous: a free port, held by this process
            "127.0.0.1", 0, config.ranks, is_master=True, wait_for_workers=False,
            timeout=datetime.timedelta(seconds=config.start_timeout_s),
        )  # fmt: skip
        optimizer = resume_from / "optimizer.pt" if resume_from is not None else None
        adapter = None
        if lora is not None:
            trained = {
                n: p.detach().cpu().contiguous() for n, p in model.named_parameters() if p.requires_grad
            }
            adapter = save(trained)
        threads = max(1, (os.cpu_count() or 1) // config.ranks) if backend == "gloo" else 0
        threads = threads or torch.get_num_threads()
        deadline = time.monotonic() + config.start_timeout_s
        try:
            for rank in range(config.ranks):
                self._start(rank, threads)
                self._send_spec(
                    rank,
                    deadline,
                    RankSpec(
                        rank=rank,
                        ranks=config.ranks,
                        store_port=self.store.port,
                        backend=backend,
                        device=devices[rank],
                        base_model=base_model,
                        engine=engine,
                        lora=lora,
                        weights_from=str(resume_from) if lora is None and resume_from is not None else None,
                        adapter=adapter,
                        optimizer_file=str(optimizer)
                        if optimizer is not None and optimizer.exists()
                        else None,
                        pad_id=pad_id,
                        collective_timeout_s=config.collective_timeout_s,
                        threads=threads,
                    ),
                )
            self._replies("start", config.start_timeout_s, deadline)
        except BaseException:
            self.close()
            raise

    def _start(self, rank: int, threads: int) -> None:
        self.logs[rank].parent.mkdir(parents=True, exist_ok=True)
        with open(self.logs[rank], "ab") as log:
            process, outbox, inbox = start_piped(
                "artrl.local.train.ranks.trainer_rank",
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "OMP_NUM_THREADS": str(threads)},
            )
        self.procs.append(process)
        self.outboxes.append(outbox)
        self.inboxes.append(inbox)

    def _send_spec(self, rank: int, deadline: float, spec: RankSpec) -> None:
        """The spec (the adapter in it can be more than a pipe holds), by the start's deadline."""
        self._send_within([rank], ForkingPickler.dumps(spec), deadline, "its start settings", "start")

    def _send_within(self, ranks: list[int], data: Any, deadline: float, what: str, during: str) -> None:
        """One pickled message (`Connection.send`'s bytes) to each of `ranks`, each in a thread of its own (a
        step's rows are more than a pipe holds), by `deadline`: a rank that stops reading its pipe (hung,
        stopped) or is gone fails them all, instead of blocking this call for ever."""
        failed: list[int] = []

        def send(rank: int, outbox: Connection) -> None:
            try:
                outbox.send_bytes(data)
            except BaseException:  # (a rank gone: its pipe is closed)
                failed.append(rank)

        senders = {
            rank: threading.Thread(
                target=send, args=(rank, self.outboxes[rank]), name=f"trainer-rank-{rank}-send", daemon=True
            )
            for rank in ranks
        }
        self._senders.extend(senders.values())  # (close() waits for them before closing their pipes)
        for sender in senders.values():
            sender.start()
        for rank, sender in senders.items():
            while sender.is_alive() and not failed and time.monotonic() < deadline:
                sender.join(0.2)
                if sender.is_alive() and self.procs[rank].poll() is not None:
                    break
            if failed or sender.is_alive():
                break
        suspects = sorted({*failed, *(r for r, s in senders.items() if s.is_alive())})
        # a rank that is gone first: the others' sends may be unfinished only because the wait stopped at it
        suspects.sort(key=lambda r: not (r in failed or self.procs[r].poll() is not None))
        for rank in suspects:
            if rank in failed or self.procs[rank].poll() is not None:
                self._fail(f"trainer rank {rank} is gone ({self._exit(rank)}) before {during}", rank)
            # (_fail stops the ranks: a send still blocked in a pipe then ends)
            setting = "start_timeout_s" if during == "start" else "call_timeout_s"
            self._fail(
                f"trainer rank {rank} did not read {what} within {getattr(self.config, setting):g} s "
                f"(TrainerConfig.{setting}): it is hung or stopped",
                rank,
            )
        self._senders = [s for s in self._senders if s.is_alive()]

    # ---------------------------------------------------------------- the Trainer interface
    def step(self, batch: TrainingBatch, config: TrainConfig) -> dict[str, float]:
        """One GRPO call on the ranks; their trained logprobs go into `batch`, their weights wait for
        `load_update`."""
        check_train_config(config, self.has_adapter)
        started = time.perf_counter()
        replies = self._ask("step", (batch.rows, config))
        batch.trainer_logprobs = [[] for _ in batch.rows]
        batch.before_update = [False for _ in batch.rows]
        for reply in replies:  # each rank recorded the rows it trained
            for i, (logprobs, before) in reply["logprobs"].items():
                batch.trainer_logprobs[i], batch.before_update[i] = logprobs, before
        self._update = replies[0]["weights"]
        return {**replies[0]["metrics"], "train_seconds": time.perf_counter() - started}

    def sft(self, steps: list[list[Row]], config: SFTConfig) -> dict[str, float]:
        started = time.perf_counter()
        replies = self._ask("sft", (steps, config))
        self._update = replies[0]["weights"]
        return {**replies[0]["metrics"], "train_seconds": time.perf_counter() - started}

    async def run(self, call: Callable[[TrainerRanks], dict[str, float]], engine: Any) -> dict[str, float]:
        """A training call in the ranks while the engine keeps serving the previous weights; the update is
        then loaded into the served model where nothing else touches it. Finished whole even if cancelled."""
        self.progress.phase = "training"  # (the ranks' rows are theirs: no count here)
        try:
            metrics = await to_thread_to_the_end(call, self)
            await engine.run_exclusive(self.load_update)
        finally:
            self.progress.phase = "saving"
        return metrics

    def load_update(self) -> None:
        """The weights the ranks trained into the served model (where nothing else touches it)."""
        from safetensors.torch import load

        if self._update is not None:
            update, self._update = self._update, None
            apply_trainable_state(self.model, load(update))

    def save(self, directory: str) -> None:
        """Weights (PEFT adapter or full model) by this process, the optimizer state by rank 0. A file rank 0
        cannot write (a full disk) is an OSError here and the ranks go on: the save can be tried again."""
        save_weights(self.model, directory)
        path = f"{directory}/optimizer.pt"
        error = self._ask("save_optimizer", (path,))[0]
        if error is not None:
            raise OSError(f"trainer rank 0 could not write {path}: {error}")

    # ---------------------------------------------------------------- messages and failures
    def _ask(self, command: str, args: tuple[Any, ...]) -> list[Any]:
        """Every rank's reply to `command`, sent and answered within call_timeout_s. One call at a time: a
        second caller (e.g. after a cancelled `train` whose thread still runs) waits for the first call's
        replies, never takes them. A call that does not end with every reply read (a send or a reply that
        fails, an interruption) stops the ranks: a later call would read this one's replies."""
        with self.lock:
            if self.broken is not None:
                raise TrainerRanksError(self.broken)
            deadline = time.monotonic() + self.config.call_timeout_s
            try:
                data = ForkingPickler.dumps((command, args))  # (once for every rank)
                self._send_within(list(range(len(self.outboxes))), data, deadline, command, command)
                return self._replies(command, self.config.call_timeout_s, deadline)
            except BaseException as exc:
                if self.broken is None:
                    self.close(grace_s=0.0)
                    self.broken = (
                        f"the trainer ranks' {command} was interrupted ({type(exc).__name__}: {exc}): every "
                        "trainer rank is stopped. Register the model again (a new LocalBackend) to resume from "
                        "its latest checkpoint."
                    )
                raise

    def _replies(self, what: str, timeout_s: float, deadline: float | None = None) -> list[Any]:
        """Every rank's reply (by `deadline`, else within `timeout_s`). A reply that cannot be read, or is
        not a reply, fails them all: the pipe's next bytes could be anything."""
        deadline = deadline if deadline is not None else time.monotonic() + timeout_s
        replies: dict[int, Any] = {}
        while len(replies) < len(self.procs):
            pending = [r for r in range(len(self.procs)) if r not in replies]
            for inbox in wait([self.inboxes[r] for r in pending], timeout=0.5):
                rank = self.inboxes.index(inbox)  # type: ignore[arg-type]
                try:
                    kind, value = inbox.recv()  # type: ignore[union-attr]
                except (EOFError, OSError):
                    self._fail(f"trainer rank {rank} exited ({self._exit(rank)}) during {what}", rank)
                except Exception as exc:  # (unpickling it failed, or it is no (kind, value) pair)
                    self._fail(
                        f"trainer rank {rank}'s reply during {what} could not be read ({type(exc).__name__}: "
                        f"{exc})",
                        rank,
                    )
                if kind == "error":
                    self._fail(f"trainer rank {rank} failed during {what}:\n{value}", rank)
                replies[rank] = value
            for rank in pending:
                if rank not in replies and self.procs[rank].poll() is not None:
                    self._fail(f"trainer rank {rank} exited ({self._exit(rank)}) during {what}", rank)
            if time.monotonic() > deadline:
                late = [r for r in range(len(self.procs)) if r not in replies]
                self._fail(
                    f"trainer ranks {late} did not answer within {timeout_s:.0f} s during {what}", late[0]
                )
        return [replies[r] for r in range(len(self.procs))]

    def _exit(self, rank: int) -> str:
        try:
            code = self.procs[rank].wait(5)
        except subprocess.TimeoutExpired:  # (then _fail stops it)
            return "still running"
        return f"exit code {code}"

    def _fail(self, message: str, rank: int) -> None:
        self.close(grace_s=0.0)  # (the others may wait in a collective the failed rank never joins)
        tail = "".join(_tail(self.logs[rank]))
        self.broken = (
            f"{message}\n--- the end of {self.logs[rank]} ---\n{tail}\nEvery trainer rank is stopped; the "
            "served weights are the last completed step's. Register the model again (a new LocalBackend) to "
            "resume from its latest checkpoint, with TrainerConfig(ranks=1) to train in this process."
        )
        raise TrainerRanksError(self.broken)

    def close(self, grace_s: float = 10.0) -> None:
        """Ask every rank to stop (never blocking on a rank that does not read), then kill the ones still
        running after `grace_s`."""
        if grace_s > 0:  # (in threads: a rank that does not read its pipe is killed below)
            data = ForkingPickler.dumps(("close", ()))
            for outbox in self.outboxes:
                sender = threading.Thread(target=_send_quietly, args=(outbox, data), daemon=True)
                sender.start()
                self._senders.append(sender)
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            try:
                proc.wait(max(0.01, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for sender in self._senders:  # (their ranks are gone: a blocked write ends with EPIPE)
            sender.join(5)
        self._senders = []
        for connection in [*self.inboxes, *self.outboxes]:
            connection.close()
        self.inboxes, self.outboxes = [], []
        self.store = None  # (the rendezvous port is free again)
        self.broken = self.broken or "the trainer ranks are closed"


def _send_quietly(outbox: Connection, data: Any) -> None:
    with contextlib.suppress(OSError):  # (a rank gone)
        outbox.send_bytes(data)


def _tail(path: Path) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines(keepends=True)[-LOG_TAIL_LINES:]
    except OSError:
        return []
