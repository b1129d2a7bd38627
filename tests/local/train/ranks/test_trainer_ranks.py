"""Training in 2 processes (TrainerConfig(ranks=2): torch.distributed on gloo, FSDP2) equals training in one:
the same loss, metrics, trainer logprobs, gradients (the optimizer's first moments) and weights, for LoRA and
for full fine-tuning; a checkpoint of either resumes in the other; a rank that dies or hangs is an error.
The failure tests and the demo are `slow` (CI runs them)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
from tolerances import assert_logprobs_close, assert_same_adamw_update, tiny_model_logprob_tolerance

import artrl
import artrl.storage
from artrl.config import EngineConfig, TrainerConfig
from artrl.local.models.loading import load_model_and_tokenizer
from artrl.local.train.adapters import attach_adapter, load_adapter
from artrl.local.train.batch import TrainingBatch
from artrl.local.train.logprobs import token_logprobs
from artrl.local.train.ranks.row_shards import rank_micro_batches, shard_rows
from artrl.local.train.ranks.trainer_rank import optimizer_state_by_index, optimizer_state_by_name
from artrl.local.train.ranks.trainer_ranks import (
    TrainerRanks,
    TrainerRanksError,
    check_fsdp2,
    missing_fsdp2_features,
    rank_devices,
)
from artrl.local.train.rows import Row
from artrl.local.train.trainer import Trainer, idle_row

LR = 1e-2
MICRO_TOKENS = 64  # every row a micro-batch of its own: 3 on one rank, 2 on the other (an idle pass)


def step_rows(seed: int) -> list[Row]:
    rng = random.Random(seed)
    rows = []
    for i in range(5):
        n, prompt = rng.randint(20, 60), rng.randint(5, 15)
        rows.append(
            Row(
                ids=[rng.randrange(2048) for _ in range(n)],
                mask=[0] * prompt + [1] * (n - prompt),
                logprobs=[float("nan")] * prompt + [rng.uniform(-8.0, -6.0) for _ in range(n - prompt)],
                trajectory=i,
                weight=0.5 if i == 4 else 1.0,
                advantage=rng.choice([1.0, -1.0]) * rng.uniform(0.5, 1.5),
            )
        )
    return rows


def test_rows_are_shared_by_tokens_and_every_rank_runs_as_many_micro_batches():
    assert shard_rows([10, 50, 30, 40], 2) == [[1, 0], [3, 2]]  # 60 and 70 tokens
    rows = step_rows(0)
    shares = [rank_micro_batches(rows, MICRO_TOKENS, 2, r) for r in range(2)]
    assert len(shares[0]) == len(shares[1]) and [] in shares[1]  # the idle pass the test below runs
    assert sorted(i for share in shares for micro in share for i in micro) == list(range(len(rows)))
    names = ["a", "b"]
    state = {"state": {"b": {"step": 1}}, "param_groups": [{"lr": 0.1, "params": ["a", "b"]}]}
    assert optimizer_state_by_index(state, names) == {
        "state": {1: {"step": 1}},
        "param_groups": [{"lr": 0.1, "params": [0, 1]}],
    }
    assert optimizer_state_by_name(optimizer_state_by_index(state, names), names) == state


def test_settings_the_ranks_cannot_honour_are_refused_before_anything_starts(tiny_model_dir):
    from artrl.config import GatewayConfig, LoadConfig
    from artrl.local.service.service import LocalService

    with pytest.raises(ValueError, match="2 devices for 3 ranks"):
        TrainerConfig(ranks=3, devices=("cuda:0", "cuda:1"))
    with pytest.raises(ValueError, match=r"QLoRA.*one process"):
        LocalService.start(
            "m",
            str(tiny_model_dir),
            EngineConfig(load=LoadConfig(quantization="4bit")),
            GatewayConfig(),
            artrl.LoraConfig(),
            trainer_config=TrainerConfig(ranks=2),
        )


def served_model(base: Path, lora: artrl.LoraConfig | None, checkpoint: Path | None = None):
    """The model as LocalService builds it: loaded, adapter attached (a seeded random init), resumed."""
    torch.manual_seed(0)
    weights = str(checkpoint) if lora is None and checkpoint is not None else None
    model, _ = load_model_and_tokenizer(str(base), EngineConfig(), weights)
    model = attach_adapter(model, lora)
    if lora is not None and checkpoint is not None:
        load_adapter(model, str(checkpoint))
    return model


def two_ranks(
    base: Path, model, lora, log_dir: Path, checkpoint: Path | None = None, **config
) -> TrainerRanks:
    return TrainerRanks(
        model, str(base), EngineConfig(), lora, TrainerConfig(ranks=2, **config), 0, checkpoint, log_dir
    )


def trained(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def assert_same_step(one: tuple, two: tuple) -> None:
    """(metrics, batch, weights) of one process and of two ranks: equal within fp32 summation order."""
    (metrics1, batch1, weights1), (metrics2, batch2, weights2) = one, two
    assert metrics1.keys() == metrics2.keys()
    for key in metrics1.keys() - {"train_seconds"}:
        assert metrics2[key] == pytest.approx(metrics1[key], rel=1e-4, abs=1e-6), key
    assert metrics1["loss"] != 0 and metrics1["grad_norm"] > 0
    assert batch2.before_update == batch1.before_update
    for row1, row2 in zip(batch1.trainer_logprobs, batch2.trainer_logprobs, strict=True):
        assert [x is None for x in row2] == [x is None for x in row1] and len(row1) > 1
        assert_logprobs_close(row2, row1)  # (the summation order's rounding: tolerances.py)
    assert_same_adamw_update(weights1, weights2, LR)


def assert_same_optimizer(path1: Path, path2: Path) -> None:
    """The full optimizer states are one format; AdamW's first moment exp_avg = (1-β1)·g after the first
    step (and a running mean of the gradients after that): equal moments are equal gradients."""
    one, two = (torch.load(p, weights_only=True) for p in (path1, path2))
    assert one["param_groups"] == two["param_groups"] and one["state"].keys() == two["state"].keys()
    for i, state in one["state"].items():
        for key, value in state.items():
            scale = float(value.abs().max()) or 1.0
            assert torch.allclose(two["state"][i][key], value, rtol=1e-4, atol=1e-5 * scale), (i, key)
    assert any(float(s["exp_avg"].abs().max()) > 0 for s in one["state"].values())


@pytest.mark.slow  # (trainer processes started four times: ~25 s)
@pytest.mark.parametrize("mode", ["lora", "full"])
def test_two_ranks_train_as_one_process_and_resume_across_rank_counts(mode, tiny_model_dir, tmp_path):
    lora = artrl.LoraConfig() if mode == "lora" else None
    # LoRA: with a KL penalty (a reference forward with the adapter off, idle passes included); full: the
    # gradient clipped (a norm over every shard) and activations checkpointed inside FSDP2's layers
    config = artrl.TrainConfig(
        learning_rate=LR,
        max_tokens_per_microbatch=MICRO_TOKENS,
        max_grad_norm=None if mode == "lora" else 0.5,
        kl_coef=0.05 if mode == "lora" else 0.0,
        gradient_checkpointing=mode == "full",
    )

    def run(trainer, model, seed: int) -> tuple:
        batch = TrainingBatch(rows=step_rows(seed))
        metrics = trainer.step(batch, config)
        if isinstance(trainer, TrainerRanks):
            trainer.load_update()
        return metrics, batch, trained(model)

    model1 = served_model(tiny_model_dir, lora)
    one = Trainer(model1, pad_id=0)
    model2 = served_model(tiny_model_dir, lora)
    ranks = two_ranks(tiny_model_dir, model2, lora, tmp_path)
    try:
        first = run(one, model1, seed=1)
        assert_same_step(first, run(ranks, model2, seed=1))
        for trainer, folder in ((one, "one"), (ranks, "two")):
            (tmp_path / folder).mkdir()
            trainer.save(str(tmp_path / folder))
        assert_same_optimizer(tmp_path / "one/optimizer.pt", tmp_path / "two/optimizer.pt")
        # each resumed run below is compared with the run whose checkpoint it loaded, continuing
        # uninterrupted: the same weights and optimizer state, so that only rounding may differ (the two
        # runs' weights differ by AdamW's amplified rounding, see assert_same_adamw_update, which a step on each
        # would carry into logprobs by more than any rounding tolerance)
        second_two = run(ranks, model2, seed=2)  # two ranks, uninterrupted
    finally:
        ranks.close()
    second = run(one, model1, seed=2)  # one process, uninterrupted
    # 2 ranks -> 1 process: the checkpoint the ranks wrote, loaded as LocalService loads it
    model3 = served_model(tiny_model_dir, lora, tmp_path / "two")
    resumed = Trainer(model3, pad_id=0)
    resumed.load(str(tmp_path / "two"))
    assert_same_step(second_two, run(resumed, model3, seed=2))
    # 1 process -> 2 ranks
    model4 = served_model(tiny_model_dir, lora, tmp_path / "one")
    ranks = two_ranks(tiny_model_dir, model4, lora, tmp_path, checkpoint=tmp_path / "one")
    try:
        assert_same_step(second, run(ranks, model4, seed=2))
        for trainer, folder in ((one, "one-2"), (ranks, "two-2")):
            (tmp_path / folder).mkdir()
            trainer.save(str(tmp_path / folder))
        assert_same_optimizer(tmp_path / "one-2/optimizer.pt", tmp_path / "two-2/optimizer.pt")
        if lora is None:  # SFT (full fine-tuning, as the demo's warm start): 2 optimizer steps
            sft = artrl.SFTConfig(learning_rate=1e-3, max_tokens_per_microbatch=MICRO_TOKENS)
            steps = [step_rows(3)[:3], step_rows(4)]
            metrics1, metrics2 = one.sft(steps, sft), ranks.sft(steps, sft)
            ranks.load_update()
            for key in metrics1.keys() - {"train_seconds"}:
                assert metrics2[key] == pytest.approx(metrics1[key], rel=1e-4), key
            assert_same_adamw_update(trained(model1), trained(model4), sft.learning_rate)
    finally:
        ranks.close()
    assert all(p.poll() is not None for p in ranks.procs)


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_a_real_divergence_exceeds_the_tolerance(mode, tiny_model_dir):
    """What the comparisons above exist to catch stays outside their rounding tolerance (tolerances.py):
    trainer logprobs of a model one step apart (a rank that missed the update, the wrong checkpoint
    loaded) differ from the rounding-only ones by far more than the tolerance, on most tokens."""
    lora = artrl.LoraConfig() if mode == "lora" else None
    model = served_model(tiny_model_dir, lora)
    trainer = Trainer(model, pad_id=0)
    config = artrl.TrainConfig(learning_rate=LR, max_tokens_per_microbatch=MICRO_TOKENS)
    before, after = TrainingBatch(rows=step_rows(1)), TrainingBatch(rows=step_rows(1))
    trainer.step(before, config)
    trainer.step(after, config)  # the same rows, one update later
    pairs = [
        (x1, x2)
        for row1, row2 in zip(before.trainer_logprobs, after.trainer_logprobs, strict=True)
        for x1, x2 in zip(row1, row2, strict=True)
        if x1 is not None
    ]
    outside = [abs(x2 - x1) > 10 * tiny_model_logprob_tolerance(x1) for x1, x2 in pairs]
    assert sum(outside) >= 0.9 * len(pairs), f"{sum(outside)} of {len(pairs)} tokens"


@pytest.mark.slow  # (trainer processes: ~8 s)
async def test_a_local_backend_trains_in_two_ranks_and_resumes_in_one(tiny_model_dir, tmp_path):
    """The wiring: rollouts through the gateway, a step on 2 ranks, the served model changes, the checkpoint
    and the step's record are complete; closing the backend stops the ranks; one process resumes the run.
    (With vLLM serving, the ranks' checkpoint is the adapter folder one process writes, hot-loaded as in
    test_vllm_engine.py: that pairing once ran here too, 80 s of CI for a path tested on both sides.)"""
    engine = "hf"
    from scored_rollouts import PROMPT, rollouts

    path = tmp_path / "artrl"
    ranks = artrl.TrainerConfig(ranks=2)
    async with artrl.LocalBackend(path=path, engine=engine, trainer=ranks) as backend:
        model = artrl.TrainableModel(name="tiny", project="ranks", base_model=str(tiny_model_dir))
        await model.register(backend)
        service = backend.service(model)
        procs = service.trainer.procs
        probe = {
            "model": model.name,
            "messages": PROMPT,
            "max_tokens": 6,
            "temperature": 0.0,
            "logprobs": True,
        }
        before_probe = (await model.openai_client().chat.completions.create(**probe)).choices[0]
        before = trained(service.model)
        config = artrl.TrainConfig(learning_rate=1e-2)
        result = await model.train([await rollouts(model, [1, 0, 0, 1])], config=config)
        assert result.step == 1 and result.metrics["optimizer_steps"] == 1 and result.metrics["rows"] == 4
        after = trained(service.model)
        assert {n for n in before if not torch.equal(before[n], after[n])} == {
            n for n in before if "lora_B" in n
        }
        after_probe = (await model.openai_client().chat.completions.create(**probe)).choices[0]
        assert after_probe.token_logprobs != pytest.approx(before_probe.token_logprobs, abs=1e-6)
        directory = backend.directory(model)
        assert {p.name for p in (directory / "checkpoints/0001").iterdir()} >= {
            "adapter_model.safetensors",
            "adapter_config.json",
            "optimizer.pt",
        }
        records = artrl.storage.read_step_rows(directory, 1)
        assert [r["trainer_logprobs"] is not None for r in records if r["trained"]] == [True] * 4
    assert all(p.poll() is not None for p in procs), "the ranks stop with the backend"
    async with artrl.LocalBackend(path=path) as backend:
        again = artrl.TrainableModel(name="tiny", project="ranks", base_model=str(tiny_model_dir))
        await again.register(backend)
        assert await again.get_step() == 1
        restored = trained(backend.service(again).model)
        assert all(torch.equal(after[n], restored[n]) for n in after)
        assert backend.service(again).trainer.optimizer.state, "optimizer state restored"
        assert (await again.train([await rollouts(again, [0, 1])], config=config)).step == 2


@pytest.mark.slow  # (starts 2 rank processes: 10-30 s on 2 cores)
def test_a_rank_that_dies_or_hangs_is_a_clear_error(tiny_model_dir, tmp_path):
    lora = artrl.LoraConfig()
    config = artrl.TrainConfig(max_tokens_per_microbatch=MICRO_TOKENS)
    ranks = two_ranks(tiny_model_dir, served_model(tiny_model_dir, lora), lora, tmp_path, call_timeout_s=3)
    try:
        os.kill(ranks.procs[1].pid, signal.SIGSTOP)  # hangs: rank 0 waits in a collective it never joins
        started = time.monotonic()
        with pytest.raises(TrainerRanksError, match=r"trainer ranks \[.*1\] did not answer within 3 s"):
            ranks.step(TrainingBatch(rows=step_rows(1)), config)
        assert time.monotonic() - started < 30
        assert all(p.poll() is not None for p in ranks.procs), "every rank is stopped"
        with pytest.raises(TrainerRanksError, match="did not answer"):  # and stays an error
            ranks.step(TrainingBatch(rows=step_rows(1)), config)
    finally:
        ranks.close()
    ranks = two_ranks(tiny_model_dir, served_model(tiny_model_dir, lora), lora, tmp_path)
    try:
        os.kill(ranks.procs[1].pid, signal.SIGKILL)
        ranks.procs[1].wait(10)
        with pytest.raises(
            TrainerRanksError, match=r"trainer rank 1 (is gone|exited) \(exit code -9\)"
        ) as error:
            ranks.step(TrainingBatch(rows=step_rows(1)), config)
        assert "Register the model again" in str(error.value) and "rank1.log" in str(error.value)
        assert all(p.poll() is not None for p in ranks.procs)
    finally:
        ranks.close()


@pytest.mark.slow  # (starts 2 rank processes: 10-30 s on 2 cores)
def test_a_rank_that_cannot_start_says_why(tiny_model_dir, tmp_path):
    model = served_model(tiny_model_dir, None)
    with pytest.raises(TrainerRanksError, match="failed during start") as error:
        TrainerRanks(
            model, str(tmp_path / "nowhere"), EngineConfig(), None, TrainerConfig(ranks=2), 0, None, tmp_path
        )
    assert "could not load base_model" in str(error.value)


@pytest.mark.slow
def test_the_demo_runs_with_two_trainer_ranks(tmp_path, demo_models):
    """The README's demo with `--trainer-ranks 2`: GRPO steps in 2 trainer processes (FSDP2 on gloo), from the
    warm start test_examples.py's learning test built. Whether 2 ranks *learn* as one process does is
    settled exactly, step by step, by test_two_ranks_train_as_one_process_and_resume_across_rank_counts (the
    same loss, logprobs, gradients and weights): a second 16-step learning run here would prove nothing
    more and cost ~3 minutes of CI, so this run checks the wiring: steps, validation, the ranks' logs."""
    import json
    import subprocess
    import sys

    out = tmp_path / "out"
    script = Path(__file__).parents[4] / "examples" / "train_agent.py"
    with demo_models(tmp_path / "artrl", "tiny"):  # (the warm start: test_examples.py's, when it ran)
        done = subprocess.run(
            [
                *(sys.executable, str(script), "--path", str(tmp_path / "artrl"), "--out", str(out)),
                *("--steps", "2", "--val-size", "8", "--eval-every", "0", "--trainer-ranks", "2"),
            ],
            capture_output=True,
            text=True,
            timeout=900,
        )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    summary = json.loads((out / "summary_seed0_ranks2.json").read_text())
    assert summary["trainer_ranks"] == 2 and len(summary["history"]) == 2
    assert [h["step"] for h in summary["history"]] == [1, 2] and "success" in summary["after"]
    (run,) = (tmp_path / "artrl" / "maze").glob("maze-seed0-*")  # the GRPO model's folder
    assert (run / "trainer-ranks" / "rank1.log").exists() and (run / "checkpoints" / "0002").is_dir()


def test_an_idle_pass_is_the_least_work_there_is(tiny_model_dir):
    """A rank with fewer micro-batches than another runs idle passes: on two tokens of the step's shortest
    row (one predicted token), not on a row of the step that may be its longest."""
    model = served_model(tiny_model_dir, artrl.LoraConfig())
    shapes: list[tuple[int, ...]] = []

    def logprobs(mb, chunk, with_entropy):
        shapes.append(tuple(mb.ids.shape))
        return token_logprobs(model, mb, chunk, with_entropy)

    rows = sorted(step_rows(1), key=lambda r: -len(r.ids))  # the longest first
    trainer = Trainer(model, pad_id=0, logprobs=logprobs, micro_batches=lambda rows, _: [[0], [1], [], []])
    trainer.step(TrainingBatch(rows=rows), artrl.TrainConfig(max_tokens_per_microbatch=MICRO_TOKENS))
    assert shapes == [(1, len(rows[0].ids)), (1, len(rows[1].ids)), (1, 2), (1, 2)]
    assert idle_row(rows).ids == min(rows, key=lambda r: len(r.ids)).ids[:2]
    shapes.clear()
    trainer.sft([rows], artrl.SFTConfig(max_tokens_per_microbatch=MICRO_TOKENS))
    assert shapes[2:] == [(1, 2), (1, 2)]


def test_a_torch_without_the_fsdp2_api_the_ranks_use_is_a_clear_error():
    from types import SimpleNamespace

    check_fsdp2()  # the torch installed has it all
    old = SimpleNamespace(
        fully_shard=lambda module: module,
        FSDPModule=SimpleNamespace(set_gradient_divide_factor=lambda factor: None),
    )
    assert missing_fsdp2_features(old) == ["FSDPModule.set_force_sum_reduction_for_comms"]
    with pytest.raises(RuntimeError, match=r"set_force_sum_reduction_for_comms missing in torch .*ranks=1"):
        check_fsdp2(old)


def test_next_to_vllm_the_main_process_copy_of_the_model_stays_on_the_cpu():
    from artrl.local.service.service import main_copy_config

    vllm = EngineConfig(kind="vllm", device="cuda:0")
    copy = main_copy_config(vllm, TrainerConfig(ranks=2), trainable=True)
    assert (copy.device, copy.dtype) == ("cpu", "bfloat16")  # (the dtype the ranks train in on the GPU)
    assert copy.vllm == vllm.vllm and copy.kind == "vllm"
    for engine, ranks, trainable in (
        (vllm, 1, True),
        (vllm, 2, False),
        (EngineConfig(device="cuda:0"), 2, True),
    ):
        assert main_copy_config(engine, TrainerConfig(ranks=ranks), trainable) is engine
    cpu = EngineConfig(kind="vllm", device="cpu")
    assert main_copy_config(cpu, TrainerConfig(ranks=2), True) is cpu
    # the ranks go where the engine is, wherever the main process's copy is
    assert rank_devices(TrainerConfig(ranks=2), torch.device("cuda")) == ["cuda:0", "cuda:1"]


class FailingEngine:
    """An engine whose close fails, around a training step that waits for `release`."""

    def __init__(self) -> None:
        self.trained = False

    @contextlib.asynccontextmanager
    async def training(self):
        yield
        self.trained = True

    async def run_exclusive(self, fn, *, changes_weights=True):
        return fn()

    async def close(self) -> None:
        raise RuntimeError("the engine would not stop")


class SlowTrainer:
    """Trainer ranks (the interface) whose step blocks until `release` is set; `run` is the real one."""

    has_adapter = True

    def run(self, call, engine):
        from artrl.local.train.ranks.trainer_ranks import TrainerRanks

        return TrainerRanks.run(self, call, engine)  # type: ignore[arg-type]

    def __init__(self) -> None:
        from artrl.local.train.progress import TrainProgress

        self.started, self.release = threading.Event(), threading.Event()
        self.closed = self.loaded = False
        self.progress = TrainProgress()

    def step(self, batch, config) -> dict[str, float]:
        self.started.set()
        assert self.release.wait(30)
        return {"loss": 1.0}

    def load_update(self) -> None:
        self.loaded = True

    def close(self) -> None:
        self.closed = True


class StoppedServer:
    def stop(self) -> None:
        pass


def fake_service(engine, trainer):
    from artrl.local.service.service import LocalService

    return LocalService(None, None, None, engine, StoppedServer(), trainer=trainer)  # type: ignore[arg-type]


async def test_a_cancelled_train_step_holds_on_until_its_thread_ends():
    """The backend's train lock must not be released while the step's thread still talks to the ranks."""
    engine, trainer = FailingEngine(), SlowTrainer()
    service = fake_service(engine, trainer)
    task = asyncio.ensure_future(service.train_step(None, None))
    assert await asyncio.to_thread(trainer.started.wait, 10)
    task.cancel()
    await asyncio.sleep(0.2)
    task.cancel()  # (again: still waits)
    await asyncio.sleep(0.2)
    assert not task.done() and not engine.trained
    trainer.release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not trainer.loaded  # (cancelled: the ranks' next update carries every trained weight)
    assert await service.train_step(None, None) == {"loss": 1.0} and trainer.loaded


async def test_a_service_whose_engine_fails_to_close_still_closes_its_trainer():
    trainer = SlowTrainer()
    with pytest.raises(RuntimeError, match="would not stop"):
        await fake_service(FailingEngine(), trainer).close()
    assert trainer.closed


@pytest.mark.slow  # (starts 2 rank processes: 10-30 s on 2 cores)
def test_calls_from_two_threads_take_turns_and_a_failed_optimizer_write_can_be_retried(
    tiny_model_dir, tmp_path
):
    lora = artrl.LoraConfig()
    config = artrl.TrainConfig(learning_rate=LR, max_tokens_per_microbatch=MICRO_TOKENS)
    ranks = two_ranks(tiny_model_dir, served_model(tiny_model_dir, lora), lora, tmp_path)
    try:
        # a cancelled train's thread still runs the first step when the next call comes in
        batches = [TrainingBatch(rows=step_rows(1) * 8), TrainingBatch(rows=step_rows(2))]
        results: dict[int, object] = {}

        def train(k: int) -> None:
            try:
                results[k] = ranks.step(batches[k], config)
            except Exception as exc:  # (shown by the assertion below)
                results[k] = exc

        threads = [threading.Thread(target=train, args=(k,)) for k in range(2)]
        threads[0].start()
        time.sleep(0.3)
        threads[1].start()
        for thread in threads:
            thread.join(120)
        assert all(isinstance(results[k], dict) for k in range(2)), results
        for batch in batches:  # each call got its own rows' logprobs
            assert [len(lp) for lp in batch.trainer_logprobs] == [len(r.ids) for r in batch.rows]
        # rank 0 cannot write optimizer.pt (as on a full disk): an OSError, and the ranks go on
        out = tmp_path / "checkpoint"
        out.mkdir()
        (out / "optimizer.pt").mkdir()
        with pytest.raises(OSError, match=r"trainer rank 0 could not write .*optimizer\.pt"):
            ranks.save(str(out))
        assert all(p.poll() is None for p in ranks.procs)
        (out / "optimizer.pt").rmdir()  # space is free again: the retry writes the checkpoint
        ranks.save(str(out))
        assert torch.load(out / "optimizer.pt", weights_only=True)["state"]
        assert ranks.step(TrainingBatch(rows=step_rows(3)), config)["optimizer_steps"] == 1
    finally:
        ranks.close()
    assert ranks.store is None


@pytest.mark.parametrize("rank", [0, 1])
def test_only_rank_0_keeps_the_gathered_weights(rank):
    """Every rank joins each parameter's gather (`full_tensor`, a collective); a rank other than 0 lets each
    gathered tensor go before the next (with full fine-tuning: never a whole copy of the model)."""
    import gc
    import weakref

    from torch import nn

    from artrl.local.train.ranks.trainer_rank import Rank

    gathered: list[weakref.ref] = []
    alive_at_each_gather: list[int] = []

    def full_tensor(size: int):
        def gather() -> torch.Tensor:
            gc.collect()
            alive_at_each_gather.append(sum(ref() is not None for ref in gathered))
            whole = torch.ones(size)
            gathered.append(weakref.ref(whole.untyped_storage()))  # (alive while any tensor uses it)
            return whole

        return gather

    model = nn.Module()
    for i in range(3):
        param = nn.Parameter(torch.zeros(4))
        param.full_tensor = full_tensor(8)  # (a stand-in for an FSDP2 DTensor shard)
        model.register_parameter(f"w{i}", param)
    fake = object.__new__(Rank)
    fake.model = model
    fake.spec = type("Spec", (), {"rank": rank})()
    weights = fake._trained_weights()
    assert len(alive_at_each_gather) == 3
    if rank == 0:
        from safetensors.torch import load

        assert alive_at_each_gather == [0, 1, 2] and load(weights)["w2"].shape == (8,)
    else:
        assert alive_at_each_gather == [0, 0, 0] and weights is None


# ---------------------------------------------------------------- the pipes' protocol, with stand-in ranks
STAND_IN_RANK = """
import os, sys, time
from multiprocessing.connection import Connection

inbox, outbox = Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False)
if os.environ["STAND_IN"] == "deaf":  # hung before reading its next command
    time.sleep(600)
inbox.recv_bytes()
outbox.send_bytes(b"not a pickle")  # a reply that cannot be read
outbox.send_bytes(__import__("pickle").dumps(("ok", "the reply of the call before")))
time.sleep(600)
"""


def stand_in_ranks(tmp_path: Path, mode: str, call_timeout_s: float = 60.0) -> TrainerRanks:
    """TrainerRanks over one stand-in rank process (STAND_IN_RANK), started as the real ones are."""
    from artrl.local.concurrency.piped_process import start_piped

    (tmp_path / "stand_in_rank.py").write_text(STAND_IN_RANK)
    ranks = object.__new__(TrainerRanks)
    ranks.config = TrainerConfig(ranks=1, call_timeout_s=call_timeout_s)
    ranks.lock, ranks.broken, ranks._senders, ranks.store = threading.Lock(), None, [], None
    ranks.logs = [tmp_path / "rank0.log"]
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "STAND_IN": mode}
    process, outbox, inbox = start_piped("stand_in_rank", stdin=subprocess.DEVNULL, env=env)
    ranks.procs, ranks.outboxes, ranks.inboxes = [process], [outbox], [inbox]
    return ranks


def in_thread(fn) -> tuple[threading.Thread, dict]:
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def test_a_rank_that_stops_reading_its_pipe_fails_the_send_within_the_deadline(tmp_path):
    """A step's rows are more than a pipe holds: the send to a rank that reads nothing blocked for ever."""
    ranks = stand_in_ranks(tmp_path, "deaf", call_timeout_s=2)
    try:
        started = time.monotonic()
        thread, outcome = in_thread(lambda: ranks._ask("step", (b"x" * 8_000_000,)))
        thread.join(30)
        assert not thread.is_alive(), "the send to a rank that does not read blocked past its deadline"
        assert isinstance(outcome.get("error"), TrainerRanksError), outcome
        assert "trainer rank 0 did not read step within 2 s (TrainerConfig.call_timeout_s)" in str(
            outcome["error"]
        )
        assert time.monotonic() - started < 15
        assert ranks.procs[0].poll() is not None, "the rank is stopped"
        with pytest.raises(TrainerRanksError, match="did not read step"):  # and stays an error
            ranks._ask("sft", ())
    finally:
        with contextlib.suppress(ProcessLookupError):
            ranks.procs[0].kill()  # (on a blocked send: its pipe breaks, and the thread ends)
        thread.join(30)
        ranks.close()


def test_a_reply_that_cannot_be_read_fails_the_ranks_instead_of_misaligning_the_next_call(tmp_path):
    ranks = stand_in_ranks(tmp_path, "garbled")
    try:
        with pytest.raises(TrainerRanksError, match=r"trainer rank 0's reply during step could not be read"):
            ranks._ask("step", ())
        assert ranks.procs[0].poll() is not None, "the rank is stopped"
        # never the previous call's late reply, which the pipe holds next
        with pytest.raises(TrainerRanksError, match="could not be read"):
            ranks._ask("step", ())
    finally:
        ranks.close()
