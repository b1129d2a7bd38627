"""A relative LLM judge (RULER-style): one judge call scores a whole group of trajectories against each other.

The judge is any OpenAI-compatible endpoint reached through an `openai.AsyncOpenAI` client: a hosted API,
or a model served by artrl itself (``model.openai_client()``). The message prefix the trajectories share is
sent once; each trajectory is shown under an id (``t1``..``tN``, in list order) and the scores are matched
back by that id, never by the order of the judge's answer.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping, Sequence
from typing import Any

import openai

from artrl.rewards.judge_prompt import (
    DEFAULT_RUBRIC,
    JudgeOutputError,
    Message,
    build_judge_messages,
    cache_key,
    common_prefix,
    parse_scores,
)
from artrl.trajectory import TrajectoryGroup

log = logging.getLogger(__name__)

JudgeCache = MutableMapping[str, list[tuple[float, str]]]
"""Where judged groups are kept (a plain dict will do), keyed by `cache_key` of the judge's prompt."""


class JudgeError(RuntimeError):
    """The judge failed: its request failed, or its answer was still invalid after `max_attempts` tries."""

    def __init__(self, message: str, *, attempts: int, last_output: str | None = None) -> None:
        super().__init__(message)
        self.attempts = attempts
        self.last_output = last_output


def trajectory_ids(count: int) -> list[str]:
    """The ids trajectories are shown under: ``t1``..``tN`` in list order (scores are matched by id)."""
    return [f"t{i}" for i in range(1, count + 1)]


def _tail(text: str | None, limit: int = 500) -> str:
    if text is None:
        return "(no content)"
    return text if len(text) <= limit else "..." + text[-limit:]


async def ruler_scores(
    message_lists: Sequence[Sequence[Message]],
    *,
    judge: openai.AsyncOpenAI,
    model: str,
    rubric: str = DEFAULT_RUBRIC,
    max_attempts: int = 3,
    temperature: float | None = None,
    max_tokens: int | None = None,
    timeout: float = 60.0,
    json_mode: bool = False,
    cache: JudgeCache | None = None,
) -> list[tuple[float, str]]:
    """Score conversations relative to each other with one judge call; returns ``(score, explanation)``
    per conversation, in input order, each score in [0, 1].

    Args:
        message_lists: one chat-completions message list per trajectory (what `Trajectory.messages()` gives).
        judge: the client of the judge's endpoint. `model`: the judge model's name there.
        rubric: what makes a trajectory better; the answer format is added to it.
        max_attempts: how many judge calls to make while its answer is invalid (not JSON, a score outside
            [0, 1], ids missing, unknown or repeated). Transport errors are retried by the client itself
            (its ``max_retries``), not here.
        temperature, max_tokens: sent only when given (None: the endpoint's default).
        timeout: seconds for each judge call.
        json_mode: also send ``response_format={"type": "json_object"}`` (off by default: not every endpoint
            accepts it, artrl's own gateway among them; the answer is validated either way).
        cache: a mapping (a dict will do) of earlier answers keyed by the content of the judge's prompt;
            a hit makes no call.

    Raises:
        JudgeError: the request failed, or every attempt gave an invalid answer; the message quotes the
            last validation error and the tail of the judge's last output.
    """
    if max_attempts < 1:
        raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
    if not message_lists:
        return []
    ids = trajectory_ids(len(message_lists))
    prefix, suffixes = common_prefix(message_lists)
    messages = build_judge_messages(prefix, dict(zip(ids, suffixes, strict=True)), rubric)
    key = cache_key(model, rubric, messages) if cache is not None else ""
    if cache is not None and key in cache:
        return [(float(s), str(e)) for s, e in cache[key]]

    options: dict[str, Any] = {"timeout": timeout}
    if temperature is not None:
        options["temperature"] = temperature
    if max_tokens is not None:
        options["max_tokens"] = max_tokens
    if json_mode:
        options["response_format"] = {"type": "json_object"}

    text: str | None = None
    error: JudgeOutputError | None = None
    for attempt in range(1, max_attempts + 1):
        try:
            response = await judge.chat.completions.create(model=model, messages=messages, **options)  # type: ignore[arg-type]
        except openai.APIError as exc:
            raise JudgeError(
                f"judge request to {model!r} failed: {type(exc).__name__}: {exc}", attempts=attempt
            ) from exc
        text = response.choices[0].message.content if response.choices else None
        try:
            if not text:
                raise JudgeOutputError("judge output is empty")
            scores = parse_scores(text, ids)
        except JudgeOutputError as exc:
            error = exc
            log.warning("judge answer invalid (attempt %d of %d): %s", attempt, max_attempts, exc)
            continue
        result = [scores[i] for i in ids]
        if cache is not None:
            cache[key] = result
        return result
    raise JudgeError(
        f"judge {model!r} gave no valid scores in {max_attempts} attempt(s); last error: {error}; "
        f"end of its last output: {_tail(text)!r}",
        attempts=max_attempts,
        last_output=text,
    )


# LiteLLM's provider prefixes: those that mean "an OpenAI-compatible endpoint", and some that do not
_OPENAI_ROUTES = frozenset({"openai", "hosted_vllm", "openai_like", "custom_openai"})
_OTHER_PROVIDERS = frozenset(
    {"anthropic", "gemini", "vertex_ai", "bedrock", "ollama", "ollama_chat", "together_ai", "groq", "mistral"}
    | {"cohere", "azure", "fireworks_ai", "deepseek", "xai", "openrouter", "huggingface", "replicate"}
)


def judge_endpoint(
    judge_model: Any, extra_litellm_params: dict[str, Any] | None
) -> tuple[openai.AsyncOpenAI, str, dict[str, Any]]:
    """ART's way to name the judge -> (client, model name, ruler_scores keyword arguments).

    `judge_model`: an `artrl.Model` or `artrl.TrainableModel` (its own client and name), or a LiteLLM-style
    name: "openai/o3" or "o3" (the OpenAI API, or the endpoint at `api_base`/`base_url` with `api_key` in
    `extra_litellm_params`; temperature, max_tokens and timeout there go to the judge call)."""
    params = dict(extra_litellm_params or {})
    options = {k: params.pop(k) for k in ("api_base", "base_url", "api_key") if k in params}
    calls = {k: params.pop(k) for k in ("temperature", "max_tokens", "timeout") if k in params}
    if params:
        raise TypeError(
            f"extra_litellm_params {sorted(params)} are not used by artrl's judge (it takes api_base/base_url, "
            "api_key, temperature, max_tokens, timeout); artrl calls the judge with the openai SDK, not LiteLLM"
        )
    if hasattr(judge_model, "openai_client") and hasattr(judge_model, "get_inference_name"):
        if options:
            raise TypeError("the judge is a model with its own endpoint: leave api_base/api_key out")
        return judge_model.openai_client(), judge_model.get_inference_name(), calls
    if not isinstance(judge_model, str) or not judge_model:
        raise TypeError(
            f"judge_model must be a model name or an artrl.Model, not {type(judge_model).__name__}"
        )
    provider, _, rest = judge_model.partition("/")
    name = rest if rest and provider in _OPENAI_ROUTES else judge_model  # else a name like "Qwen/Qwen3-32B"
    if rest and provider in _OTHER_PROVIDERS:
        raise ValueError(
            f"judge {judge_model!r}: artrl's judge speaks the OpenAI API; for {provider!r} pass "
            "artrl.Model(name=..., project=..., inference_base_url=<an OpenAI-compatible endpoint>, "
            "inference_model_name=...) as the judge"
        )
    base_url = options.get("base_url", options.get("api_base"))
    api_key = options.get("api_key")
    if api_key is None and base_url is not None and not os.environ.get("OPENAI_API_KEY"):
        api_key = "none"  # a local server without keys (LiteLLM's hosted_vllm needs none either)
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key)
    return client, name, calls


async def ruler_score_group(
    group: TrajectoryGroup,
    judge_model: Any = None,
    extra_litellm_params: dict[str, Any] | None = None,
    *,
    judge: openai.AsyncOpenAI | None = None,
    model: str | None = None,
    rubric: str = DEFAULT_RUBRIC,
    swallow_exceptions: bool = False,
    **kwargs: Any,
) -> TrajectoryGroup | None:
    """Rescore a group with the relative judge; returns a new group (the input is left as it was).

    Each trajectory of the result has ``reward`` = the judge's score, ``metrics["independent_reward"]`` =
    its reward before, ``metrics["ruler_score"]`` = the score, and the judge's explanation appended to its
    ``logs``. The judge sees ``Trajectory.messages()`` (not the tool schemas). A group of fewer than two
    trajectories has nothing to compare and is returned as it is, without a judge call.

    The judge: ``judge=`` (an ``openai.AsyncOpenAI``) and ``model=`` (its model name), or as ART names it,
    ``ruler_score_group(group, "openai/o3")`` or with an `artrl.Model` (see `judge_endpoint`).
    Other keyword arguments go to `ruler_scores` (``max_attempts``, ``timeout``, ``cache``...). With
    ``swallow_exceptions=True`` a `JudgeError` is logged and None returned, so that
    ``after_each=functools.partial(ruler_score_group, judge=client, model="...", swallow_exceptions=True)``
    in `artrl.gather_trajectory_groups` drops the groups the judge could not score.
    """
    if judge_model is not None:  # ART's form: ruler_score_group(group, "openai/o3", {...})
        if judge is not None or model is not None:
            raise TypeError("give the judge as judge_model (ART's form) or as judge= and model=, not both")
        judge, model, calls = judge_endpoint(judge_model, extra_litellm_params)
        kwargs = {**calls, **kwargs}
        if isinstance(judge_model, str):  # a client made for this call: closed after it
            try:
                return await ruler_score_group(
                    group,
                    judge=judge,
                    model=model,
                    rubric=rubric,
                    swallow_exceptions=swallow_exceptions,
                    **kwargs,
                )
            finally:
                await judge.close()
    elif judge is None or model is None:
        raise TypeError(
            "ruler_score_group needs a judge: judge=<openai.AsyncOpenAI> and model=<its name>, "
            "or judge_model=<artrl.Model or 'openai/NAME'>"
        )
    elif extra_litellm_params:
        raise TypeError("extra_litellm_params goes with judge_model (ART's form)")
    if len(group.trajectories) < 2:
        return group
    try:
        scores = await ruler_scores(
            [t.messages() for t in group.trajectories], judge=judge, model=model, rubric=rubric, **kwargs
        )
    except JudgeError as exc:
        if not swallow_exceptions:
            raise
        log.warning("dropping a group of %d trajectories: %s", len(group.trajectories), exc)
        return None
    trajectories = [
        t.model_copy(
            update={
                "reward": score,
                "messages_and_choices": list(t.messages_and_choices),
                "metadata": dict(t.metadata),
                "metrics": {**t.metrics, "independent_reward": t.reward, "ruler_score": score},
                "logs": [
                    *t.logs,
                    f"ruler score {score:.3f} (independent reward {t.reward:g}): {explanation}",
                ],
            }
        )
        for t, (score, explanation) in zip(group.trajectories, scores, strict=True)
    ]
    return group.model_copy(
        update={
            "trajectories": trajectories,
            "exceptions": list(group.exceptions),
            "metadata": dict(group.metadata),
        }
    )
