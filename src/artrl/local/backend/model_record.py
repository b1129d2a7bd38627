"""What a run's model.json records of a model: its engine's settings without secrets, and the user's own
settings as JSON."""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from artrl.config import EngineConfig

log = logging.getLogger(__name__)

REDACTED = "<redacted>"
_SECRET_ARGS = ("key", "token", "secret", "password")  # (in an extra vLLM argument's name: its value is one)


def without_redacted(vllm: dict[str, Any]) -> dict[str, Any]:
    """A recorded VLLMConfig (model.json's) less what was never written: a redacted key or `env` value falls
    back to its default; an `extra_args` list that held a secret is dropped, with a warning."""
    kept: dict[str, Any] = {}
    for key, value in vllm.items():
        if isinstance(value, dict):
            value = {k: v for k, v in value.items() if v != REDACTED}
        elif isinstance(value, list) and all(isinstance(v, dict) for v in value):  # replica_env
            value = [{k: v for k, v in env.items() if v != REDACTED} for env in value]
        elif isinstance(value, list) and REDACTED in value:
            log.warning(
                "the run's VLLMConfig.%s held a secret model.json does not keep: served without it", key
            )
            continue
        if value != REDACTED:
            kept[key] = value
    if kept.get(
        "url"
    ):  # (the servers' number is the url's: given as well, it must agree, as recorded it may not)
        kept.pop("replicas", None)
    return kept


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


def _without_password(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username}:{REDACTED}@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))
