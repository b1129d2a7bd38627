"""The Tinker API on `artrl server`, driven by the unmodified `tinker` SDK (pinned in pyproject's `tinker`
extra): a LoRA training client on the server's base, a supervised loop (forward_backward with cross_entropy,
optim_step) whose loss falls, forward that changes nothing, and refusals in the SDK's own error types."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import pytest
from test_training_server import start_server

pytestmark = pytest.mark.slow  # (a server process; ~20 s)

KEY = "tml-alice-0123456789abcdef"
BOB = "tml-bob-0123456789abcdef00"


@pytest.fixture(scope="module")
def base_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model with its (tied) token embeddings 25x larger. The untrained tiny model's output layer is
    too small for a LoRA to move its next-token distribution far from uniform (logits within about +-1):
    here, as in a trained model, a LoRA can make a few tokens likely, so there is something to learn."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path_factory.mktemp("base") / "tiny-sharp"
    shutil.copytree(tiny_model_dir, folder)
    weights = load_file(folder / "model.safetensors")
    weights["model.embed_tokens.weight"] *= 25
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def tinker_folder(tmp_path_factory) -> Path:
    """The server's folder: its run folders under runs/{tenant}/tinker/{model}."""
    return tmp_path_factory.mktemp("tinker")


@pytest.fixture(scope="module")
def tinker_server(base_dir, tinker_folder):
    from artrl.local.engine.vllm.server import free_port

    folder = tinker_folder
    (folder / "keys").write_text(f"alice {KEY}\nbob {BOB}\n")
    port = free_port()
    process = start_server(base_dir, folder, port, folder / "keys")
    yield f"http://127.0.0.1:{port}"
    process.terminate()
    process.wait(60)


@pytest.fixture
def services(tinker_server, monkeypatch):
    """`services(api_key=KEY)`: a tinker.ServiceClient of the server, closed when the test ends (an open one's
    session heartbeat goes on failing against the stopped server, minutes after the module's tests)."""
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    import tinker

    with contextlib.ExitStack() as opened:  # (each client's own exit: its session finished, then closed)

        def service(api_key: str = KEY):
            return opened.enter_context(tinker.ServiceClient(base_url=tinker_server, api_key=api_key))

        yield service


def training_client(services, base: Path):
    """A rank-8 LoRA training client of the server's base, for the tenant's key."""
    return services().create_lora_training_client(base_model=str(base), rank=8).result()


def sentence_datum(tinker, tokenizer):
    import numpy as np

    tokens = tokenizer.encode("The capital of France is Paris, and the capital of Italy is Rome.")
    return tinker.types.Datum(
        model_input=tinker.types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": np.asarray(tokens[1:], np.int64),
            "weights": np.ones(len(tokens) - 1, np.float32),
        },
    ), len(tokens) - 1


def test_a_supervised_loop_through_the_sdk_lowers_the_loss(services, base_dir, tinker_folder, monkeypatch):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    import tinker

    service = services()
    training = service.create_lora_training_client(base_model=str(base_dir), rank=8).result()
    assert training.get_info().lora_rank == 8
    datum, n = sentence_datum(tinker, training.get_tokenizer())
    before = training.forward([datum], "cross_entropy").result()
    losses = []
    for _ in range(8):
        step = training.forward_backward([datum], "cross_entropy")
        training.optim_step(tinker.types.AdamParams(learning_rate=2e-2)).result()
        losses.append(step.result().metrics["loss:sum"])
    assert before.metrics["loss:sum"] == pytest.approx(losses[0], rel=1e-4)  # (forward trained nothing)
    assert losses[-1] < 0.93 * losses[0] and min(losses[1:]) < losses[0], losses
    logprobs = step.result().loss_fn_outputs[0]["logprobs"]
    assert len(logprobs.tolist()) == n
    # each optim_step is a history row of the training client's model: `artrl history` shows them
    from artrl.storage import read_history

    session, seq = training.model_id.removeprefix("sess-").split(":train:")
    run = tinker_folder / "runs" / "alice" / "tinker" / f"tinker-{session}-{seq}"
    rows = [r for r in read_history(run) if r["split"] == "tinker"]
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert [r["loss_sum"] for r in rows] == pytest.approx(losses, rel=1e-6)
    assert all(r["datums"] == 1 and r["tokens"] == n and r["learning_rate"] == 2e-2 for r in rows)
    shown = subprocess.run(
        [sys.executable, "-m", "artrl.cli", "history", str(run), "--split", "tinker"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "loss_sum" in shown and len([line for line in shown.splitlines() if "tinker" in line]) >= 8


def test_refusals_come_back_as_the_sdks_errors(services, base_dir, monkeypatch):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    import tinker

    wrong = services("tml-not-a-tenant-key-000")
    with pytest.raises(tinker.AuthenticationError):
        wrong.create_lora_training_client(base_model=str(base_dir), rank=8).result()
    service = services()
    with pytest.raises(tinker.RequestFailedError, match="trains LoRA adapters of"):
        service.create_lora_training_client(base_model="Qwen/Qwen3-4B", rank=8).result()
    training = service.create_lora_training_client(base_model=str(base_dir), rank=8).result()
    datum, _ = sentence_datum(tinker, training.get_tokenizer())
    with pytest.raises(tinker.RequestFailedError, match="dro"):
        training.forward_backward([datum], "dro").result()
    import numpy as np

    tokens = datum.model_input.to_ints()
    short = tinker.types.Datum(  # (one weight too few)
        model_input=datum.model_input,
        loss_fn_inputs={
            "target_tokens": datum.loss_fn_inputs["target_tokens"],
            "weights": np.ones(len(tokens) - 1),
        },
    )
    with pytest.raises(tinker.RequestFailedError, match=r"has \d+ values for \d+ input tokens"):
        training.forward_backward([short], "cross_entropy").result()
    long = tinker.types.Datum(  # (beyond the tiny model's 2,048-token context)
        model_input=tinker.types.ModelInput.from_ints(list(range(3000))),
        loss_fn_inputs={"target_tokens": np.arange(1, 3001), "weights": np.ones(3000, np.float32)},
    )
    with pytest.raises(tinker.RequestFailedError, match="context is 2048 tokens"):
        training.forward_backward([long], "cross_entropy").result()
    assert training.forward([datum], "cross_entropy").result().metrics["loss:sum"] > 0  # (still serving)


def test_save_state_then_load_state_resumes_bit_for_bit(services, base_dir, monkeypatch):
    """A step from a saved state, then the state loaded back (with its optimizer) and the same step again:
    the same loss after it, exactly; the weights alone (load_state) give the saved state's loss back."""
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    import tinker

    training = training_client(services, base_dir)
    datum, _ = sentence_datum(tinker, training.get_tokenizer())
    adam = tinker.types.AdamParams(learning_rate=2e-2)

    def step_then_loss() -> float:
        training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(adam).result()
        return training.forward([datum], "cross_entropy").result().metrics["loss:sum"]

    step_then_loss()  # (an optimizer with some state)
    saved = training.save_state("c1").result().path
    assert saved.endswith("/weights/c1")
    at_save = training.forward([datum], "cross_entropy").result().metrics["loss:sum"]
    first = step_then_loss()
    training.load_state_with_optimizer(saved).result()
    assert training.forward([datum], "cross_entropy").result().metrics["loss:sum"] == at_save
    assert step_then_loss() == first
    training.load_state(saved).result()
    assert training.forward([datum], "cross_entropy").result().metrics["loss:sum"] == at_save
    sampler = training.save_weights_for_sampler("s1").result().path
    assert sampler.endswith("/sampler_weights/s1")
    service = services()
    resumed = service.create_training_client_from_state_with_optimizer(saved).result()
    assert resumed.get_info().lora_rank == 8
    assert resumed.forward([datum], "cross_entropy").result().metrics["loss:sum"] == at_save
    training = resumed
    assert step_then_loss() == first  # (a new client from the state: the same step as the saved one's)
    weights_only = service.create_training_client_from_state(saved).result()
    assert weights_only.forward([datum], "cross_entropy").result().metrics["loss:sum"] == at_save
    with pytest.raises(tinker.BadRequestError, match="checkpoint path"):
        training.load_state("tinker://elsewhere/weights").result()


def test_a_custom_loss_trains_through_cross_entropy(services, base_dir, monkeypatch):
    """forward_backward_custom runs the loss on the client and sends its gradients as cross_entropy weights:
    the negative log-likelihood as a custom loss falls as cross_entropy does."""
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    import tinker

    training = training_client(services, base_dir)
    datum, _ = sentence_datum(tinker, training.get_tokenizer())

    def nll(data, logprobs):
        loss = -sum(lp.sum() for lp in logprobs)
        return loss, {"nll": float(loss.detach())}

    before = training.forward([datum], "cross_entropy").result().metrics["loss:sum"]
    for _ in range(3):
        training.forward_backward_custom([datum], nll).result()
        training.optim_step(tinker.types.AdamParams(learning_rate=2e-2)).result()
    assert training.forward([datum], "cross_entropy").result().metrics["loss:sum"] < before


def test_an_rl_loop_through_the_sdk_raises_the_reward(services, base_dir, monkeypatch):
    """The cookbook's RL loop's calls on a toy task: save_weights_and_get_sampling_client, sample 16 next
    tokens (the SDK's protobuf answer, each with its sampled logprob: the trainer's own), importance_sampling
    with group-centred rewards as advantages, optim_step; the next sampling client samples the trained weights,
    and the reward rises. A few supervised steps first give the model a prior (each of eight tokens next,
    equally often); the reward is 1 for four of them."""
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    import numpy as np
    from tinker import types

    training = training_client(services, base_dir)
    prompt = training.get_tokenizer().encode("Count with me: one, two, three,")
    liked, other = [101, 202, 303, 404], [505, 606, 707, 808]

    def datum(continuation, **inputs) -> types.Datum:
        tokens = [*prompt, *continuation]
        before = len(prompt) - 1
        padded = {k: np.asarray([0.0] * before + list(v), np.float32) for k, v in inputs.items()}
        return types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": np.asarray(tokens[1:], np.int64), **padded},
        )

    for _ in range(10):  # the prior: each of the eight tokens next, equally often
        sft = [datum([t], weights=[1.0]) for t in liked + other]
        training.forward_backward(sft, "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    rewards = []
    for step in range(12):
        sampler = training.save_weights_and_get_sampling_client().result()
        params = types.SamplingParams(max_tokens=1, temperature=1.0, stop=[], seed=step)
        sequences = (
            sampler.sample(types.ModelInput.from_ints(prompt), num_samples=16, sampling_params=params)
            .result()
            .sequences
        )
        assert all(len(s.tokens) == 1 and len(s.logprobs) == 1 for s in sequences)
        reward = np.array([np.mean(np.isin(s.tokens, liked)) for s in sequences])
        rewards.append(float(reward.mean()))
        data = [
            datum(s.tokens, logprobs=s.logprobs, advantages=[a])
            for s, a in zip(sequences, reward - reward.mean(), strict=True)
        ]
        if step == 0:  # the sampler's logprobs are the trainer's (the importance ratio starts at 1)
            seen = training.forward(data, "importance_sampling").result().loss_fn_outputs
            for out, sequence in zip(seen, sequences, strict=True):
                assert out["logprobs"].tolist()[-1] == pytest.approx(sequence.logprobs[0], abs=1e-4)
        training.forward_backward(data, "importance_sampling").result()
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    print(f"\nTINKER RL REWARDS: {[round(r, 2) for r in rewards]}")
    assert np.mean(rewards[-3:]) > np.mean(rewards[:3]) + 0.3, rewards  # (seen: +0.75 to +0.85)
    logprobs = sampler.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
    assert logprobs[0] is None and len(logprobs) == len(prompt) and all(lp < 0 for lp in logprobs[1:])


def test_saved_weights_and_the_base_model_sample_through_their_own_clients(
    tinker_server, base_dir, monkeypatch, services
):
    """create_sampling_client(model_path=...) samples the weights as saved, however the training client goes
    on; create_sampling_client(base_model=...) samples the base (the logprobs of an untrained LoRA)."""
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    import tinker
    from tinker import types

    service = services()
    training = training_client(services, base_dir)
    datum, _ = sentence_datum(tinker, training.get_tokenizer())
    prompt = types.ModelInput.from_ints(datum.model_input.to_ints())
    untrained = training.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    base = service.create_sampling_client(base_model=str(base_dir)).result()
    assert base.compute_logprobs(prompt).result()[1:] == pytest.approx(untrained[:-1], abs=1e-4)

    def train_once() -> None:
        training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=2e-2)).result()

    train_once()
    path = training.save_weights_for_sampler("frozen").result().path
    frozen = service.create_sampling_client(model_path=path).result()
    at_save = frozen.compute_logprobs(prompt).result()
    live_at_save = training.save_weights_and_get_sampling_client().result().compute_logprobs(prompt).result()
    assert at_save[1:] == pytest.approx(live_at_save[1:], abs=1e-4)
    assert at_save[1:] != pytest.approx(untrained[:-1], abs=1e-3)
    # the saved weights answer on the OpenAI routes by their path, frozen as the sampling client samples them
    from openai import OpenAI

    chat = OpenAI(base_url=f"{tinker_server}/v1", api_key=KEY, max_retries=0)

    def ask():
        reply = chat.chat.completions.create(
            model=path,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            temperature=0,
            logprobs=True,
        )
        extra = reply.choices[0].model_extra
        return (
            extra["prompt_token_ids"],
            extra["token_ids"],
            [t.logprob for t in reply.choices[0].logprobs.content],
        )

    asked, answered, logprobs = ask()
    scored = frozen.compute_logprobs(types.ModelInput.from_ints(asked + answered)).result()
    assert logprobs == pytest.approx(scored[len(asked) :], abs=1e-4)
    train_once()
    assert frozen.compute_logprobs(prompt).result() == at_save  # (saved weights: trained no further)
    assert ask()[1] == answered
    params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=3)
    drawn = [frozen.sample(prompt, num_samples=2, sampling_params=params).result() for _ in range(2)]
    assert [list(s.tokens) for s in drawn[0].sequences] == [list(s.tokens) for s in drawn[1].sequences]
    rest = service.create_rest_client()
    runs = rest.list_training_runs().result().training_runs
    run = rest.get_training_run(training.model_id).result()
    assert training.model_id in [r.training_run_id for r in runs] and run.lora_rank == 8
    assert run.last_sampler_checkpoint.tinker_path == path
    listed = rest.list_checkpoints(training.model_id).result().checkpoints
    assert [(c.checkpoint_id, c.checkpoint_type) for c in listed] == [("sampler_weights/frozen", "sampler")]
    assert rest.get_weights_info_by_tinker_path(path).result().lora_rank == 8
    rest.delete_checkpoint_from_tinker_path(path).result()
    assert rest.list_checkpoints(training.model_id).result().checkpoints == []
    with pytest.raises(tinker.BadRequestError, match="no checkpoint"):
        service.create_sampling_client(model_path=path).result()
    with pytest.raises(tinker.RequestFailedError, match="was deleted"):
        frozen.sample(prompt, num_samples=1, sampling_params=params).result()
    import openai

    with pytest.raises(openai.NotFoundError, match="no checkpoint"):
        chat.chat.completions.create(
            model=path.replace("frozen", "other"), messages=[{"role": "user", "content": "hi"}]
        )


def test_a_closed_session_unloads_its_training_clients(tinker_server, base_dir, monkeypatch):
    """ServiceClient.close() ends its session: its training clients are unloaded (the tenant's model limit,
    8, does not fill up over 10 sessions), their saved states stay loadable, and a call to one says why."""
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    import tinker

    for _ in range(9):
        with tinker.ServiceClient(base_url=tinker_server, api_key=BOB) as service:
            training = service.create_lora_training_client(base_model=str(base_dir), rank=8).result()
    with tinker.ServiceClient(base_url=tinker_server, api_key=BOB) as service:  # (the 10th)
        training = service.create_lora_training_client(base_model=str(base_dir), rank=8).result()
        datum, _ = sentence_datum(tinker, training.get_tokenizer())
        loss = training.forward([datum], "cross_entropy").result().metrics["loss:sum"]
        saved = training.save_state("s").result().path
    import httpx

    ended = httpx.post(  # (the closed client's own SDK objects refuse calls: a raw call to its model)
        f"{tinker_server}/api/v1/optim_step",
        json={"model_id": training.model_id, "seq_id": 99, "adam_params": {"learning_rate": 1e-3}},
        headers={"Authorization": f"Bearer {BOB}"},
        timeout=30,
    )
    assert ended.status_code == 400 and "ended with its session" in ended.json()["error"]
    with tinker.ServiceClient(base_url=tinker_server, api_key=BOB) as service:
        resumed = service.create_training_client_from_state(saved).result()
        assert resumed.forward([datum], "cross_entropy").result().metrics["loss:sum"] == loss
        runs = service.create_rest_client().list_training_runs(limit=100).result()
        assert runs.cursor.total_count == 11  # (the ended ones are listed, with their checkpoints)
