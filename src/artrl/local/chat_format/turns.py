"""The calls the gateway would record for a conversation it did not sample: one per assistant turn.

Used to train conversations given as plain messages (`train_sft`, `allow_rendered_turns`) and by
`artrl check-template`. Each assistant turn becomes (prompt ids, "sampled" ids) exactly as if the gateway
had served it: the prompt continues the previous turn's ids where the template allows it (and is rendered
afresh where it does not), and the sampled ids are the turn as the template writes it, from the
generation prompt through the token that ends the turn, tokenised on their own as a model samples them.
No `{% generation %}` marks are needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from artrl.local.chat_format.chat_format import ChatFormat


class UnrenderableTurnError(ValueError):
    """The chat template renders an assistant turn so that it does not follow its generation prompt."""


@dataclass(frozen=True)
class Turn:
    prompt_ids: list[int]
    sampled_ids: list[int]
    source: Literal["continuation", "rendered"]
    index: int  # of the assistant message in the conversation


_SENTINEL = "ArtrlProbe7Q"


def _probe_next(message: dict[str, Any]) -> dict[str, Any]:
    """A message that could follow `message` (to see how the template ends its turn)."""
    if message.get("tool_calls"):
        return {"role": "tool", "tool_call_id": message["tool_calls"][0].get("id", ""), "content": "ok"}
    return {"role": "user", "content": "ok"}


def _with_sentinel(messages: list[dict[str, Any]], j: int, at_start: bool) -> list[dict[str, Any]] | None:
    content = messages[j].get("content")
    if not isinstance(content, str):
        return None
    marked = _SENTINEL + content if at_start else content + _SENTINEL
    return [*messages[:j], {**messages[j], "content": marked}, *messages[j + 1 :]]


def assistant_span(
    fmt: ChatFormat,
    messages: list[dict[str, Any]],
    i: int,
    tools: list[dict[str, Any]] | None,
    kwargs: dict[str, Any] | None,
    prompt: str,
    rendered: str | None = None,
) -> str:
    """The text of assistant message `i` as the model writes it after `prompt` (the rendered generation
    prompt): through the token that ends its turn, without what the template adds after that token.
    `rendered`: messages[: i + 1] rendered without a generation prompt, where the caller has it.

    Where adding the turn makes the template re-render earlier history (gpt-oss drops earlier reasoning once a
    final answer follows), the turn is found after the message before it, marked with a sentinel."""
    if rendered is None:
        rendered = fmt.render(messages[: i + 1], tools, False, kwargs)
    if rendered.startswith(prompt):
        span = rendered[len(prompt) :]
    else:
        marked = _with_sentinel(messages[: i + 1], i - 1, at_start=False) if i > 0 else None
        if marked is None:
            raise UnrenderableTurnError(
                f"the chat template renders assistant message {i} so that it does not continue its generation "
                "prompt; artrl cannot tell which tokens the model writes"
            )
        before = fmt.render(marked[:i], tools, True, kwargs)
        after = fmt.render(marked, tools, False, kwargs)
        head, tail = before.split(_SENTINEL)[-1], after.split(_SENTINEL)[-1]
        if not tail.startswith(head):
            raise UnrenderableTurnError(
                f"the chat template renders assistant message {i} differently from its generation prompt"
            )
        span = tail[len(head) :]
    stops = list(fmt.stop_texts)
    body = span.rstrip()
    if any(body.endswith(stop) for stop in stops):
        return body
    return span + _ending(fmt, messages, i, tools, kwargs, span, stops)


def _ending(
    fmt: ChatFormat,
    messages: list[dict[str, Any]],
    i: int,
    tools: list[dict[str, Any]] | None,
    kwargs: dict[str, Any] | None,
    span: str,
    stops: list[str],
) -> str:
    """The stop token a turn ends with when the template writes it as the start of the next message (GLM)."""
    following = messages[i + 1] if i + 1 < len(messages) else _probe_next(messages[i])
    marked = _with_sentinel([*messages[: i + 1], following], i + 1, at_start=True)
    last_line = span.rstrip().rsplit("\n", 1)[-1]
    if marked is not None and last_line:
        text = fmt.render(marked, tools, False, kwargs).split(_SENTINEL)[0]
        tail = text[text.rfind(last_line) + len(last_line) :] if last_line in text else ""
        ending = next((stop for stop in stops if tail.startswith(stop)), None)
        if ending is not None:
            return ending
    raise UnrenderableTurnError(
        f"assistant message {i} ends without one of the turn-ending tokens {stops}; set the family's "
        "stop tokens (TrainableModel(chat_format=...)) or the model's generation_config eos_token_id"
    )


def simulate_turns(
    fmt: ChatFormat,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    kwargs: dict[str, Any] | None = None,
) -> list[Turn]:
    turns: list[Turn] = []
    closed: dict[int, str] = {}  # i -> messages[: i + 1] rendered without a generation prompt
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = fmt.render(messages[:i], tools, True, kwargs)
        closed[i] = fmt.render(messages[: i + 1], tools, False, kwargs)
        ids, source = None, "rendered"
        if turns:
            last = turns[-1]
            text = fmt.continuation_text(closed[last.index], prompt, last.sampled_ids)
            if text is not None:
                ids = [*last.prompt_ids, *last.sampled_ids, *fmt.encode(text, start=False)]
                source = "continuation"
        if ids is None:
            ids = fmt.encode(prompt)
        span = assistant_span(fmt, messages, i, tools, kwargs, prompt, closed[i])
        sampled = fmt.encode(span, start=False)
        turns.append(Turn(ids, sampled, source, i))  # type: ignore[arg-type]
    return turns
