"""The SDK majors before the newest (tests/sdk_previous.txt: openai 2, which builds on `httpx`, and anthropic
1) still drive the gateway, capture and the LangChain client: a cross-section of those suites runs in a child
pytest with .venv/sdk-previous (scripts/setup.sh installs it) first on the path. The main run covers the
newest majors (openai 3 and anthropic 2, on `httpx2`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = (
    pytest.mark.slow
)  # a child pytest that serves two tiny models (~30 s: it finds the fixture models this session built)

ROOT = Path(__file__).resolve().parents[1]
PREVIOUS = ROOT / ".venv" / "sdk-previous"
# chat (plain, streamed, sync), Responses and Messages (streamed, their errors; anthropic in process), capture (the model's client,
# any client on the capture's URL, streamed, scripted tool calls), LangChain/LangGraph (async and sync)
CROSS_SECTION = [
    "tests/local/gateway/test_openai_sdk.py::test_plain_chat_carries_token_ids",
    "tests/local/gateway/test_openai_sdk.py::test_streaming_equals_non_streaming",
    "tests/local/gateway/test_openai_sdk.py::test_sync_client_from_plain_code",
    "tests/local/gateway/test_dialects.py::test_responses_streaming",
    "tests/local/gateway/test_dialects.py::test_messages_streaming",
    "tests/local/gateway/test_dialects.py::test_bad_requests_are_clear_errors",
    "tests/local/gateway/test_in_process_transport.py::test_the_anthropic_client_skips_the_network_on_its_own_httpx",
    "tests/capturing/test_capture.py::test_unchanged_agent_through_model_client_is_captured",
    "tests/capturing/test_capture.py::test_per_capture_base_url_records_any_client",
    "tests/capturing/test_capture.py::test_streaming_call_is_recorded_with_token_ids",
    "tests/capturing/test_capture.py::test_scripted_tool_calls_and_api_key",
    "tests/integrations/test_langchain_capture.py::test_langgraph_react_agent_is_captured_token_exact",
    "tests/integrations/test_langchain_capture.py::test_sync_invoke_from_a_thread_is_captured",
]


def previous_env(shared: Path | None = None) -> dict[str, str]:
    """The environment of a child process that imports the previous majors first (and, given `shared`, finds
    the fixture models this session built: conftest.shared_folder)."""
    if not (PREVIOUS / ".installed").is_file():
        pytest.fail(
            f"{PREVIOUS} is missing: run `bash scripts/setup.sh` (it installs tests/sdk_previous.txt)"
        )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PREVIOUS), env.get("PYTHONPATH", "")) if p)
    if shared is not None:
        env["ARTRL_TEST_SHARED"] = str(shared)
    return env


def test_the_previous_majors_are_the_ones_imported():
    lines = (ROOT / "tests/sdk_previous.txt").read_text().splitlines()
    pins = dict(line.split("==") for line in lines if "==" in line)
    script = "import openai, anthropic; print(openai.__version__, anthropic.__version__)"
    run = subprocess.run(
        [sys.executable, "-c", script], env=previous_env(), capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [pins["openai"], pins["anthropic"]]
    assert int(pins["openai"].split(".")[0]) < int(__import__("openai").__version__.split(".")[0])


def test_gateway_capture_and_langchain_under_the_previous_majors(shared_root):
    command = [sys.executable, "-m", "pytest", "-q", "-n0", "-p", "no:cacheprovider", "-p", "no:randomly"]
    result = subprocess.run(
        [*command, "-m", "not vllm", *CROSS_SECTION],
        cwd=ROOT,
        env=previous_env(shared_root),
        capture_output=True,
        text=True,
        timeout=900,
    )
    summary = result.stdout[-4000:] + result.stderr[-2000:]
    assert result.returncode == 0, summary
    assert f"{len(CROSS_SECTION)} passed" in result.stdout.splitlines()[-1], summary  # (none skipped)
