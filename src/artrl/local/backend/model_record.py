"""What a run's model.json records of a model: its engine's settings without secrets, and the user's own
settings as JSON."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from artrl.config import EngineConfig

REDACTED = "<redacted>"
_SECRET_ARGS = ("key", "token", "secret", "password")  # (in an extra vLLM argument's name: its value is one)


def recorded_engine(engine: EngineConfig) -> dict[str, Any]:
    """The engine's settings as model.json records them, without secrets: the vLLM server's key and the
    values of its environment (an HF token, say; the names stay), nor those of secret-looking extra args."""
    settings = engine.model_dump()
    vllm = settings["vllm"]
    if vllm["api_key"] is not None:
        vllm["api_key"] = REDACTED
    vllm["env"] = {name: REDACTED for name in vllm["env"]}
    vllm["replica_env"] = [{name: REDACTED for name in env} for env in vllm["replica_env"]]
    url = vllm["url"]  # (a password in a server's URL: http://user:PASSWORD@host)
    if isinstance(url, str):
        vllm["url"] = _without_password(url)
    elif url is not None:
        vllm["url"] = [_without_password(u) for u in url]
    args, secret_next = [], False
    for arg in vllm["extra_args"]:
        flag, eq, _ = arg.partition("=")
        is_flag = arg.startswith("-")
        secret = is_flag and any(word in flag.lower() for word in _SECRET_ARGS)
        args.append(
            REDACTED if secret_next and not is_flag else f"{flag}={REDACTED}" if secret and eq else arg
        )
        secret_next = secret and not eq
    vllm["extra_args"] = args
    return settings


def user_config(config: Any) -> Any:
    """A model's own settings (`TrainableModel(config=...)`) as JSON: a pydantic model dumped, else as given
    when JSON can hold it, else its repr."""
    if config is None:
        return None
    if hasattr(config, "model_dump"):
        return config.model_dump(mode="json")
    try:
        return json.loads(json.dumps(config))
    except (TypeError, ValueError):
        return repr(config)


def _without_password(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username}:{REDACTED}@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))
