"""A small MCP server for tests/test_mcp_tools.py: stdio by default, streamable HTTP with ``--http PORT``."""

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


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--http", type=int, metavar="PORT", help="serve streamable HTTP on 127.0.0.1:PORT")
    port = parser.parse_args().http
    if port is None:
        server.run()
    else:
        server.run("streamable-http", host="127.0.0.1", port=port)
