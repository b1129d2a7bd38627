"""The replica set's supervisor and administration (vllm_replicas.py) over fake vLLM servers on local ports:
restarts, adapter loads, sleep/wake and full-weights reloads, with replicas that die, refuse or are busy."""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
import time
from collections.abc import Callable

import pytest

from artrl.config import VLLMConfig
from artrl.local.engine.contract import EngineError
from artrl.local.engine.hf.sampling import SamplingParams
from artrl.local.engine.vllm.engine import VLLMEngine
from artrl.local.engine.vllm.replicas import Replica


class FakeVLLM:
    """A stand-in vLLM server on a local port. /health answers `health_status` after `health_delay` s;
    administrative POSTs are recorded in `loads` and answer `load_status` after `load_delay` s (or the
    connection is dropped: `drop_loads`); /v1/completions and /inference/v1/generate stream `tokens` tokens, one every `token_gap_s`
    s, for a model in `models` (None: any; else 404; a loaded adapter joins it). With `key`, every path needs
    it. `alive` plays its process. `on_health` (if set) runs in /health's handler thread instead of the
    delay; `on_first_token` runs when a stream sends its first token."""

    def __init__(self, key: str | None = None) -> None:
        self.health_status, self.health_delay = 200, 0.0
        self.load_status, self.load_delay, self.drop_loads = 200, 0.0, False
        self.tokens, self.token_gap_s, self.models = 3, 0.0, None
        self.key, self.alive, self.stopped, self.loads, self.generated = key, True, False, [], []
        self.on_health: Callable[[], None] | None = None
        self.on_first_token: Callable[[], None] | None = None
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def allowed(self) -> bool:
                if fake.key is None or self.headers.get("Authorization") == f"Bearer {fake.key}":
                    return True
                self.send_response(401)
                self.end_headers()
                return False

            def do_GET(self) -> None:
                if self.allowed():
                    fake.on_health() if fake.on_health else time.sleep(fake.health_delay)
                    self.send_response(fake.health_status)
                    self.end_headers()

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                body = json.loads(raw) if raw else {}
                if not self.allowed():
                    return
                if self.path in ("/v1/completions", "/inference/v1/generate"):  # (VLLMConfig.wire's two)
                    fake.generated.append(self.path)
                    return self.complete(body["model"], self.path == "/inference/v1/generate")
                fake.loads.append((self.path, body.get("lora_name")))
                time.sleep(fake.load_delay)
                if fake.drop_loads:
                    self.close_connection = True
                    return
                if fake.models is not None and fake.load_status == 200 and body.get("lora_name"):
                    fake.models.add(body["lora_name"])
                self.send_response(fake.load_status)
                self.end_headers()

            def complete(self, model: str, generate: bool) -> None:
                if fake.models is not None and model not in fake.models:
                    self.send_response(404)
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for i in range(fake.tokens):
                    last = i == fake.tokens - 1
                    logprobs = {"token_logprobs": [-0.5], "top_logprobs": [None]}
                    if generate:
                        logprobs = {"content": [{"token_id": 10 + i, "logprob": -0.5, "top_logprobs": []}]}
                    choice = {"index": 0, "token_ids": [10 + i], "logprobs": logprobs}
                    chunk = {"choices": [choice | {"finish_reason": "stop" if last else None}]}
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.flush()
                    if i == 0 and fake.on_first_token:
                        fake.on_first_token()
                    time.sleep(fake.token_gap_s)
                self.wfile.write(b"data: [DONE]\n\n")

            def log_message(self, *args) -> None:
                pass

        self.http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads = True
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.base_url, self.api_key, self.log_path = (
            f"http://127.0.0.1:{self.http.server_port}",
            "k",
            "fake.log",
        )

    def describe_exit(self) -> str:
        return "the fake server exited"

    def stop(self) -> None:
        self.alive, self.stopped = False, True
        self.http.shutdown()
        self.http.server_close()


async def until(condition, timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


FAST = {"health_check_interval_s": 0.05, "connect_timeout_s": 2, "request_timeout_s": 5}
SLOW = {"health_check_interval_s": 60, "connect_timeout_s": 2, "request_timeout_s": 5}  # checks on demand


def served(fakes: list[FakeVLLM], config: VLLMConfig, start=None) -> VLLMEngine:
    """An engine over `fakes`: servers artrl started (with `start`), else servers at urls."""
    owned = start is not None
    replicas = [Replica(i, f.base_url, f.api_key, f if owned else None) for i, f in enumerate(fakes)]
    return VLLMEngine(replicas, "m", "m", 2048, config, start)


async def generate(engine: VLLMEngine) -> list[int]:
    (stream,) = engine.generate([1, 2], SamplingParams(max_tokens=50), n=1)
    return [t.token_id async for t in stream]


async def test_the_supervisor_restarts_a_replica_and_loads_the_adapter_before_it_serves():
    first = [FakeVLLM(), FakeVLLM()]
    started: list[FakeVLLM] = []

    def start(index: int, weights, cancel) -> FakeVLLM:
        started.append(FakeVLLM())
        return started[-1]

    config = VLLMConfig(health_failures_before_restart=2, max_restarts=1, **FAST)
    replicas = [Replica(i, s.base_url, s.api_key, s) for i, s in enumerate(first)]
    engine = VLLMEngine(replicas, "m", "m", 2048, config, start)
    await engine.load_adapter(1, "/ckpt/0001")
    assert [s.loads for s in first] == [[("/v1/load_lora_adapter", "m@1")]] * 2
    first[0].health_status = 503  # alive, but not answering: restarted after 2 failed checks
    await until(lambda: engine.replicas[0].restarts == 1 and engine.replicas[0].state == "up")
    assert first[0].stopped and started[0].loads == [("/v1/load_lora_adapter", "m@1")]
    assert engine.replicas[0].server is started[0] and engine.replicas[0].base_url == started[0].base_url
    assert engine.replicas.eligible("m@1") == [0, 1]
    first[1].alive = False  # its process exited; restarted at once
    await until(lambda: engine.replicas[1].restarts == 1 and engine.replicas[1].state == "up")
    assert engine.replicas[1].adapters == ["m@1"]
    started[0].alive = False  # beyond max_restarts: it stays down, the other serves
    await until(lambda: engine.replicas[0].state == "failed")
    assert engine.replicas.eligible("m@1") == [1] and len(started) == 2
    await engine.close()
    assert all(s.stopped for s in started)


async def test_a_server_artrl_did_not_start_is_used_again_once_it_answers():
    fake = FakeVLLM()
    engine = VLLMEngine([Replica(0, fake.base_url, "k")], "m", "m", 2048, VLLMConfig(**FAST))
    await engine.load_adapter(3, "/ckpt/0003")
    fake.health_status = 503
    await until(lambda: engine.replicas[0].state == "down")
    assert engine.replicas.eligible("m@3") == [] and not fake.stopped  # not ours to stop or restart
    fake.loads.clear()
    fake.health_status = 200
    await until(lambda: engine.replicas[0].state == "up")
    assert fake.loads == [("/v1/load_lora_adapter", "m@3")] and engine.replicas[0].restarts == 0
    await engine.close()
    fake.stop()


def test_the_tensor_parallel_size_reaches_the_server_command(tmp_path):
    """A stand-in interpreter that exits at once: the start fails, quoting the log and its command line."""
    from artrl.local.engine.vllm.server import VLLMServer, VLLMStartError

    config = VLLMConfig(python="/bin/true", tensor_parallel_size=2)
    with pytest.raises(VLLMStartError, match="--tensor-parallel-size 2"):
        VLLMServer.start(str(tmp_path), "m", tmp_path / "vllm.log", config, max_model_len=64)
    with pytest.raises(VLLMStartError) as failure:
        VLLMServer.start(
            str(tmp_path), "m", tmp_path / "vllm.log", VLLMConfig(python="/bin/true"), max_model_len=64
        )
    assert "tensor-parallel" not in str(failure.value).splitlines()[-1]  # one device: vLLM's default, unsaid


async def test_sleeping_and_full_weight_reloads_apply_to_every_replica():
    first = [FakeVLLM(), FakeVLLM()]
    started: list[tuple[int, str | None]] = []

    def start(index: int, weights, cancel) -> FakeVLLM:
        started.append((index, weights))
        return FakeVLLM()

    config = VLLMConfig(sleep_while_training=True, **FAST)
    replicas = [Replica(i, s.base_url, s.api_key, s) for i, s in enumerate(first)]
    engine = VLLMEngine(replicas, "m", "m", 2048, config, start)
    async with engine.training():
        assert [s.loads for s in first] == [[("/sleep?level=1&mode=wait", None)]] * 2
    assert all(s.loads[-1] == ("/wake_up", None) for s in first)
    await engine.publish(1, "/ckpt/0001", adapter=False)  # full fine-tuning: every replica restarts on it
    await until(lambda: len(started) == 2 and all(r.state == "up" for r in engine.replicas.replicas))
    assert sorted(started) == [(0, "/ckpt/0001"), (1, "/ckpt/0001")] and all(s.stopped for s in first)
    assert [r.state for r in engine.replicas.replicas] == [
        "up",
        "up",
    ] and engine.replicas.weights == "/ckpt/0001"
    await engine.close()


async def test_a_replica_up_on_the_weights_a_rolling_reload_brings_is_not_taken_down():
    """The supervisor took down the replica that a rolling reload had just restarted on the new checkpoint
    when its check came before those weights were current (the test above failed 1 run in 5); a replica
    still on older weights is restarted as before."""
    started: list[tuple[int, str | None]] = []

    def start(index: int, weights, cancel) -> FakeVLLM:
        started.append((index, weights))
        return FakeVLLM()

    engine = served([FakeVLLM(), FakeVLLM()], VLLMConfig(**SLOW), start)
    replicas = engine.replicas
    fresh, old = replicas.replicas
    fresh.weights = replicas.incoming = "/ckpt/0001"  # (mid-reload: its first half up, not current)
    replicas._check(fresh)
    replicas._check(old)
    assert (fresh.state, old.state) == ("up", "up") and not started
    replicas.incoming, replicas.weights = None, "/ckpt/0001"  # (the reload ended)
    replicas._check(fresh)
    replicas._check(old)
    await until(lambda: started == [(1, "/ckpt/0001")] and old.state == "up")
    assert fresh.state == "up"
    await engine.close()


async def test_a_netrc_default_entry_does_not_break_the_requests_to_vllm(tmp_path, monkeypatch):
    """aiohttp's trust_env added ~/.netrc's credentials to every request to vLLM, and a `default` entry (it
    matches every host) clashed with the API key's Authorization header: every generation failed with
    "Cannot combine AUTHORIZATION header with AUTH argument"."""
    netrc = tmp_path / "netrc"
    netrc.write_text("default login someone password secret\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    fake = FakeVLLM(key="k")
    engine = served([fake], VLLMConfig(**SLOW))
    assert len(await generate(engine)) == fake.tokens
    await engine.close()
    fake.stop()


def test_the_environments_proxy_is_read_once_per_server_and_no_proxy_holds(monkeypatch):
    from artrl.local.engine.vllm.completions import env_proxy

    for name in ("http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    env_proxy.cache_clear()
    assert env_proxy("http://10.0.0.5:8000") == (None, None)
    env_proxy.cache_clear()
    monkeypatch.setenv("HTTP_PROXY", "http://user:pw@proxy.test:3128")
    monkeypatch.setenv("NO_PROXY", "localhost,127.0.0.1")
    proxy, auth = env_proxy("http://10.0.0.5:8000")
    assert proxy == "http://proxy.test:3128" and (auth.login, auth.password) == ("user", "pw")
    assert env_proxy("http://127.0.0.1:8000") == (None, None)
    monkeypatch.setenv("HTTP_PROXY", "http://other.test:3128")
    assert env_proxy("http://10.0.0.5:8000")[0] == "http://proxy.test:3128"  # (read once: cached)
    env_proxy.cache_clear()


# ---------------------------------------------------------------- replicas that die, refuse, or are busy
async def test_a_replica_that_died_unnoticed_does_not_fail_a_training_step():
    fakes = [FakeVLLM(), FakeVLLM()]
    engine = served(fakes, VLLMConfig(sleep_while_training=True, **SLOW))
    fakes[1].stop()  # died; the supervisor has not noticed yet
    async with engine.training():
        pass
    await engine.publish(1, "/ckpt/0001", adapter=True)
    assert engine.target == "m@1" and engine.replicas.eligible("m@1") == [0]
    fakes[0].stop()  # no replica takes the call: that is an error
    with pytest.raises(EngineError, match="no vLLM replica"):
        await engine.sleep()
    await engine.close()


async def test_the_default_wire_is_token_in_token_out_where_artrl_started_the_server():
    """VLLMConfig.wire='auto': vLLM's /inference/v1/generate on a server artrl started (it passes
    --enable-scale-out), /v1/completions on a server at a url (which may lack that flag)."""
    ours, theirs = FakeVLLM(), FakeVLLM()
    started = served([ours], VLLMConfig(**SLOW), start=lambda *_: FakeVLLM())
    at_url = served([theirs], VLLMConfig(**SLOW))
    for engine in (started, at_url):
        assert await generate(engine)
        await engine.close()
    assert ours.generated == ["/inference/v1/generate"] and theirs.generated == ["/v1/completions"]


async def test_a_full_weights_reload_rolls_while_the_other_replicas_serve():
    """Full fine-tuning restarted every replica at once (every rollout failed for the restart's minutes).
    Now half restart first, one at a time, while the others serve the old weights; then requests go to the
    new weights and the rest restart."""
    first = [FakeVLLM(), FakeVLLM()]
    starting, release, started = threading.Event(), threading.Event(), []

    def start(index: int, weights, cancel) -> FakeVLLM:
        started.append((index, weights))
        starting.set()
        assert release.wait(20)
        return FakeVLLM()

    engine = served(first, VLLMConfig(wire="generate", **FAST), start)  # (the token-in/token-out wire)
    publish = asyncio.ensure_future(engine.publish(1, "/ckpt/0001", adapter=False))
    await until(starting.is_set)
    assert started == [(0, "/ckpt/0001")] and engine.replicas.eligible("m") == [1]
    streams = engine.generate([1, 2, 3], SamplingParams(max_tokens=3), 1)  # (served meanwhile: by replica 1)
    assert [c.token_id async for c in streams[0]] and streams[0].finish_reason in ("stop", "length")
    assert first[1].generated == ["/inference/v1/generate"]
    release.set()
    await publish
    assert engine.replicas.weights == "/ckpt/0001" and engine.replicas.eligible("m") == [0]
    await until(
        lambda: started == [(0, "/ckpt/0001"), (1, "/ckpt/0001")] and engine.replicas.eligible("m") == [0, 1]
    )
    assert engine.replicas[1].restarts_in_a_row == 0  # (a planned restart, not a crash's)
    await engine.close()


async def test_a_full_weights_reload_goes_on_when_one_replica_fails_to_restart():
    first = [FakeVLLM(), FakeVLLM()]

    def start(index: int, weights, cancel) -> FakeVLLM:
        if index == 1:
            raise RuntimeError("CUDA out of memory")
        return FakeVLLM()

    engine = served(first, VLLMConfig(**SLOW), start)
    await engine.publish(1, "/ckpt/0001", adapter=False)  # one replica came up: the step is served
    await until(lambda: "CUDA out of memory" in (engine.replicas[1].down_reason or ""))
    assert [r.state for r in engine.replicas.replicas] == ["up", "down"]
    await engine.close()


async def test_no_replica_is_restarted_while_the_others_sleep_for_training():
    first, started = [FakeVLLM(), FakeVLLM()], []

    def start(index: int, weights, cancel) -> FakeVLLM:
        started.append(FakeVLLM())
        return started[-1]

    engine = served(first, VLLMConfig(sleep_while_training=True, **FAST), start)
    async with engine.training():
        first[1].alive = False
        await until(lambda: engine.replicas[1].state == "down")
        await asyncio.sleep(0.5)
        assert started == []  # it would take GPU memory from the trainer
    await until(lambda: engine.replicas[1].state == "up" and len(started) == 1)
    await engine.close()


async def test_an_adapter_load_does_not_block_the_loop_and_a_refusal_is_not_a_death():
    fakes = [FakeVLLM() for _ in range(3)]
    # the connection breaks; /health then answers 503, but only once both replicas' probes are in it at
    # once (they run concurrently) and the event loop has run meanwhile (they run off it): proven by
    # events, not by timing, so a slow or busy machine cannot fail it (a broken promise times out at 30 s)
    both_probing, probing, loop_ran = threading.Barrier(2, timeout=30), threading.Event(), threading.Event()
    proven: list[bool] = []

    def health() -> None:
        probing.set()
        try:
            both_probing.wait()
            proven.append(loop_ran.wait(30))
        except threading.BrokenBarrierError:
            proven.append(False)

    for fake in fakes[1:]:
        fake.drop_loads, fake.on_health, fake.health_status = True, health, 503
    engine = served(fakes, VLLMConfig(**SLOW))

    async def ticker() -> None:
        while True:
            if probing.is_set():
                loop_ran.set()
            await asyncio.sleep(0.02)

    task = asyncio.create_task(ticker())
    await engine.load_adapter(1, "/ckpt/0001")
    task.cancel()
    assert proven == [True, True]  # the probes ran concurrently, off the loop
    assert engine.replicas.eligible("m@1") == [0]
    await engine.close()
    # a replica that answers the load with an error is alive but lacks the adapter: it gets no request for
    # it, and the supervisor loads it again
    fakes = [FakeVLLM(), FakeVLLM()]
    fakes[1].load_status = 500
    engine = served(fakes, VLLMConfig(**FAST))
    await engine.load_adapter(1, "/ckpt/0001")
    assert engine.replicas.eligible("m@1") == [0] and engine.replicas[1].state == "up"
    fakes[1].load_status = 200
    await until(lambda: engine.replicas.eligible("m@1") == [0, 1])
    for fake in fakes:
        fake.load_status = 400
    with pytest.raises(EngineError, match="400"):  # no replica took it: the refusal, quoted
        await engine.load_adapter(2, "/ckpt/0002")
    await engine.close()


async def test_health_checks_send_the_key_and_count_only_5xx_or_no_answer():
    fake = FakeVLLM(key="k")
    engine = served([fake], VLLMConfig(health_failures_before_restart=1, **FAST))
    fake.health_status = 404  # answered (e.g. a proxy without /health): the server is there
    await asyncio.sleep(0.5)
    assert engine.replicas[0].state == "up"
    fake.health_status = 503
    await until(lambda: engine.replicas[0].state == "down")
    assert "503" in engine.replicas[0].down_reason
    await engine.close()


async def test_a_busy_server_slow_to_answer_health_is_not_taken_down_while_it_streams():
    fake = FakeVLLM()
    fake.tokens, fake.token_gap_s = 30, 0.05  # a 1.5 s stream
    # /health times out from the stream's first token on (not before it: a slow start is not streaming)
    fake.on_first_token = lambda: setattr(fake, "health_delay", 0.5)
    config = VLLMConfig(
        health_failures_before_restart=2,
        health_check_interval_s=0.05,
        connect_timeout_s=0.2,
        request_timeout_s=10,
    )
    engine = served([fake], config)
    assert len(await generate(engine)) == 30
    assert engine.replicas[0].state == "up"  # tokens kept coming: busy, not dead
    await until(lambda: engine.replicas[0].state == "down")  # no tokens, no answer: now it counts
    assert "Timeout" in engine.replicas[0].down_reason
    await engine.close()


async def test_a_replica_that_lost_an_adapter_is_skipped_and_reloaded():
    fakes = [FakeVLLM(), FakeVLLM()]
    engine = served(fakes, VLLMConfig(**SLOW))
    await engine.load_adapter(1, "/ckpt/0001")
    fakes[0].models = {"m"}  # it lost the adapter (e.g. restarted behind our back): a 404 for it
    assert await generate(engine) == [10, 11, 12]  # answered by replica 1
    await until(lambda: engine.replicas.eligible("m@1") == [0, 1])  # the supervisor loaded it again
    assert fakes[0].loads[-1] == ("/v1/load_lora_adapter", "m@1") and "m@1" in fakes[0].models
    await engine.close()


async def test_an_adapter_loaded_into_a_server_that_was_replaced_meanwhile_is_not_counted():
    first, started = [FakeVLLM(), FakeVLLM()], []

    def start(index: int, weights, cancel) -> FakeVLLM:
        started.append(FakeVLLM())
        return started[-1]

    first[0].load_delay = 1.5  # the restart (about 0.5 s) ends before this load answers
    engine = served(first, VLLMConfig(**FAST), start)
    loading = asyncio.create_task(engine.load_adapter(1, "/ckpt/0001"))
    await until(lambda: first[0].loads)
    first[0].alive = False  # its process exits while the old server is loading the adapter
    await loading
    # the new server gets the adapter: the old server's load is not taken for it
    await until(lambda: started and started[0].loads == [("/v1/load_lora_adapter", "m@1")])
    await until(lambda: engine.replicas.eligible("m@1") == [0, 1])
    await engine.close()


async def test_max_restarts_counts_restarts_in_a_row_without_serving():
    first, started = FakeVLLM(), []

    def start(index: int, weights, cancel) -> FakeVLLM:
        started.append(FakeVLLM())
        return started[-1]

    engine = served([first], VLLMConfig(max_restarts=1, **FAST), start)
    first.alive = False
    await until(lambda: engine.replicas[0].state == "up" and len(started) == 1)
    assert await generate(engine) == [10, 11, 12]  # it serves again: its restarts so far are forgiven
    await until(lambda: engine.replicas[0].restarts_in_a_row == 0)
    started[0].alive = False
    await until(lambda: engine.replicas[0].state == "up" and len(started) == 2)
    started[1].alive = False  # died again without serving: beyond max_restarts
    await until(lambda: engine.replicas[0].state == "failed")
    assert engine.replicas[0].restarts == 2 and len(started) == 2
    await engine.close()


# ---------------------------------------------------------------- event loops
async def test_the_client_of_an_event_loop_that_ended_is_dropped():
    """Sync callers run each request in its own `asyncio.run`: the engine keeps no client per ended loop."""
    fake = FakeVLLM()
    engine = served([fake], VLLMConfig(**SLOW))

    def five_loops() -> list[list[int]]:  # (asyncio.run refuses a thread whose loop runs: this one's)
        return [asyncio.run(generate(engine)) for _ in range(5)]

    assert await asyncio.to_thread(five_loops) == [[10, 11, 12]] * 5
    assert len(engine._clients) == 1  # the last loop's: ended too, dropped when a next loop asks
    assert await generate(engine) == [10, 11, 12]
    assert list(engine._clients) == [asyncio.get_running_loop()]
    await engine.close()
    fake.stop()


def test_the_key_guard_module_is_written_into_the_log_folder_once(tmp_path, monkeypatch):
    """vLLM imports artrl's key guard from the server's log folder (a relative one made absolute); a stale copy
    is replaced whole, and no temporary file stays behind."""
    from pathlib import Path

    from artrl.local.engine.vllm.server import key_guard_folder

    monkeypatch.chdir(tmp_path)
    folder = Path(key_guard_folder(Path("logs")))
    assert folder == tmp_path / "logs" / "vllm-key-guard"
    module = folder / "artrl_vllm_key_guard.py"
    assert "class KeyGuard" in module.read_text()
    written = module.stat().st_mtime_ns
    assert key_guard_folder(tmp_path / "logs") == str(folder) and module.stat().st_mtime_ns == written
    module.write_text("stale")
    key_guard_folder(tmp_path / "logs")
    assert "class KeyGuard" in module.read_text()
    assert [p.name for p in folder.iterdir()] == ["artrl_vllm_key_guard.py"]
