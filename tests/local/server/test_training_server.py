"""The training server and `artrl.RemoteBackend`, as two processes: `artrl server` started as a command, a
client here that registers, generates through the server's gateway, trains, logs and exports — and the
refusals: a wrong key, another tenant's model, another base, a resent training call."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import openai
import pytest

import artrl
from artrl.config import RemoteConfig

pytestmark = pytest.mark.slow  # (a server process that loads the tiny model per registered model: ~20 s)

KEY_A, KEY_B = "tenant-a-key-0123456789", "tenant-b-key-0123456789"
PROMPT = [{"role": "user", "content": "Say something."}]


def start_server(
    model_dir: Path, folder: Path, port: int, keys: Path | None = None, engine: str = "hf"
) -> subprocess.Popen:
    """`artrl server` as a process (its output in folder/server.log), once it answers /health."""
    command = [sys.executable, "-m", "artrl.cli", "server", str(model_dir), "--port", str(port)]
    command += ["--path", str(folder / "runs"), "--engine", engine, *(["--keys", str(keys)] if keys else [])]
    with (folder / "server.log").open("ab") as log:  # (a file, not a pipe: nobody reads a pipe during tests)
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
    deadline = time.monotonic() + 120
    while True:
        assert process.poll() is None, (folder / "server.log").read_text()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    from artrl.local.engine.vllm.server import free_port

    folder = tmp_path_factory.mktemp("server")
    keys = folder / "keys"
    keys.write_text(f"# tenants\nalice {KEY_A}\nbob {KEY_B}\n")
    port = free_port()
    process = start_server(tiny_model_dir, folder, port, keys)
    yield f"http://127.0.0.1:{port}", folder / "runs"
    process.terminate()
    process.wait(60)


async def scored_groups(model: artrl.TrainableModel, n: int = 2) -> list[artrl.TrajectoryGroup]:
    client = model.openai_client()
    groups = []
    for g in range(n):
        trajectories = []
        for k in range(2):
            completion = await client.chat.completions.create(
                model=model.name, messages=PROMPT, max_tokens=8, temperature=1.0, seed=10 * g + k
            )
            choice = completion.choices[0]
            assert choice.model_extra["token_ids"]  # the recorded ids travel with the choice
            trajectories.append(artrl.Trajectory(messages_and_choices=[*PROMPT, choice], reward=float(k)))
        groups.append(artrl.TrajectoryGroup(trajectories))
    return groups


async def test_a_remote_client_trains_a_model_on_the_server(server, tiny_model_dir, tmp_path):
    from pydantic import BaseModel

    class Policy(BaseModel):  # ART's typed model config: the server's model.json keeps it too
        max_turns: int = 10

    url, runs = server
    backend = artrl.RemoteBackend(url, api_key=KEY_A)
    model = artrl.TrainableModel[Policy](
        name="agent", project="remote", base_model=str(tiny_model_dir), config=Policy(max_turns=3)
    )
    await model.register(backend)
    assert await model.get_step() == 0
    recorded = json.loads((runs / "alice" / "remote" / "agent" / "model.json").read_text())
    assert recorded["config"] == {"max_turns": 3}
    result = await model.train(await scored_groups(model), artrl.TrainConfig(learning_rate=1e-3))
    assert result.step == 1 and await model.get_step() == 1
    assert (runs / "alice" / "remote" / "agent" / "checkpoints" / "0001").is_dir()  # the server's run folder
    row = await model.log(await scored_groups(model, 1), split="val")
    assert row["trajectories"] == 2
    await model.export(str(tmp_path / "exported"))
    assert (tmp_path / "exported" / "adapter_config.json").is_file()
    again = artrl.TrainableModel(name="agent", project="remote", base_model=str(tiny_model_dir))
    await again.register(artrl.RemoteBackend(url, api_key=KEY_A))  # a client that restarted: the same model
    assert await again.get_step() == 1


async def test_capture_blocks_record_calls_made_through_the_server_and_train(server, tiny_model_dir):
    """`artrl.capture` around unchanged agent calls to a remote model: the model's own client (the capture
    header) and a client given only `cap.base_url` are both recorded, with the server's token ids; the two
    turns chain into one trajectory, which trains; another tenant cannot close the capture."""
    url, _ = server
    model = artrl.TrainableModel(name="captured", project="remote", base_model=str(tiny_model_dir))
    await model.register(artrl.RemoteBackend(url, api_key=KEY_A))
    trajectories = []
    for reward in (1.0, 0.0):
        async with artrl.capture(model) as cap:
            client = model.openai_client()
            first = await client.chat.completions.create(
                model=model.name, messages=PROMPT, max_tokens=6, seed=int(reward)
            )
            messages = [*PROMPT, first.choices[0].message.model_dump(exclude_none=True)]
            plain = openai.AsyncOpenAI(base_url=cap.base_url, api_key=KEY_A, max_retries=0)
            assert [m.id for m in (await plain.models.list()).data]  # (the capture's own base URL lists too)
            await plain.chat.completions.create(
                model=model.name, messages=[*messages, {"role": "user", "content": "More."}], max_tokens=6
            )
            async with httpx.AsyncClient(headers={"Authorization": f"Bearer {KEY_B}"}, timeout=30) as http:
                assert (await http.delete(f"{url}/v1/captures/{cap.id}")).status_code == 404  # bob's reach
        assert len(cap.records) == 2
        choices = cap.trajectory.choices()
        assert len(choices) == 2 and choices[1].prompt_source == "continuation"
        assert choices[1].prompt_token_ids[: len(choices[0].prompt_token_ids)] == choices[0].prompt_token_ids
        cap.trajectory.reward = reward
        trajectories.append(cap.trajectory)
    result = await model.train([artrl.TrajectoryGroup(trajectories)])
    assert result.step == 1 and result.metrics["rows"] == 2


async def test_a_resent_training_call_trains_once(server, tiny_model_dir):
    """A client whose connection dropped mid-train sends the call again with its request id: one step."""
    url, _ = server
    model = artrl.TrainableModel(name="resend", project="remote", base_model=str(tiny_model_dir))
    await model.register(artrl.RemoteBackend(url, api_key=KEY_A))
    body = {
        "groups": [g.model_dump(mode="json") for g in await scored_groups(model)],
        "config": artrl.TrainConfig().model_dump(mode="json"),
        "request_id": uuid.uuid4().hex,
    }
    path, headers = f"{url}/artrl/v1/models/resend/train", {"Authorization": f"Bearer {KEY_A}"}
    async with httpx.AsyncClient(headers=headers) as http:
        # the first try goes away before its answer (whenever that is: before, during or after the step)
        gone = asyncio.ensure_future(http.post(path, json=body, timeout=120))
        await asyncio.sleep(0.01)
        gone.cancel()
        first = (await http.post(path, json=body, timeout=120)).json()["result"]
        second = (await http.post(path, json=body, timeout=120)).json()["result"]
    assert first == second and first["step"] == 1
    assert await model.get_step() == 1


async def test_refusals_say_what_is_wrong(server, tiny_model_dir):
    url, _ = server
    model = artrl.TrainableModel(name="agent", project="remote", base_model=str(tiny_model_dir))
    fast = RemoteConfig(retries=0)
    with pytest.raises(artrl.RemoteError, match="wrong key") as wrong:
        await model.register(artrl.RemoteBackend(url, api_key="not-a-key", config=fast))
    assert wrong.value.status == 401
    other = artrl.TrainableModel(name="agent", project="remote", base_model="Qwen/Qwen2.5-0.5B-Instruct")
    with pytest.raises(ValueError, match="trains models on"):
        await other.register(artrl.RemoteBackend(url, api_key=KEY_A))
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {KEY_B}"}, timeout=30) as http:
        chat = await http.post(f"{url}/v1/chat/completions", json={"model": "agent", "messages": PROMPT})
        step = await http.get(f"{url}/artrl/v1/models/agent/step")
        listed = (await http.get(f"{url}/artrl/v1/models")).json()["data"]
    assert chat.status_code == 404 and step.status_code == 404  # alice's model does not exist for bob
    assert [m for m in listed if m["name"] == "agent"] == []
    assert httpx.get(f"{url}/health").status_code == 200  # (the one route without a key)


async def test_two_tenants_train_concurrently(server, tiny_model_dir):
    """Each tenant's model changes only with its own steps (here: both train at once, each gets step 1)."""
    url, _ = server
    models = [
        artrl.TrainableModel(name="twin", project=p, base_model=str(tiny_model_dir)) for p in ("a", "b")
    ]
    for model, key in zip(models, (KEY_A, KEY_B), strict=True):
        await model.register(artrl.RemoteBackend(url, api_key=key))
    groups = [await scored_groups(m) for m in models]
    results = await asyncio.gather(*(m.train(g) for m, g in zip(models, groups, strict=True)))
    assert [r.step for r in results] == [1, 1]


def test_the_server_refuses_the_network_without_keys(tiny_model_dir):
    from artrl.cli import main

    assert main(["server", str(tiny_model_dir), "--host", "0.0.0.0"]) == 2


def test_a_bad_keys_file_is_a_clear_error(tmp_path: Path):
    from artrl.local.server.tenants import Tenants

    (tmp_path / "keys").write_text("alice short\n")
    with pytest.raises(ValueError, match="at least 16 characters"):
        Tenants.from_file(str(tmp_path / "keys"))


async def test_a_server_killed_mid_step_keeps_every_acknowledged_step(tiny_model_dir, tmp_path):
    """SIGKILL while a step is in flight, then a restart on the same folder: the steps whose answers went
    out are there, a resend of an answered call gets its answer again (not a new step), and training goes on."""
    from artrl.local.engine.vllm.server import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = start_server(tiny_model_dir, tmp_path, port)
    model = artrl.TrainableModel(name="durable", project="remote", base_model=str(tiny_model_dir))
    await model.register(artrl.RemoteBackend(url))
    assert (await model.train(await scored_groups(model))).step == 1
    body = {
        "groups": [g.model_dump(mode="json") for g in await scored_groups(model)],
        "config": artrl.TrainConfig().model_dump(mode="json"),
        "request_id": "answered-" + uuid.uuid4().hex[:16],
    }
    path = f"{url}/artrl/v1/models/durable/train"
    async with httpx.AsyncClient(timeout=120) as http:
        answered = (await http.post(path, json=body)).json()["result"]
        in_flight = asyncio.ensure_future(http.post(path, json={**body, "request_id": uuid.uuid4().hex}))
        await asyncio.sleep(0.05)
        process.kill()  # SIGKILL: before, during or after the third step
        process.wait(30)
        try:
            third = (await in_flight).json()["result"]["step"]  # (answered before the kill: acknowledged)
        except httpx.HTTPError:
            third = None  # (cut off: committed or not, the server decides)
    assert answered["step"] == 2
    process = start_server(tiny_model_dir, tmp_path, port)
    try:
        again = artrl.TrainableModel(name="durable", project="remote", base_model=str(tiny_model_dir))
        await again.register(artrl.RemoteBackend(url))  # the client, restarted too
        resumed = await again.get_step()
        assert resumed == 3 if third == 3 else resumed in (2, 3)  # an answered step is never lost
        async with httpx.AsyncClient(timeout=120) as http:
            assert (await http.post(path, json=body)).json()["result"] == answered
        assert (await again.train(await scored_groups(again))).step == resumed + 1
    finally:
        process.terminate()
        process.wait(60)


async def test_a_tenant_with_too_many_calls_waiting_is_refused(tmp_path):
    from artrl.config import EngineConfig, ServerConfig
    from artrl.local.server.hosted import HostedModels, OverLimit

    hosted = HostedModels(
        ServerConfig(base_model="x", path=str(tmp_path), max_queued_calls=1), EngineConfig()
    )
    release = asyncio.Event()

    async def slow() -> dict:
        await release.wait()
        return {"step": 1}

    first = asyncio.ensure_future(hosted.once("alice", "call-0001", slow))
    await asyncio.sleep(0)
    with pytest.raises(OverLimit, match="max_queued_calls"):
        await hosted.once("alice", "call-0002", slow)
    assert await hosted.once("bob", "call-0003", lambda: asyncio.sleep(0, {"step": 7})) == {"step": 7}
    release.set()
    assert await first == {"step": 1}
    assert await hosted.once("alice", "call-0001", slow) == {"step": 1}  # answered again, from disk
    with pytest.raises(ValueError, match="request_id"):
        await hosted.once("alice", "../../etc", slow)


async def test_every_tenants_model_trains_over_one_copy_of_the_base(tiny_model_dir, tmp_path):
    """Three tenants' models: one model object holding each its own LoRA adapter, one engine for all, and
    each its own trainer over its own adapter's parameters only."""
    from artrl.config import EngineConfig, ServerConfig
    from artrl.local.server.hosted import HostedModels

    hosted = HostedModels(ServerConfig(base_model=str(tiny_model_dir), path=str(tmp_path)), EngineConfig())
    try:
        spec = {"name": "m", "project": "p", "base_model": str(tiny_model_dir)}
        models = [(t, await hosted.register(t, spec)) for t in ("a", "b", "c")]
        services = [hosted.find(t, m.name)[0].service(m) for t, m in models]
        shared = hosted.shared.model
        assert all(s.model is shared and s.engine.engine is hosted.shared.engine for s in services)
        assert len(shared.peft_config) == 3
        base = [n for n, _ in shared.named_parameters() if "lora_" not in n]
        assert len(base) == 24  # the tiny model's own parameters, once
        trained = [{id(p) for p in s.trainer.parameters} for s in services]
        lora = {id(p) for n, p in shared.named_parameters() if "lora_" in n}
        assert all(trained) and set.union(*trained) == lora
        assert sum(len(t) for t in trained) == len(lora)  # (disjoint: each trains its own adapter only)
        with pytest.raises(ValueError, match="full fine-tuning"):
            await hosted.register("a", {**spec, "name": "full", "lora": None})
        # an adapter on the output head would turn the fused forward off for every tenant: refused
        head = {**spec, "name": "head", "lora": {"target_modules": ["q_proj", "lm_head"]}}
        with pytest.raises(ValueError, match="decoder's linear layers"):
            await hosted.register("a", head)
        assert len(shared.peft_config) == 3 and hosted.shared.engine._fused is not None
    finally:
        await hosted.close()


def greedy_reference(base_dir: Path, checkpoint: Path | None, prompt_ids: list[int], n: int) -> list[int]:
    """Greedy tokens of the base model with `checkpoint`'s adapter alone (None: the base model)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir)
    if checkpoint is not None:
        model = PeftModel.from_pretrained(model, str(checkpoint))
    out = model.eval().generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt_ids) :].tolist()


async def test_each_tenants_served_model_changes_only_with_its_own_steps(tiny_model_dir, tmp_path):
    """Greedy answers of three tenants' models on one base: 'a' trains a step while 'b' and 'c' sample, then
    'b' trains one, then all three train at once. Each model's answer is, token for token, the answer of the
    base with its own latest checkpoint alone (none yet: the base's), whatever the others did."""
    from artrl.local.engine.vllm.server import free_port

    keys = tmp_path / "keys"
    keys.write_text("".join(f"{t} {t}-key-0123456789abcdef\n" for t in ("a", "b", "c")))
    port = free_port()
    process = start_server(tiny_model_dir, tmp_path, port, keys)
    try:
        url, models = f"http://127.0.0.1:{port}", []
        for tenant in ("a", "b", "c"):
            model = artrl.TrainableModel(name="agent", project=tenant, base_model=str(tiny_model_dir))
            await model.register(artrl.RemoteBackend(url, api_key=f"{tenant}-key-0123456789abcdef"))
            models.append(model)

        async def greedy(model: artrl.TrainableModel) -> tuple[list[int], list[int]]:
            completion = await model.openai_client().chat.completions.create(
                model=model.name, messages=PROMPT, max_tokens=16, temperature=0.0
            )
            extra = completion.choices[0].model_extra
            return extra["prompt_token_ids"], extra["token_ids"]

        async def matches_its_checkpoint(i: int, step: int) -> list[int]:
            prompt, answer = await greedy(models[i])
            checkpoint = None
            if step:
                checkpoint = tmp_path / "runs" / "abc"[i] / "abc"[i] / "agent" / "checkpoints" / f"{step:04d}"
            reference = await asyncio.to_thread(
                greedy_reference, tiny_model_dir, checkpoint, prompt, len(answer)
            )
            assert answer == reference, f"model {'abc'[i]} at step {step}"
            return answer

        before = [await matches_its_checkpoint(i, 0) for i in range(3)]
        assert before[0] == before[1] == before[2]  # (fresh adapters: the base's own answer)
        groups = await scored_groups(models[0], 4)
        sampling = [greedy(models[i]) for i in (1, 2) for _ in range(3)]
        await asyncio.gather(models[0].train(groups, artrl.TrainConfig(learning_rate=5e-2)), *sampling)
        after_a = await matches_its_checkpoint(0, 1)
        assert after_a != before[0]
        assert [await matches_its_checkpoint(i, 0) for i in (1, 2)] == before[1:]
        await models[1].train(await scored_groups(models[1], 4), artrl.TrainConfig(learning_rate=5e-2))
        assert await matches_its_checkpoint(1, 1) != before[1]
        assert await matches_its_checkpoint(0, 1) == after_a
        assert await matches_its_checkpoint(2, 0) == before[2]
        # the three at once: steps a2, b2, c1 taking turns on the one engine, each its own
        groups = [await scored_groups(m, 4) for m in models]
        config = artrl.TrainConfig(learning_rate=5e-2)
        steps = await asyncio.gather(*(m.train(g, config) for m, g in zip(models, groups, strict=True)))
        assert [r.step for r in steps] == [2, 2, 1]
        assert all(r.metrics["queue_seconds"] >= 0 for r in steps)
        for i, step in enumerate((2, 2, 1)):
            await matches_its_checkpoint(i, step)
    finally:
        process.terminate()
        process.wait(60)


@pytest.mark.vllm
async def test_models_of_several_tenants_share_one_vllm_server(tiny_model_dir, tmp_path):
    """`--engine vllm`: two tenants' models of the same name on one vLLM server (one server log, none in the
    models' folders), each served its own adapter: one's step changes its greedy answer only."""
    from artrl.local.engine.vllm.server import free_port

    keys = tmp_path / "keys"
    keys.write_text("".join(f"{t} {t}-key-0123456789abcdef\n" for t in ("a", "b")))
    port = free_port()
    process = start_server(tiny_model_dir, tmp_path, port, keys, engine="vllm")
    try:
        url, models = f"http://127.0.0.1:{port}", []
        for tenant in ("a", "b"):
            model = artrl.TrainableModel(name="agent", project="p", base_model=str(tiny_model_dir))
            await model.register(artrl.RemoteBackend(url, api_key=f"{tenant}-key-0123456789abcdef"))
            models.append(model)

        async def greedy(model: artrl.TrainableModel) -> list[int]:
            completion = await model.openai_client().chat.completions.create(
                model=model.name, messages=PROMPT, max_tokens=16, temperature=0.0
            )
            return completion.choices[0].model_extra["token_ids"]

        before = [await greedy(m) for m in models]
        assert before[0] == before[1]
        await models[0].train(await scored_groups(models[0], 4), artrl.TrainConfig(learning_rate=5e-2))
        assert await models[0].get_step() == 1
        assert await greedy(models[1]) == before[1]
        assert await greedy(models[0]) != before[0]
        logs = sorted(p.relative_to(tmp_path / "runs") for p in (tmp_path / "runs").rglob("vllm*.log"))
        assert logs == [Path(".vllm/vllm.log")], logs  # one vLLM server for both tenants
    finally:
        process.terminate()
        process.wait(60)


def test_a_server_without_keys_answers_only_loopback_names(tiny_model_dir, tmp_path):
    """Without keys the server is loopback-only: a web page reaching it through its own DNS name (rebinding)
    sends that name as Host and is refused, and a cross-site form POST is refused before any route."""
    from artrl.local.engine.vllm.server import free_port

    port = free_port()
    process = start_server(tiny_model_dir, tmp_path, port)
    try:
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{url}/artrl/v1/models", headers={"Host": "evil.example"}).status_code == 421
        form = httpx.post(f"{url}/artrl/v1/models", content=b"name=x", headers={"content-type": "text/plain"})
        assert form.status_code == 415
        assert httpx.get(f"{url}/artrl/v1/models").json() == {"data": []}
    finally:
        process.terminate()
        process.wait(60)


async def test_an_oversized_body_is_refused_before_it_is_read_whole(tmp_path):
    from artrl.config import EngineConfig, ServerConfig
    from artrl.local.server.app import create_server_app
    from artrl.local.server.hosted import HostedModels
    from artrl.local.server.tenants import Tenants

    config = ServerConfig(base_model="x", path=str(tmp_path), max_request_bytes=1024)
    app = create_server_app(HostedModels(config, EngineConfig()), Tenants(None))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
        big = {"name": "m", "project": "p", "base_model": "x", "chat_format": "x" * 4096}
        response = await http.post("/artrl/v1/models", json=big)
        assert response.status_code == 413 and "exceeds 1024" in response.json()["error"]["message"]
        assert (
            await http.post("/artrl/v1/models", json={"name": "m"})
        ).status_code == 400  # (then: its fields)


def test_a_tenants_requests_in_flight_are_bounded():
    from artrl.local.server.app import Inflight, Refused

    inflight = Inflight(2)
    first, second = inflight.take("alice"), inflight.take("alice")
    with pytest.raises(Refused, match="max_concurrent_requests") as refused:
        inflight.take("alice")
    assert refused.value.status == 429
    inflight.take("bob")()  # (another tenant's slots are its own)
    first()
    first()  # (given back once, however often called)
    inflight.take("alice")
    with pytest.raises(Refused):
        inflight.take("alice")
    second()
