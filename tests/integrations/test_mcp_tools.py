"""artrl.MCPTools against a real MCP server (mcp_server.py beside this file), over stdio and over streamable
HTTP."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from openai.types.chat import ChatCompletionMessageToolCall

pytest.importorskip("mcp")

import artrl
from artrl.integrations.mcp_tools import parse_arguments, result_text

SERVER = Path(__file__).with_name("mcp_server.py")


@pytest.fixture(scope="module")
def http_url(tmp_path_factory: pytest.TempPathFactory):
    """The test server on streamable HTTP, in a subprocess killed at the end of the module; it binds a free
    port itself and writes it to a file once it listens."""
    folder = tmp_path_factory.mktemp("mcp")
    log_path, port_file = folder / "server.log", folder / "port"
    with open(log_path, "wb") as log:  # a file, not a pipe: a chatty server never blocks on it
        proc = subprocess.Popen(
            [sys.executable, str(SERVER), "--http", str(port_file)], stdout=log, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + 60  # (a guard against a hang: start-up takes about a second)
        while not port_file.exists():
            if proc.poll() is not None:
                pytest.fail(f"MCP test server exited ({proc.returncode}): {log_path.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"MCP test server did not listen within 60 s: {log_path.read_text()[-2000:]}")
            time.sleep(0.1)
        yield f"http://127.0.0.1:{int(port_file.read_text())}/mcp"
    finally:
        proc.kill()
        proc.wait(timeout=10)


def _connect(transport: str, url: str | None = None) -> artrl.MCPTools:
    if transport == "stdio":
        return artrl.MCPTools.stdio(sys.executable, [str(SERVER)], timeout=30)
    assert url is not None
    return artrl.MCPTools.http(url, timeout=30)


@pytest.mark.parametrize("transport", ["stdio", "http"])
async def test_tools_over_transport(transport: str, request: pytest.FixtureRequest) -> None:
    url = request.getfixturevalue("http_url") if transport == "http" else None
    async with _connect(transport, url) as tools:
        # Schemas: OpenAI function tools, with the server's JSON schemas as parameters.
        schemas = {t["function"]["name"]: t for t in tools.openai_tools()}
        assert set(schemas) == {"add", "lookup", "fail", "slow", "crash"}
        add = schemas["add"]
        assert add["type"] == "function"
        assert add["function"]["description"] == "Add two integers."
        assert add["function"]["parameters"]["type"] == "object"
        assert sorted(add["function"]["parameters"]["required"]) == ["a", "b"]
        assert set(add["function"]["parameters"]["properties"]) == {"a", "b"}
        assert schemas["fail"]["function"]["parameters"]["properties"] == {}
        assert [t["function"]["name"] for t in tools.openai_tools(["lookup"])] == ["lookup"]

        # Calls: JSON-string arguments (as a model sends them) and dicts.
        assert await tools.call("add", '{"a": 2, "b": 40}') == "42"
        assert await tools.call("lookup", {"key": "lime"}) == "green"
        missing = await tools.call("lookup", '{"key": "kiwi"}')
        assert missing.startswith("Error: ") and missing.endswith("no fruit named 'kiwi'")
        failed = await tools.call("fail", "")
        assert failed.startswith("Error: ") and failed.endswith("this tool always fails")
        bad_args = await tools.call("add", '{"a": "two", "b": 1}')
        assert bad_args.startswith("Error: ") and "add" in bad_args

        # Problems found before calling: the model reads them as the tool result.
        unknown = await tools.call("subtract", '{"a": 1}')
        assert unknown.startswith("Error: unknown tool 'subtract'") and "add" in unknown
        malformed = await tools.call("add", '{"a": 1, "b": ')
        assert malformed.startswith("Error: tool arguments are not valid JSON")
        assert (
            await tools.call("add", "[1, 2]")
            == "Error: tool arguments must be a JSON object, got a JSON list"
        )

        # A slow tool times out with a clear message, without waiting for the tool to end, and the session
        # stays usable.
        start = time.monotonic()
        assert (
            await tools.call("slow", '{"seconds": 10}', timeout=0.3)
            == "Error: tool 'slow' timed out after 0.3 s"
        )
        # (below the tool's 10 s, however loaded the machine: a timeout that waited for the tool takes 10 s)
        assert time.monotonic() - start < 9
        assert await tools.call("slow", {"seconds": 0}) == "done"

        # Tool messages, from an OpenAI SDK tool call object and from a dict.
        sdk_call = ChatCompletionMessageToolCall(
            id="call_1", type="function", function={"name": "add", "arguments": '{"a": 1, "b": 2}'}
        )
        assert await tools.tool_message(sdk_call) == {
            "role": "tool",
            "tool_call_id": "call_1",
            "content": "3",
        }
        dict_call = {
            "id": "call_2",
            "type": "function",
            "function": {"name": "lookup", "arguments": '{"key": "apple"}'},
        }
        messages = await tools.tool_messages([dict_call, sdk_call])
        assert messages == [
            {"role": "tool", "tool_call_id": "call_2", "content": "red"},
            {"role": "tool", "tool_call_id": "call_1", "content": "3"},
        ]
        assert await tools.tool_messages(None) == []
    with pytest.raises(RuntimeError, match="not connected"):
        await tools.call("add", "{}")


def test_parse_arguments() -> None:
    assert parse_arguments(None) == {}
    assert parse_arguments("  ") == {}
    assert parse_arguments('{"x": 1}') == {"x": 1}
    assert parse_arguments({"x": 1}) == {"x": 1}
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_arguments("{x: 1}")
    with pytest.raises(ValueError, match="JSON object, got a JSON str"):
        parse_arguments('"x"')


def test_result_text() -> None:
    from mcp.types import CallToolResult, ImageContent, TextContent

    ok = CallToolResult(content=[TextContent(text="a"), TextContent(text="b")])
    assert result_text(ok) == "a\nb"
    image = CallToolResult(content=[ImageContent(data="QUJD", mime_type="image/png")])
    assert result_text(image) == '{"type": "image", "mime_type": "image/png", "base64_chars": 4}'
    structured = CallToolResult(content=[], structured_content={"n": 1})
    assert result_text(structured) == '{"n": 1}'
    assert result_text(CallToolResult(content=[], is_error=True), "t") == "Error: t failed"


async def test_connect_failure_raises() -> None:
    # a port bound here and never listened on: connections to it are refused, and no other process can take
    # it meanwhile (a port found free and released could be)
    with socket.socket() as refusing:
        refusing.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{refusing.getsockname()[1]}/mcp"
        start = time.monotonic()
        with pytest.raises(
            ConnectionError, match=r"could not connect to the MCP server \(http://127.0.0.1:\d+/mcp\)"
        ):
            async with artrl.MCPTools.http(url, timeout=5):
                pass
    assert time.monotonic() - start < 10


def test_import_artrl_stays_light() -> None:
    code = "import artrl, sys; artrl.MCPTools; assert 'torch' not in sys.modules and 'mcp' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


async def test_server_that_exits_raises() -> None:
    start = time.monotonic()
    with pytest.raises(ConnectionError, match="could not connect to the MCP server"):
        async with artrl.MCPTools.stdio(sys.executable, ["-c", "pass"], timeout=5):
            pass
    assert time.monotonic() - start < 10


async def test_a_server_that_dies_raises_instead_of_answering_the_model():
    """A dead server is a broken environment, not a tool error for the model to read: the call raises."""
    async with artrl.MCPTools.stdio(sys.executable, [str(SERVER)], timeout=30) as tools:
        with pytest.raises(ConnectionError, match="connection closed"):
            await tools.call("crash", "{}", timeout=10)
