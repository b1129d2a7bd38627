"""`artrl.langchain_chat_model(model)`: a LangChain `ChatOpenAI` bound to the served model.

Its calls made inside an `artrl.capture(model)` block are recorded there, exact token ids included: its HTTP
clients are the installed openai SDK's own (`httpx` under openai 2, `httpx2` under openai 3) and carry the same
request hook as `model.openai_client()`. LangChain turns responses into `AIMessage`s
and drops the gateway's extra fields, which is fine: the gateway records the token ids server-side.
Needs `pip install langchain-openai` (imported only when called).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from artrl.capturing.block import needs_tls, tag_request, tag_request_async

if TYPE_CHECKING:
    from langchain_openai import ChatOpenAI


def langchain_chat_model(model: Any, **kwargs: Any) -> ChatOpenAI:
    """A `langchain_openai.ChatOpenAI` on `model`'s gateway (keyword arguments override the defaults).

    `model` is a `TrainableModel` or any object with `name`, `inference_base_url` and `inference_api_key`.
    Pass your own `http_client` / `http_async_client` to opt out of the capture hook.
    """
    try:
        from langchain_openai import ChatOpenAI
    except ImportError as e:
        raise ImportError(
            "artrl.langchain_chat_model needs LangChain's OpenAI integration: pip install langchain-openai"
        ) from e

    base_url = kwargs.pop("base_url", model.inference_base_url)
    client_config = getattr(model, "client", None)
    timeout = kwargs.pop("timeout", getattr(client_config, "timeout_s", None) or 600.0)
    options: dict[str, Any] = {
        "model": getattr(model, "name", None) or "default",
        "base_url": base_url,
        "api_key": model.inference_api_key,
        "timeout": timeout,
    }
    max_retries = getattr(client_config, "max_retries", None)
    if max_retries is not None:
        options["max_retries"] = max_retries
    import openai  # (the SDK's client classes: a legacy httpx client handed to openai 3 is not its own)

    verify = needs_tls(base_url)
    if "http_async_client" not in kwargs:
        options["http_async_client"] = openai.DefaultAsyncHttpxClient(
            event_hooks={"request": [tag_request_async]}, timeout=timeout, verify=verify
        )
    if "http_client" not in kwargs:
        options["http_client"] = openai.DefaultHttpxClient(
            event_hooks={"request": [tag_request]}, timeout=timeout, verify=verify
        )
    return ChatOpenAI(**{**options, **kwargs})
