"""Which httpx package an SDK's HTTP client builds on: `httpx`, or `httpx2` (openai 3, anthropic 1.17 and
later). A transport handed to a client must subclass that package's own base classes."""

from __future__ import annotations

import importlib
from types import ModuleType


def httpx_package(client_class: type) -> ModuleType:
    """The httpx module `client_class` (e.g. `openai.DefaultAsyncHttpxClient`) subclasses."""
    base = next(c for c in client_class.__mro__ if c.__module__.split(".")[0] in ("httpx", "httpx2"))
    return importlib.import_module(base.__module__.split(".")[0])


def openai_httpx() -> ModuleType:
    """The httpx module the installed `openai` SDK builds its clients on."""
    import openai

    return httpx_package(openai.DefaultAsyncHttpxClient)
