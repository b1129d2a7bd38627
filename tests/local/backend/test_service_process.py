"""`LocalBackend(in_process=False)`: engine, gateway and trainer in a child process, the agents in this one
(local/backend/service_process.py, local/backend/service_child.py). The same answers as in one process, streaming, the sync
client, training and its errors across the pipe, no torch on the agents' side, and a child that dies or a
parent that leaves without closing."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import openai
import pytest
from tolerances import assert_logprobs_close

import artrl
from artrl.local.backend.service_process import ServiceProcessError

# every test here starts the service in a child process (~4 s each): the slow tier, which CI runs
pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "hello there"}]


class NotImportableThere:
    """Defined in a test module, which the service process cannot import."""


@pytest.fixture
async def child_model(tiny_model_dir: Path, tmp_path: Path):
    backend = artrl.LocalBackend(path=tmp_path / "artrl", in_process=False)
    model = artrl.TrainableModel(name="tiny", project="child", base_model=str(tiny_model_dir))
    await model.register(backend)
    yield model
    await backend.close()


async def test_answers_as_in_one_process_streams_and_trains(child_model, tiny_model_dir, tmp_path):
    model = child_model
    client = model.openai_client()
    assert type(client._client._transport).__name__ == "GatewayTransport"
    kwargs = dict(model=model.name, messages=MESSAGES, max_tokens=12, seed=7, logprobs=True)
    remote = await client.chat.completions.create(**kwargs)
    async with artrl.LocalBackend(path=tmp_path / "local") as backend:
        same = artrl.TrainableModel(name="tiny", project="here", base_model=str(tiny_model_dir))
        await same.register(backend)
        local = await same.openai_client().chat.completions.create(**{**kwargs, "model": same.name})
    assert remote.choices[0].message.content == local.choices[0].message.content
    assert_logprobs_close(  # (two processes: their kernels may sum in other orders)
        [t.logprob for t in remote.choices[0].logprobs.content],
        [t.logprob for t in local.choices[0].logprobs.content],
    )

    stream = await client.chat.completions.create(**{**kwargs, "stream": True})
    pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
    assert "".join(pieces) == remote.choices[0].message.content
    with pytest.raises(openai.NotFoundError, match="not served here"):
        await client.chat.completions.create(model="nobody", messages=MESSAGES, max_tokens=2)

    def sync_call() -> str:
        answer = model.openai_sync_client().chat.completions.create(**kwargs)
        return answer.choices[0].message.content

    assert await asyncio.to_thread(sync_call) == remote.choices[0].message.content
    over_http = openai.AsyncOpenAI(base_url=model.inference_base_url, api_key=model.inference_api_key)
    by_http = await over_http.chat.completions.create(**kwargs)
    assert by_http.choices[0].message.content == remote.choices[0].message.content
    await over_http.close()

    # 16 concurrent calls, each answered to its own caller
    answers = await asyncio.gather(
        *(client.chat.completions.create(**{**kwargs, "seed": s, "logprobs": False}) for s in range(16))
    )
    alone = await client.chat.completions.create(**{**kwargs, "seed": 11, "logprobs": False})
    assert answers[11].choices[0].message.content == alone.choices[0].message.content

    groups = [
        artrl.TrajectoryGroup(
            artrl.Trajectory(messages_and_choices=[*MESSAGES, a.choices[0]], reward=float(i % 2))
            for i, a in enumerate(answers[k : k + 4])
        )
        for k in (0, 4)
    ]
    result = await model.train(groups)
    assert result.step == 1 and result.metrics["trajectories"] == 8 and result.metrics["optimizer_steps"] == 1
    assert await model.get_step() == 1
    row = await model.log(groups, split="val")
    assert row["trajectories"] == 8
    with pytest.raises(ValueError, match="split 'train' holds what"):  # raised in the child
        await model.log(groups, split="train")
    await model.export(tmp_path / "exported")
    assert (tmp_path / "exported" / "adapter_config.json").exists()
    history = (tmp_path / "artrl" / "child" / "tiny" / "history.jsonl").read_text().splitlines()
    assert [line.count('"split": "train"') for line in history].count(1) == 1


async def test_what_the_child_cannot_read_is_a_clear_error(child_model):
    model = child_model
    answer = await model.openai_client().chat.completions.create(
        model=model.name, messages=MESSAGES, max_tokens=4
    )
    trajectory = artrl.Trajectory(
        messages_and_choices=[*MESSAGES, answer.choices[0]], reward=1.0, metadata={"x": NotImportableThere()}
    )
    with pytest.raises(RuntimeError, match="could not be read in the artrl service process"):
        await model.train(
            [artrl.TrajectoryGroup([trajectory, trajectory.model_copy(update={"reward": 0.0})])]
        )
    assert await model.get_step() == 0
    assert await model.openai_client().chat.completions.create(
        model=model.name, messages=MESSAGES, max_tokens=2
    )


async def test_a_dead_service_process_fails_calls_at_once(child_model):
    model = child_model
    client = model.openai_client()
    pid = model._backend._models._proc.pid
    os.kill(pid, signal.SIGSTOP)  # (the request below is sent, and stays unanswered)
    pending = asyncio.ensure_future(
        client.with_options(max_retries=0).chat.completions.create(
            model=model.name, messages=MESSAGES, max_tokens=4
        )
    )
    await asyncio.sleep(0.5)
    assert not pending.done()
    os.kill(pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(openai.APIConnectionError):
        await asyncio.wait_for(pending, 30)
    assert time.monotonic() - started < 25  # the dead child noticed, well before the 30 s request timeout
    with pytest.raises(openai.APIConnectionError):
        await client.with_options(max_retries=0).chat.completions.create(
            model=model.name, messages=MESSAGES, max_tokens=2
        )
    with pytest.raises(ServiceProcessError, match="exited"):
        await model.log([], split="val", metrics={"x": 1.0})


def test_the_agents_process_needs_no_torch_and_the_child_ends_with_it(tiny_model_dir, tmp_path):
    script = textwrap.dedent(
        f"""
        import asyncio, os, sys
        import artrl

        async def main():
            backend = artrl.LocalBackend(path={str(tmp_path / "artrl")!r}, in_process=False)
            model = artrl.TrainableModel(name="tiny", project="p", base_model={str(tiny_model_dir)!r})
            await model.register(backend)
            client = model.openai_client()
            answers = [
                await client.chat.completions.create(
                    model=model.name, messages=[{{"role": "user", "content": "hi"}}], max_tokens=4, seed=s
                )
                for s in (1, 2)
            ]
            group = artrl.TrajectoryGroup(
                artrl.Trajectory(messages_and_choices=[{{"role": "user", "content": "hi"}}, a.choices[0]], reward=r)
                for a, r in zip(answers, (0.0, 1.0))
            )
            step = (await model.train([group])).step
            heavy = sorted(m for m in ("torch", "transformers", "artrl.local.chat_format") if m in sys.modules)
            print(",".join(heavy) or "-", step, backend._models._proc.pid, flush=True)
            os._exit(0)  # gone without closing the backend

        asyncio.run(main())
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    heavy, step, pid = done.stdout.split()
    assert heavy == "-" and step == "1"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and _running(int(pid)):
        time.sleep(0.2)
    if _running(int(pid)):
        pytest.fail(f"the service process {pid} outlived the process that started it")


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's exit is reaped by whoever adopted it, maybe later)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


STAND_IN_CHILD = """
import sys
from multiprocessing.connection import Connection

inbox, outbox = Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False)
inbox.recv_bytes()  # the settings
inbox.recv_bytes()  # a call
outbox.send_bytes(b"\\x80\\x05not a pickle")  # its answer, which the user's process cannot read
try:
    while True:  # alive (and reading) until that process closes its end
        inbox.recv_bytes()
except EOFError:
    pass
"""


class Waiting:
    """A request in flight (the in-process transport's side of it)."""

    def __init__(self) -> None:
        self.failure: str | None = None

    def abandon(self, message: str) -> None:
        self.failure = message


async def test_a_frame_this_process_cannot_read_fails_what_is_in_flight_at_once(tmp_path, monkeypatch):
    """The reader died on an unreadable frame and every call and request waited for ever."""
    from artrl.config import EngineConfig, GatewayConfig, TrainerConfig
    from artrl.local.backend import service_process
    from artrl.local.concurrency.piped_process import start_piped

    (tmp_path / "stand_in_child.py").write_text(STAND_IN_CHILD)

    def stand_in(module: str, **popen):
        env = {**popen.pop("env"), "PYTHONPATH": str(tmp_path)}
        return start_piped("stand_in_child", env=env, **popen)

    monkeypatch.setattr(service_process, "start_piped", stand_in)
    process = service_process.ServiceProcess(str(tmp_path), EngineConfig(), GatewayConfig(), TrainerConfig())
    try:
        request = Waiting()
        assert process.add_exchange(request) is not None
        started = time.monotonic()
        with pytest.raises(ServiceProcessError, match="could not read what the artrl service process sent"):
            await asyncio.wait_for(process.call("log"), 20)
        assert time.monotonic() - started < 10
        assert request.failure is not None and "UnpicklingError" in request.failure
        assert process._proc.wait(20) == 0, "the child was stopped (its pipe closed)"
        with pytest.raises(ServiceProcessError, match="could not read"):  # and everything asked later
            await process.call("log")
        await asyncio.wait_for(process.close(), 30)
    finally:
        if process._proc.poll() is None:
            process._proc.kill()


async def test_a_frame_the_child_cannot_read_ends_it_and_fails_what_is_in_flight(tmp_path, capfd):
    """The child's reader died on an unreadable frame: the child never ended, its calls never answered."""
    from artrl.config import EngineConfig, GatewayConfig, TrainerConfig
    from artrl.local.backend.service_process import ServiceProcess

    process = ServiceProcess(str(tmp_path), EngineConfig(), GatewayConfig(), TrainerConfig())
    try:
        with process._send_lock:
            process._out.send_bytes(b"\x80\x05not a pickle")
        with pytest.raises(ServiceProcessError, match=r"exited \(exit code 0"):
            await asyncio.wait_for(process.call("log"), 60)
        assert "could not be read: the artrl service process ends" in capfd.readouterr().err
        await asyncio.wait_for(process.close(), 30)
    finally:
        if process._proc.poll() is None:
            process._proc.kill()
