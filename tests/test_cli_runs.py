"""`artrl history`, `export`, `merge` and `serve` on real saved runs, and their answers to bad input."""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import torch
from fake_hub import FakeHub
from hub_cache import cache_model

import artrl
from artrl.cli import main
from artrl.history.tables import format_value, table
from artrl.local.engine.vllm.server import free_port

PROMPT = [{"role": "user", "content": "What is the weather in paris?"}]
GREEDY = {"messages": PROMPT, "max_tokens": 8, "temperature": 0.0}


@dataclass
class Runs:
    root: Path
    lora: Path  # 2 GRPO steps, evaluations logged after each
    full: Path  # 1 step of full fine-tuning
    greedy: list[int]  # the lora run's greedy completion at its latest step, served in-process


async def _train(model: artrl.TrainableModel, steps: int, evaluate: bool) -> None:
    client = model.openai_client()
    for step in range(steps):
        choices = [
            (
                await client.chat.completions.create(model=model.name, messages=PROMPT, max_tokens=6, seed=i)
            ).choices[0]
            for i in range(2)
        ]
        group = artrl.TrajectoryGroup(
            artrl.Trajectory(messages_and_choices=[*PROMPT, c], reward=r)
            for c, r in zip(choices, (1, 0), strict=True)
        )
        await model.train([group], config=artrl.TrainConfig(learning_rate=1e-2))
        if evaluate:
            turn = {"role": "assistant", "content": "sunny"}
            done = artrl.Trajectory(messages_and_choices=[*PROMPT, turn], reward=0.25 * (step + 1))
            await model.log([artrl.TrajectoryGroup([done])], split="val")


@pytest.fixture(scope="module")
async def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    root = tmp_path_factory.mktemp("runs")
    async with artrl.LocalBackend(path=root) as backend:
        lora = artrl.TrainableModel(name="agent", project="cli", base_model=str(tiny_model_dir))
        full = artrl.TrainableModel(name="full", project="cli", base_model=str(tiny_model_dir), lora=None)
        await lora.register(backend)
        await full.register(backend)
        await _train(lora, 2, evaluate=True)
        await _train(full, 1, evaluate=False)
        greedy = await lora.openai_client().chat.completions.create(model="agent", **GREEDY)
        return Runs(root, root / "cli" / "agent", root / "cli" / "full", greedy.choices[0].token_ids)


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


# ---------------------------------------------------------------- history
def test_history_formatting_is_pure():
    shown = " ".join(format_value(v) for v in (3, 2.0, 0.123456, 1e-7, None, True, "x"))
    assert shown == "3 2 0.1235 1e-07 - True x"
    lines = table(
        [{"step": 1, "split": "train", "loss": 0.5}, {"step": 12, "split": "val"}], ["loss"]
    ).splitlines()
    assert lines == ["step  split  loss", "----  -----  ----", "   1  train   0.5", "  12  val       -"]


async def test_history_of_a_run_and_of_a_root(runs, capsys):
    code, out, _ = cli(capsys, "history", runs.lora)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("cli/agent") and lines[1].startswith("step  split  trajectories  reward_mean")
    assert [" ".join(line.split()[:2]) for line in lines[3:]] == ["1 train", "1 val", "2 train", "2 val"]
    code, out, _ = cli(capsys, "history", runs.lora, "--split", "val", "--metrics", "reward_mean")
    assert out.splitlines()[1:] == [
        "step  split  reward_mean",
        "----  -----  -----------",
        "   1  val           0.25",
        "   2  val            0.5",
    ]
    code, out, _ = cli(capsys, "history", runs.root, "--metrics", "loss,step_seconds")
    titles = [line for line in out.splitlines() if line.startswith("cli/")]
    assert code == 0 and [t.split()[0] for t in titles] == ["cli/agent", "cli/full"]
    assert (
        cli(capsys, "history", runs.root / "cli", "--metrics", "loss")[1]
        == cli(capsys, "history", runs.root, "--metrics", "loss")[1]
    )


@pytest.mark.parametrize(
    "args, says",
    [
        (["history", "{root}/nowhere"], "does not exist"),
        (["history", "{root}/cli/agent", "--metrics", "nope"], "no metric 'nope'"),
        (["history", "{root}/cli/agent", "--split", "test"], "its splits: train, val"),
        (["export", "{root}/nowhere", "{tmp}/out"], "is not a folder"),
        (["export", "{root}", "{tmp}/out"], "not a run folder: it has no model.json (runs below it:"),
        (
            ["export", "{root}/cli/agent", "{tmp}/out", "--step", "7"],
            "no checkpoint of step 7; its checkpoints: 1, 2",
        ),
        (["export", "{root}/cli/agent", "{root}/cli/agent"], "exists and is not an empty folder"),
        (["export", "{root}/cli/agent", "{tmp}/no/such/out"], "does not exist; create it first"),
        (["merge", "{root}/cli/full", "{tmp}/out"], "nothing to merge; use `artrl export"),
        (["serve", "{root}/cli/agent", "--step", "9"], "no checkpoint of step 9"),
        (["serve", "{root}/cli/agent", "--host", "0.0.0.0"], "api_key"),
        (["serve", "{root}/cli/agent", "--api-key", "sekret"], "ps"),
        (["serve", "{root}", "--engine", "vllm"], "not a run folder: it has no model.json (runs below it:"),
        (
            ["serve", "{root}/cli/agent", "--revision", "v2"],
            "is a run folder: it is served as it was trained",
        ),
        (["serve", "org/model", "--step", "1"], "--step picks a checkpoint of a run folder"),
        (["dashboard", "{root}/nowhere"], "is not a folder"),
    ],
)
async def test_bad_input_is_one_line_and_exit_code_2(runs, tmp_path, capsys, args, says):
    code, out, err = cli(capsys, *(a.format(root=runs.root, tmp=tmp_path) for a in args))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"artrl {args[0]}: ") and says in err, err


async def test_a_run_without_checkpoints_says_to_train_first(runs, tmp_path, capsys):
    (tmp_path / "model.json").write_text((runs.lora / "model.json").read_text())
    code, _, err = cli(capsys, "export", tmp_path, tmp_path / "out")
    assert code == 2 and "has no checkpoints yet: train at least one step" in err


# ---------------------------------------------------------------- export and merge
def _adapter(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path / "adapter_model.safetensors")


async def test_export_writes_the_adapter_with_its_base_and_the_tokenizer(runs, tmp_path, capsys):
    code, out, _ = cli(capsys, "export", runs.lora, tmp_path / "latest")
    assert code == 0 and "wrote step 2 of cli/agent" in out
    files = {p.name for p in (tmp_path / "latest").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer_config.json"} <= files
    assert not files & {"optimizer.pt", "history_row.json"}
    config = json.loads((tmp_path / "latest" / "adapter_config.json").read_text())
    assert (
        config["base_model_name_or_path"] == json.loads((runs.lora / "model.json").read_text())["base_model"]
    )
    assert cli(capsys, "export", runs.lora, tmp_path / "first", "--step", "1")[0] == 0
    first, saved = _adapter(tmp_path / "first"), _adapter(runs.lora / "checkpoints" / "0001")
    assert all(torch.equal(first[k], saved[k]) for k in saved)

    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"]), tmp_path / "latest"
    )
    assert any("lora_" in n for n, _ in model.named_parameters())
    assert AutoTokenizer.from_pretrained(tmp_path / "latest").chat_template


async def test_a_run_older_than_its_tokenizer_copy_exports_the_base_tokenizer(runs, tmp_path, capsys):
    old = tmp_path / "cli" / "agent"
    shutil.copytree(runs.lora, old, ignore=shutil.ignore_patterns("tokenizer"))
    assert cli(capsys, "export", old, tmp_path / "out")[0] == 0
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(tmp_path / "out").chat_template


async def test_export_of_full_fine_tuning_is_a_full_model(runs, tmp_path, capsys):
    code, out, _ = cli(capsys, "export", runs.full, tmp_path / "full")
    assert code == 0 and "(full model + tokenizer)" in out
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "full")
    saved = AutoModelForCausalLM.from_pretrained(runs.full / "checkpoints" / "0001")
    assert all(
        torch.equal(a, b)
        for a, b in zip(exported.state_dict().values(), saved.state_dict().values(), strict=True)
    )


async def test_merge_gives_the_logits_of_base_plus_adapter_and_trains_as_a_base(runs, tmp_path, capsys):
    code, _, _ = cli(capsys, "merge", runs.lora, tmp_path / "merged")
    assert code == 0
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base_model = json.loads((runs.lora / "model.json").read_text())["base_model"]
    reference = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base_model), runs.lora / "checkpoints" / "0002"
    )
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any("lora_" in n for n in merged.state_dict())
    ids = torch.tensor([list(range(5, 45))])
    with torch.no_grad():
        want, got = reference(input_ids=ids).logits, merged(input_ids=ids).logits
        plain = AutoModelForCausalLM.from_pretrained(base_model)(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-5) and not torch.allclose(plain, want, atol=1e-5)

    async with artrl.LocalBackend(path=tmp_path / "again") as backend:
        model = artrl.TrainableModel(name="merged", project="cli", base_model=str(tmp_path / "merged"))
        await model.register(backend)
        greedy = await model.openai_client().chat.completions.create(model="merged", **GREEDY)
        assert greedy.choices[0].token_ids == runs.greedy  # the merged base serves what the run served
        await _train(model, 1, evaluate=False)


# ---------------------------------------------------------------- serve
class Lines:
    """A subprocess's stdout lines, read by a thread (a blocking readline never stalls the test)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc, self.lines, self.seen = proc, queue.Queue(), []
        threading.Thread(target=lambda: [self.lines.put(line) for line in proc.stdout], daemon=True).start()

    def until(self, prefix: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left).rstrip("\n")
            except queue.Empty:
                break
            self.seen.append(line)
            if line.startswith(prefix):
                return line[len(prefix) :].strip()
        self.proc.kill()
        raise AssertionError(
            f"no {prefix!r} line in {timeout_s} s: {self.seen}; {self.proc.stderr.read()[-2000:]}"
        )


async def test_serve_a_saved_step_to_any_openai_client_until_sigterm(runs):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "ARTRL_API_KEY": "sekret"}  # (not on the command line)
    proc = subprocess.Popen(
        [sys.executable, "-m", "artrl.cli", "serve", str(runs.lora)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        lines = Lines(proc)
        base_url = lines.until("base URL: ", timeout_s=120)
        assert lines.seen[0].startswith(
            "loading cli/agent step 2"
        )  # (before minutes of loading, on big models)
        assert lines.seen[1].startswith("serving cli/agent step 2")
        client = openai.OpenAI(base_url=base_url, api_key="sekret", timeout=60, max_retries=0)
        assert [m.id for m in client.models.list().data] == ["agent", "agent@2"]
        for name in ("agent", "agent@2"):
            response = client.chat.completions.create(model=name, **GREEDY)
            assert response.choices[0].token_ids == runs.greedy  # what training served at step 2
        with pytest.raises(openai.NotFoundError, match="artrl serve RUN_DIR --step 1"):
            client.chat.completions.create(model="agent@1", **GREEDY)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base_url, api_key="wrong", timeout=60, max_retries=0).models.list()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, proc.stderr.read()[-2000:]
        assert lines.until("stopping", timeout_s=10) == "" and "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)


def serving(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, Lines]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(
        [sys.executable, "-m", "artrl.cli", "serve", *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    return proc, Lines(proc)


def stop_serving(proc: subprocess.Popen, lines: Lines) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, proc.stderr.read()[-2000:]
    assert lines.until("stopping", timeout_s=10) == "" and "Traceback" not in proc.stderr.read()


def test_serve_a_hub_id_from_the_hub_cache_or_says_why_not(tiny_model_dir, tmp_path):
    """A hub id resolves as huggingface_hub resolves it (here: a cache, offline); --revision picks the
    snapshot; one that cannot be found is one line and exit code 2 (the model folder path is the same)."""
    env = cache_model(tiny_model_dir, "acme/tiny-chat", tmp_path / "hub", revision="v1")
    proc, lines = serving(["acme/tiny-chat", "--revision", "v1", "--name", "chat"], tmp_path, env)
    try:
        base_url = lines.until("base URL: ", timeout_s=120)
        assert lines.seen[:2] == [
            f"{verb} acme/tiny-chat as chat (hf engine)" for verb in ("loading", "serving")
        ]
        client = openai.OpenAI(base_url=base_url, api_key="x", timeout=60, max_retries=0)
        assert [m.id for m in client.models.list().data] == ["chat", "chat@0"]
        assert client.chat.completions.create(model="chat", **GREEDY).choices[0].token_ids
        stop_serving(proc, lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    missing = subprocess.run(
        [sys.executable, "-m", "artrl.cli", "serve", "acme/tiny-chat"],  # (no `main` ref: only v1 is cached)
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
    )
    assert missing.returncode == 2 and missing.stderr.startswith("artrl serve: "), missing.stderr[-2000:]
    assert missing.stderr.count("\n") == 1 and "acme/tiny-chat" in missing.stderr


@pytest.mark.vllm
async def test_serve_a_run_on_vllm(runs, tmp_path):
    proc, lines = serving([str(runs.lora), "--engine", "vllm"], tmp_path)
    try:
        base_url = lines.until("base URL: ", timeout_s=300)
        assert "vllm engine" in lines.seen[1]
        client = openai.OpenAI(base_url=base_url, api_key="x", timeout=120, max_retries=0)
        assert [m.id for m in client.models.list().data] == ["agent", "agent@2"]
        served = client.chat.completions.create(model="agent@2", **GREEDY).choices[0]
        assert served.token_ids and served.model_extra["policy_step"] == 2  # the run's step-2 adapter
        # vLLM dies under it: a request gets an error that quotes vLLM's log, not a hang, and serve goes on
        children = [
            c
            for task in Path(f"/proc/{proc.pid}/task").iterdir()
            for c in (task / "children").read_text().split()
        ]
        (watchdog,) = [int(c) for c in children if b"vllm" in Path(f"/proc/{c}/cmdline").read_bytes()]
        os.killpg(watchdog, signal.SIGKILL)  # (the watchdog leads vLLM's process group)
        with pytest.raises(openai.InternalServerError, match="vLLM server exited"):
            client.chat.completions.create(model="agent", **GREEDY)
        stop_serving(proc, lines)
        assert (runs.lora / "vllm.log").is_file()  # (its log beside the run's)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)


def test_export_and_merge_push_to_a_hub_or_say_why_not(runs, tmp_path, capsys, monkeypatch):
    """--push-to-hub uploads the folder just written with huggingface_hub (here to a hub on this machine:
    tests/fake_hub.py); a refused token, or the hub turned off, is one line that says the folder is written."""
    import huggingface_hub

    hub = FakeHub().start(free_port())
    try:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_TOKEN", "hf_fake_token")
        code, out, err = cli(capsys, "export", runs.lora, tmp_path / "adapter", "--push-to-hub", "me/agent")
        assert code == 0, err
        assert out.splitlines()[1].startswith(f"pushed to me/agent: {hub.url}/me/agent/commit/")
        written = {p.name: p.read_bytes() for p in (tmp_path / "adapter").iterdir()}
        assert hub.repos["me/agent"] == written and "adapter_model.safetensors" in written
        code, out, err = cli(capsys, "merge", runs.lora, tmp_path / "merged", "--push-to-hub", "me/merged")
        assert code == 0 and "model.safetensors" in hub.repos["me/merged"], err
        monkeypatch.setenv("HF_TOKEN", "hf_wrong")
        code, out, err = cli(capsys, "export", runs.lora, tmp_path / "again", "--push-to-hub", "me/other")
        assert code == 2 and "set HF_TOKEN" in err and f"{tmp_path / 'again'} is written" in err, err
        assert err.count("\n") == 1 and "me/other" not in hub.repos
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        code, out, err = cli(capsys, "export", runs.lora, tmp_path / "offline", "--push-to-hub", "me/agent")
        assert (
            code == 2
            and "HF_HUB_OFFLINE=1" in err
            and (tmp_path / "offline" / "adapter_config.json").is_file()
        )
    finally:
        hub.stop()


def test_version_and_env_say_what_a_bug_report_needs(capsys):
    import artrl
    from artrl.cli import main

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"artrl {artrl.__version__}"
    assert main(["env", "--json", "--vllm-python", "/nonexistent/python"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["packages"]["artrl"] == artrl.__version__ and report["packages"]["torch"]
    assert report["torch_devices"]["cuda"] in (True, False) and report["vllm_environment"] is None
    assert main(["env", "--vllm-python", "/nonexistent/python"]) == 0
    assert "transformers:" in capsys.readouterr().out


def test_serve_and_merge_load_the_base_as_the_run_did(runs, tmp_path, capsys, monkeypatch):
    """A run trained on a pinned revision (LoadConfig) is served and merged against those weights: serve's
    engine keeps the run's LoadConfig; merge and the tokenizer pass its revision and trust_remote_code."""
    from transformers import AutoModelForCausalLM

    from artrl.local.runs.run_folder import open_run
    from artrl.local.runs.serve_run import engine_config_of

    pinned = tmp_path / "pinned"
    shutil.copytree(runs.lora, pinned, ignore=shutil.ignore_patterns(".lock", "tokenizer"))
    spec = json.loads((pinned / "model.json").read_text())
    spec["engine"]["load"] = {**spec["engine"].get("load", {}), "revision": "main", "trust_remote_code": True}
    (pinned / "model.json").write_text(json.dumps(spec))
    run = open_run(pinned)
    assert run.hub_options == {"revision": "main", "trust_remote_code": True}
    assert engine_config_of(run).load.revision == "main" and engine_config_of(run).load.trust_remote_code
    asked = []
    real = AutoModelForCausalLM.from_pretrained

    def recording(*args, **kwargs):  # (the real load, its options kept)
        asked.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", recording)
    code, _, err = cli(capsys, "merge", pinned, tmp_path / "merged")
    assert code == 0, err
    assert asked and asked[0]["revision"] == "main" and asked[0]["trust_remote_code"] is True
