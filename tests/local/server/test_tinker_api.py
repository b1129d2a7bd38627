"""The Tinker API on `artrl server`, driven by the unmodified `tinker` SDK (pinned in pyproject's `tinker`
extra): a LoRA training client on the server's base, a supervised loop (forward_backward with cross_entropy,
optim_step) whose loss falls, forward that changes nothing, and refusals in the SDK's own error types."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_training_server import start_server

pytestmark = pytest.mark.slow  # (a server process; ~20 s)

KEY = "tml-alice-0123456789abcdef"


@pytest.fixture(scope="module")
def tinker_server(tiny_model_dir, tmp_path_factory):
    from artrl.local.engine.vllm.server import free_port

    folder = tmp_path_factory.mktemp("tinker")
    (folder / "keys").write_text(f"alice {KEY}\n")
    port = free_port()
    process = start_server(tiny_model_dir, folder, port, folder / "keys")
    yield f"http://127.0.0.1:{port}"
    process.terminate()
    process.wait(60)


def training_client(tinker, url: str, base: Path):
    """A rank-8 LoRA training client of the server's base, for the tenant's key."""
    service = tinker.ServiceClient(base_url=url, api_key=KEY)
    return service.create_lora_training_client(base_model=str(base), rank=8).result()


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


def test_a_supervised_loop_through_the_sdk_lowers_the_loss(tinker_server, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    import tinker

    service = tinker.ServiceClient(base_url=tinker_server, api_key=KEY)
    training = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=8).result()
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


def test_refusals_come_back_as_the_sdks_errors(tinker_server, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    import tinker

    wrong = tinker.ServiceClient(base_url=tinker_server, api_key="tml-not-a-tenant-key-000")
    with pytest.raises(tinker.AuthenticationError):
        wrong.create_lora_training_client(base_model=str(tiny_model_dir), rank=8).result()
    service = tinker.ServiceClient(base_url=tinker_server, api_key=KEY)
    with pytest.raises(tinker.RequestFailedError, match="trains LoRA adapters of"):
        service.create_lora_training_client(base_model="Qwen/Qwen3-4B", rank=8).result()
    training = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=8).result()
    datum, _ = sentence_datum(tinker, training.get_tokenizer())
    with pytest.raises(tinker.RequestFailedError, match="dro"):
        training.forward_backward([datum], "dro").result()


def test_save_state_then_load_state_resumes_bit_for_bit(tinker_server, tiny_model_dir, monkeypatch):
    """A step from a saved state, then the state loaded back (with its optimizer) and the same step again:
    the same loss after it, exactly; the weights alone (load_state) give the saved state's loss back."""
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    import tinker

    training = training_client(tinker, tinker_server, tiny_model_dir)
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
    with pytest.raises(tinker.BadRequestError, match="checkpoint path"):
        training.load_state("tinker://elsewhere/weights").result()


def test_a_custom_loss_trains_through_cross_entropy(tinker_server, tiny_model_dir, monkeypatch):
    """forward_backward_custom runs the loss on the client and sends its gradients as cross_entropy weights:
    the negative log-likelihood as a custom loss falls as cross_entropy does."""
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    import tinker

    training = training_client(tinker, tinker_server, tiny_model_dir)
    datum, _ = sentence_datum(tinker, training.get_tokenizer())

    def nll(data, logprobs):
        loss = -sum(lp.sum() for lp in logprobs)
        return loss, {"nll": float(loss.detach())}

    before = training.forward([datum], "cross_entropy").result().metrics["loss:sum"]
    for _ in range(3):
        training.forward_backward_custom([datum], nll).result()
        training.optim_step(tinker.types.AdamParams(learning_rate=2e-2)).result()
    assert training.forward([datum], "cross_entropy").result().metrics["loss:sum"] < before


def test_an_rl_loop_through_the_sdk_samples_the_weights_it_trains(tinker_server, tiny_model_dir, monkeypatch):
    """The cookbook's RL loop's calls: save_weights_and_get_sampling_client, sample 8 continuations (the SDK's
    protobuf answer, a sampled logprob per token), importance_sampling with group-centred rewards (the share
    of sampled tokens in the lower half of the vocabulary) as advantages, optim_step; the next sampling
    client samples the trained weights (the same seed draws other tokens), and compute_logprobs answers.
    (That the reward rises is left to a model that has something to learn from: the tiny test model is
    untrained, about uniform over its 2,048 tokens.)"""
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    import numpy as np
    import tinker
    from tinker import types

    training = training_client(tinker, tinker_server, tiny_model_dir)
    prompt = training.get_tokenizer().encode("Count with me: one, two, three,")
    params = types.SamplingParams(max_tokens=6, temperature=1.0, stop=[], seed=7)
    samples = []
    for _ in range(3):
        sampler = training.save_weights_and_get_sampling_client().result()
        sequences = (
            sampler.sample(types.ModelInput.from_ints(prompt), num_samples=8, sampling_params=params)
            .result()
            .sequences
        )
        assert all(len(s.tokens) == 6 and len(s.logprobs) == 6 for s in sequences)
        samples.append([list(s.tokens) for s in sequences])
        reward = np.array([np.mean(np.asarray(s.tokens) < 1024) for s in sequences])
        data = []
        for seq, advantage in zip(sequences, reward - reward.mean(), strict=True):
            tokens = [*prompt, *seq.tokens]
            before = len(prompt) - 1
            data.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={
                        "target_tokens": np.asarray(tokens[1:], np.int64),
                        "logprobs": np.asarray([0.0] * before + list(seq.logprobs), np.float32),
                        "advantages": np.asarray([0.0] * before + [advantage] * len(seq.tokens), np.float32),
                    },
                )
            )
        training.forward_backward(data, "importance_sampling").result()
        training.optim_step(types.AdamParams(learning_rate=1e-1)).result()
    assert samples[-1] != samples[0]  # (one seed: other weights, other draws)
    logprobs = sampler.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
    assert logprobs[0] is None and len(logprobs) == len(prompt) and all(lp < 0 for lp in logprobs[1:])
