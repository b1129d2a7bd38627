"""MCP tools for rollouts: connect to an MCP server, offer its tools to the model, run the model's tool calls.

`MCPTools` is an async context manager over one connection (a server spawned over stdio, or a server reached
over streamable HTTP) made with the official `mcp` SDK (``pip install 'artrl[mcp]'``; imported only when a
connection is made, so `import artrl` needs neither it nor torch)::

    async with artrl.MCPTools.stdio("python", ["server.py"]) as tools:
        response = await client.chat.completions.create(..., tools=tools.openai_tools())
        for call in response.choices[0].message.tool_calls or []:
            traj.messages_and_choices.append(await tools.tool_message(call))

Inside an agent loop a failed tool call is something for the model to read, not a crash of the rollout: `call`
(and `tool_message`) return a tool-result string starting with ``"Error: "`` when the arguments are not a JSON
object, the tool is unknown, the tool reports an error (`isError`), the call times out or the server answers
with a protocol error. Only a broken connection raises; failing to connect raises ConnectionError. Enter and
leave the context in the same task (the SDK's transports are anyio task groups).
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from mcp import ClientSession
    from mcp.types import CallToolResult, Tool

MIN_MCP_VERSION = "2.3"
INSTALL_HINT = "pip install 'artrl[mcp]'"

# What a transport factory returns: an async context manager yielding (read_stream, write_stream).
_Transport = Callable[[], AbstractAsyncContextManager[Any]]


def _require_mcp() -> None:
    """Import the MCP SDK, or raise an ImportError that says how to install it."""
    try:
        import mcp  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"artrl.MCPTools needs the MCP SDK: {INSTALL_HINT}") from exc
    try:
        from mcp.shared.exceptions import MCPError  # noqa: F401  (renamed from McpError in mcp 2)
    except ImportError as exc:
        from importlib.metadata import version as dist_version

        version = dist_version("mcp")
        raise ImportError(
            f"artrl.MCPTools needs mcp>={MIN_MCP_VERSION} (found {version}): {INSTALL_HINT}"
        ) from exc


def openai_tool_schema(tool: Tool) -> dict[str, Any]:
    """One MCP tool as an OpenAI chat-completions tool: ``{"type": "function", "function": {...}}``."""
    parameters = dict(tool.input_schema or {}) or {"type": "object", "properties": {}}
    parameters.setdefault("type", "object")
    if parameters.get("type") == "object":
        parameters.setdefault("properties", {})
    function: dict[str, Any] = {"name": tool.name, "parameters": parameters}
    if tool.description:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def parse_arguments(arguments: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """The arguments of an OpenAI tool call (a JSON object, as a string or already parsed) as a dict.

    An empty string or None is ``{}``. Raises ValueError (with a message meant for the model) otherwise.
    """
    if arguments is None:
        return {}
    if isinstance(arguments, Mapping):
        return dict(arguments)
    if not isinstance(arguments, str):
        raise ValueError(f"tool arguments must be a JSON object, got {type(arguments).__name__}")
    if not arguments.strip():
        return {}
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError as exc:
        raise ValueError(f"tool arguments are not valid JSON ({exc.msg} at position {exc.pos})") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"tool arguments must be a JSON object, got a JSON {type(parsed).__name__}")
    return parsed


def _block_text(block: Any) -> str:
    kind = getattr(block, "type", None)
    if kind == "text":
        return block.text
    if kind in ("image", "audio"):
        return json.dumps({"type": kind, "mime_type": block.mime_type, "base64_chars": len(block.data)})
    if kind == "resource_link":
        return json.dumps({"type": kind, "uri": str(block.uri), "name": block.name})
    if kind == "resource":
        resource = block.resource
        text = getattr(resource, "text", None)
        if text is not None:
            return text
        return json.dumps({"type": kind, "uri": str(resource.uri), "mime_type": resource.mime_type})
    return json.dumps({"type": kind or type(block).__name__})


def result_text(result: CallToolResult, name: str = "tool") -> str:
    """A tool result as the text of a tool message: text blocks joined by newlines, other blocks as short
    JSON descriptions, the structured content as JSON when there are no blocks; ``"Error: ..."`` on isError."""
    text = "\n".join(_block_text(block) for block in result.content)
    if not text and result.structured_content is not None:
        text = json.dumps(result.structured_content)
    if result.is_error:
        return f"Error: {text}" if text else f"Error: {name} failed"
    return text


def _leaf(exc: BaseException) -> BaseException:
    """The one exception inside (nested) single-exception groups, as the SDK's task groups raise them."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def _tool_call_parts(tool_call: Any) -> tuple[str | None, str, Any]:
    """(id, name, arguments) of an OpenAI SDK tool call object or its dict form."""
    if isinstance(tool_call, Mapping):
        function = tool_call.get("function") or {}
        return tool_call.get("id"), function.get("name", ""), function.get("arguments")
    function = tool_call.function
    return getattr(tool_call, "id", None), function.name, function.arguments


class MCPTools:
    """The tools of one MCP server, for rollouts. Make one with `MCPTools.stdio` or `MCPTools.http` and use it
    as an async context manager: entering connects, initializes the session and lists the tools.

    `call_timeout` is the default limit (seconds) on one tool call; `timeout` bounds connecting and the other
    requests (initialize, list_tools).
    """

    def __init__(
        self,
        transport: _Transport,
        *,
        target: str = "custom transport",
        timeout: float = 30.0,
        call_timeout: float = 60.0,
    ) -> None:
        _require_mcp()
        self._transport = transport
        self.target = target
        """What this connects to, for messages: ``"stdio: python server.py"`` or the URL."""
        self.timeout = timeout
        self.call_timeout = call_timeout
        self._stack: AsyncExitStack | None = None
        self._session: ClientSession | None = None
        self.tools: list[Tool] = []
        """The server's tools (``mcp.types.Tool``), as of the last `refresh`."""

    @classmethod
    def stdio(
        cls,
        command: str,
        args: Sequence[str] = (),
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        errlog: TextIO | None = None,
        timeout: float = 30.0,
        call_timeout: float = 60.0,
    ) -> MCPTools:
        """A server spawned as ``command *args``, spoken to over its stdin/stdout. `env` is added to the SDK's
        default (minimal) environment; the server's stderr goes to `errlog` (default: sys.stderr)."""

        def transport() -> AbstractAsyncContextManager[Any]:
            from mcp.client.stdio import StdioServerParameters, stdio_client

            params = StdioServerParameters(
                command=command, args=list(args), env=dict(env) if env is not None else None, cwd=cwd
            )
            return stdio_client(params, errlog=errlog or sys.stderr)

        target = "stdio: " + " ".join([command, *args])
        return cls(transport, target=target, timeout=timeout, call_timeout=call_timeout)

    @classmethod
    def http(
        cls,
        url: str,
        *,
        headers: Mapping[str, str] | None = None,
        timeout: float = 30.0,
        call_timeout: float = 60.0,
    ) -> MCPTools:
        """A server at `url` (e.g. ``http://127.0.0.1:8000/mcp``), spoken to over streamable HTTP, with extra
        HTTP `headers` (e.g. ``{"Authorization": "Bearer ..."}``) on every request."""

        def transport() -> AbstractAsyncContextManager[Any]:
            return _http_transport(url, headers, timeout, call_timeout)

        return cls(transport, target=url, timeout=timeout, call_timeout=call_timeout)

    async def __aenter__(self) -> MCPTools:
        if self._stack is not None:
            raise RuntimeError("this MCPTools is already connected")
        from mcp import ClientSession

        stack = AsyncExitStack()
        try:
            read, write = await stack.enter_async_context(self._transport())
            session = await stack.enter_async_context(
                ClientSession(read, write, read_timeout_seconds=self.timeout)
            )
            await session.initialize()
            self._stack, self._session = stack, session
            await self.refresh()
        except BaseException as exc:
            self._stack = self._session = None
            error: BaseException = exc
            try:
                # A transport's failure (a refused connection) often surfaces only here, when its task group
                # exits, after having cancelled the handshake above.
                await stack.aclose()
            except Exception as close_exc:
                error = close_exc
            if isinstance(error, Exception):
                cause = _leaf(error)
                raise ConnectionError(
                    f"could not connect to the MCP server ({self.target}): {type(cause).__name__}: {cause}"
                ) from error
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        stack, self._stack, self._session = self._stack, None, None
        if stack is not None:
            await stack.aclose()

    @property
    def session(self) -> ClientSession:
        """The underlying ``mcp.ClientSession`` (for resources, prompts and the rest of the protocol)."""
        if self._session is None:
            raise RuntimeError(
                "MCPTools is not connected: use it as `async with MCPTools.stdio(...) as tools`"
            )
        return self._session

    @property
    def names(self) -> list[str]:
        return [tool.name for tool in self.tools]

    async def refresh(self) -> list[Tool]:
        """List the server's tools again (all pages), e.g. after it announced that they changed."""
        tools: list[Tool] = []
        cursor: str | None = None
        while True:
            if cursor is None:
                page = await self.session.list_tools()
            else:
                from mcp.types import PaginatedRequestParams

                page = await self.session.list_tools(params=PaginatedRequestParams(cursor=cursor))
            tools.extend(page.tools)
            cursor = page.next_cursor
            if not cursor:
                break
        self.tools = tools
        return tools

    def openai_tools(self, names: Iterable[str] | None = None) -> list[dict[str, Any]]:
        """The tools as OpenAI chat-completions tool schemas (all of them, or those in `names`), to pass as
        ``tools=`` to ``chat.completions.create`` and to ``artrl.Trajectory(tools=...)``."""
        wanted = None if names is None else set(names)
        return [openai_tool_schema(t) for t in self.tools if wanted is None or t.name in wanted]

    async def call(
        self, name: str, arguments: str | Mapping[str, Any] | None = None, *, timeout: float | None = None
    ) -> str:
        """Run tool `name` with `arguments` (the JSON string of an OpenAI tool call, or a dict) and return the
        result as text. Problems the model can act on come back as text starting with ``"Error: "`` (bad
        arguments, unknown tool, a tool error, a timeout after `timeout` seconds, a protocol error)."""
        from mcp.shared.exceptions import MCPError
        from mcp.types import CONNECTION_CLOSED, REQUEST_TIMEOUT

        session = self.session
        if name not in self.names:
            available = ", ".join(self.names) or "none"
            return f"Error: unknown tool {name!r}; available tools: {available}"
        try:
            args = parse_arguments(arguments)
        except ValueError as exc:
            return f"Error: {exc}"
        limit = self.call_timeout if timeout is None else timeout
        try:
            result = await session.call_tool(name, args, read_timeout_seconds=limit)
        except MCPError as exc:
            if exc.code == CONNECTION_CLOSED:  # the server is gone: not something for the model to read
                raise ConnectionError(f"MCP server connection closed during tool {name!r}") from exc
            if exc.code == REQUEST_TIMEOUT:
                return f"Error: tool {name!r} timed out after {limit:g} s"
            return f"Error: {exc.error.message}"
        return result_text(result, name)

    async def tool_message(self, tool_call: Any) -> dict[str, Any]:
        """Run one tool call of a model's message (an OpenAI SDK tool call, or its dict form) and return the
        tool message to append to the trajectory: ``{"role": "tool", "tool_call_id": ..., "content": ...}``."""
        call_id, name, arguments = _tool_call_parts(tool_call)
        content = await self.call(name, arguments)
        return {"role": "tool", "tool_call_id": call_id, "content": content}

    async def tool_messages(self, tool_calls: Iterable[Any] | None) -> list[dict[str, Any]]:
        """`tool_message` for each of a message's tool calls (run concurrently), in their order."""
        return list(await asyncio.gather(*(self.tool_message(call) for call in tool_calls or ())))


def _http_transport(
    url: str, headers: Mapping[str, str] | None, timeout: float, call_timeout: float
) -> AbstractAsyncContextManager[Any]:
    from contextlib import asynccontextmanager

    import httpx2
    from mcp.client.streamable_http import create_mcp_http_client, streamable_http_client

    @asynccontextmanager
    async def transport() -> AsyncIterator[Any]:
        # Reads may wait as long as a tool call may run (plus slack), or the SDK's SSE default if longer.
        read = max(300.0, call_timeout + timeout)
        client = create_mcp_http_client(
            headers=dict(headers) if headers else None, timeout=httpx2.Timeout(timeout, read=read)
        )
        async with client, streamable_http_client(url, http_client=client) as (read_stream, write_stream):
            yield read_stream, write_stream

    return transport()
