"""A small MCP server for tests/integrations/test_mcp_tools.py: stdio by default, streamable HTTP with
``--http PORT_FILE`` (on a free port of 127.0.0.1, written to PORT_FILE once it listens)."""

from __future__ import annotations

import argparse
import os

import anyio
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

FRUIT = {"apple": "red", "banana": "yellow", "lime": "green"}

server = MCPServer("artrl-test", log_level="ERROR")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def lookup(key: str) -> str:
    """The colour of a fruit."""
    if key not in FRUIT:
        raise ToolError(f"no fruit named {key!r}")
    return FRUIT[key]


@server.tool()
def fail() -> str:
    """Always fails."""
    raise ToolError("this tool always fails")


@server.tool()
async def slow(seconds: float) -> str:
    """Sleep, then answer."""
    await anyio.sleep(seconds)
    return "done"


@server.tool()
def crash() -> str:
    """Kill the server process mid-call (a broken environment)."""
    os._exit(1)


def serve_http(port_file: str) -> None:
    import socket

    import uvicorn

    # the kernel picks the port as this process binds it: a port picked by the test and bound later could be
    # taken meanwhile by another process
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()  # from here connections queue until uvicorn accepts them: the port is usable once written
    written = f"{port_file}.tmp"
    with open(written, "w") as file:
        file.write(str(sock.getsockname()[1]))
    os.replace(written, port_file)  # (whole: the test never reads half a number)
    config = uvicorn.Config(server.streamable_http_app(), log_level=server.settings.log_level.lower())
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--http", metavar="PORT_FILE", help="serve streamable HTTP; write its port to PORT_FILE"
    )
    port_file = parser.parse_args().http
    if port_file is None:
        server.run()
    else:
        serve_http(port_file)
