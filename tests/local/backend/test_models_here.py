"""`LocalBackend` in this process (local/backend/models_here.py): a model folder is used by one process (one
backend) at a time, and model.json keeps no secret."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

import artrl
from artrl.config import EngineConfig, VLLMConfig
from artrl.local.runs.run_folder import open_run
from artrl.local.runs.serve_run import engine_config_of
from artrl.storage import FolderInUseError, model_dir

HOLD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from artrl.storage import lock_model_dir

    lock = lock_model_dir(Path(sys.argv[1]))
    print("locked", flush=True)
    time.sleep(600)
    """
)
TRY = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from artrl.storage import FolderInUseError, lock_model_dir

    try:
        lock_model_dir(Path(sys.argv[1]))
    except FolderInUseError as exc:
        print(exc)
    """
)


def python(script: str, *args: str, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script, *args], text=True, **popen)


async def test_a_model_folder_is_trained_by_one_process_at_a_time(tiny_model_dir, tmp_path):
    """A script launched twice shared the folder's temporary checkpoints, deleted the other's checkpoints and
    recorded every step twice: the second register is refused, saying who holds the folder."""
    root = tmp_path / "artrl"
    folder = model_dir(root, "p", "tiny")
    model = artrl.TrainableModel(name="tiny", project="p", base_model=str(tiny_model_dir))
    holder = python(HOLD, str(folder), stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == "locked"
        backend = artrl.LocalBackend(path=root)
        with pytest.raises(
            FolderInUseError,
            match=rf"{folder} is in use by pid {holder.pid} \(started .+\); close that process or use another "
            "path/name",
        ):
            await model.register(backend)
        assert not backend.registered(model)
        holder.send_signal(signal.SIGKILL)  # gone without closing anything: the OS drops its lock
        holder.wait(30)
        await model.register(backend)
    finally:
        holder.kill()
        holder.wait(30)
    try:
        # registered here: another process is refused, and so is a second backend of this one
        tried = python(TRY, str(folder), stdout=subprocess.PIPE)
        said = tried.communicate(timeout=60)[0]
        assert f"is in use by pid {os.getpid()} (started " in said
        other = artrl.LocalBackend(path=root)
        again = artrl.TrainableModel(name="tiny", project="p", base_model=str(tiny_model_dir))
        with pytest.raises(FolderInUseError, match=rf"pid {os.getpid()} \(started .+this process"):
            await again.register(other)
        await backend.close()  # the folder is free again
        await again.register(other)
        await other.close()
    finally:
        await backend.close()


SECRETS = (
    "sk-the-vllm-key-4811",
    "hf_the-token-7730",
    "hf_an-argument-5521",
    "hf_a-replica-9931",
    "a-url-password-6620",
)


async def test_model_json_keeps_no_secret(tmp_path, monkeypatch):
    """model.json kept VLLMConfig.api_key and the server's environment (an HF token) in plain text."""
    from artrl.local.service.service import LocalService

    def no_engine(cls, *args, **kwargs):
        raise RuntimeError("no engine in this test")

    monkeypatch.setattr(LocalService, "start", classmethod(no_engine))
    vllm = VLLMConfig(
        url=("http://127.0.0.1:9", f"http://artrl:{SECRETS[4]}@127.0.0.1:10/"),
        api_key=SECRETS[0],
        env={"HF_TOKEN": SECRETS[1]},
        extra_args=("--hf-token", SECRETS[2], "--max-num-seqs=8"),
        replica_env=({"HF_TOKEN": SECRETS[3]}, {}),
    )
    backend = artrl.LocalBackend(path=tmp_path / "artrl", engine=EngineConfig(kind="vllm", vllm=vllm))
    model = artrl.TrainableModel(name="m", project="p", base_model="some/model")
    for _ in range(2):  # (a failed register leaves the folder free)
        with pytest.raises(RuntimeError, match="no engine in this test"):
            await model.register(backend)
    await backend.close()
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.name == "model.json" for p in files)
    for path in files:
        text = path.read_bytes()
        assert not [s for s in SECRETS if s.encode() in text], path
    run = open_run(backend.directory(model))  # what `artrl serve`, `export`, `merge` read still reads
    recorded = run.engine["vllm"]
    assert recorded["env"] == {"HF_TOKEN": "<redacted>"} and recorded["api_key"] == "<redacted>"
    assert list(recorded["extra_args"]) == ["--hf-token", "<redacted>", "--max-num-seqs=8"]
    assert recorded["url"] == ["http://127.0.0.1:9", "http://artrl:<redacted>@127.0.0.1:10/"]
    assert engine_config_of(run) == EngineConfig()
    # `artrl serve RUN --engine vllm` keeps the run's vLLM settings, never a `<redacted>` in place of a secret
    served = engine_config_of(run, "vllm").vllm
    assert served.api_key is None and served.env == {} and list(served.replica_env) == [{}, {}]
    assert served.extra_args == () and served.url[0] == "http://127.0.0.1:9"
