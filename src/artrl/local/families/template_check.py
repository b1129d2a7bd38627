"""`artrl check-template`: what artrl will do with a model's chat template, found by rendering probes.

Reports the detected family, the stop tokens, whether a tool call and reasoning survive the round trip
(rendered by the template, parsed back by the format), how `tool_choice` is forced, where the template is
or is not prefix-preserving (tool results, a new user turn) and so how many training rows a multi-turn
trajectory makes, and whether assistant turns can be tokenised for SFT. `problems` lists what stops artrl
from training the model token-exactly (the command then exits non-zero).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from artrl.local.chat_format.chat_format import ChatFormat, TemplateRenderError
from artrl.local.chat_format.families import response_template
from artrl.local.chat_format.turns import UnrenderableTurnError, assistant_span, simulate_turns
from artrl.local.train.rows import rows_from_calls

PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look up a key.",
            "parameters": {
                "type": "object",
                "properties": {"key": {"type": "string"}, "count": {"type": "integer"}},
                "required": ["key"],
            },
        },
    }
]


def _call(i: int, key: str) -> dict[str, Any]:
    arguments = json.dumps({"key": key, "count": i})
    return {"id": f"call_{i}", "type": "function", "function": {"name": "lookup", "arguments": arguments}}


def probe_conversation(reasoning: bool) -> list[dict[str, Any]]:
    """user → call → result → call → result → answer → user → answer."""

    def turn(i: int, **fields: Any) -> dict[str, Any]:
        message = {"role": "assistant", "content": "", **fields}
        if reasoning:
            message["reasoning_content"] = f"Step {i}: think."
        return message

    return [
        {"role": "system", "content": "You answer with tools."},
        {"role": "user", "content": "Find alpha, then beta."},
        turn(1, tool_calls=[_call(1, "alpha")]),
        {"role": "tool", "tool_call_id": "call_1", "content": "alpha=1"},
        turn(2, tool_calls=[_call(2, "beta")]),
        {"role": "tool", "tool_call_id": "call_2", "content": "beta=2"},
        turn(3, content="alpha is 1, beta is 2."),
        {"role": "user", "content": "Thanks. And gamma?"},
        turn(4, content="I do not know gamma."),
    ]


@dataclass
class TemplateReport:
    model: str
    family: str
    detected_by: str
    stop_tokens: list[str]
    template_variables: list[str]
    tool_call_round_trip: bool | None = None  # None: the template renders no tool calls
    reasoning_round_trip: bool | None = None  # None: the family has no reasoning field
    tool_choice_prefix: str | None = None  # what tool_choice="required" puts after the generation prompt
    continues_after_tool_results: bool | None = None
    continues_after_user_turn: bool | None = None
    rows_per_trajectory: int | None = None
    turn_sources: list[str] = field(default_factory=list)
    generation_marks: bool = False
    sft_turns: bool = False  # assistant turns can be tokenised as served (no generation marks needed)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}

    def text(self) -> str:
        def yes(value: bool | None, none: str = "n/a") -> str:
            return none if value is None else ("yes" if value else "NO")

        lines = [
            f"model:                   {self.model}",
            f"chat format:             {self.family} (detected by {self.detected_by})",
            f"stop tokens:             {', '.join(self.stop_tokens) or 'none'}",
            f"template variables:      {', '.join(self.template_variables) or 'none'}",
            f"tool call round trip:    {yes(self.tool_call_round_trip, 'n/a (the template renders no calls)')}",
            f"reasoning round trip:    {yes(self.reasoning_round_trip, 'n/a (the model does not reason here)')}",
            f"tool_choice=required:    {json.dumps(self.tool_choice_prefix) if self.tool_choice_prefix is not None else 'not supported'}",
            f"prefix-preserving:       after tool results {yes(self.continues_after_tool_results)}, "
            f"after a new user turn {yes(self.continues_after_user_turn)}",
            f"probe trajectory:        {len(self.turn_sources)} calls ({', '.join(self.turn_sources)}) "
            f"-> {self.rows_per_trajectory} training row(s)",
            f"assistant masks for SFT: {'yes' if self.sft_turns else 'NO'} (turns tokenised as served; "
            f"{{% generation %}} marks {'present' if self.generation_marks else 'not needed'})",
        ]
        lines += [f"note: {n}" for n in self.notes]
        lines += [f"PROBLEM: {p}" for p in self.problems]
        lines.append(
            "verdict: " + ("artrl can train this model token-exactly" if self.ok else "NOT trainable as is")
        )
        return "\n".join(lines)


def check_template(fmt: ChatFormat, model: str, kwargs: dict[str, Any] | None = None) -> TemplateReport:
    kwargs = kwargs or {}
    tokenizer = fmt.tokenizer
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    report = TemplateReport(
        model=model,
        family=fmt.family.name,
        detected_by=fmt.detected_by,
        stop_tokens=sorted(fmt.token_text(i) for i in fmt.stop_ids),
        template_variables=sorted(
            fmt.variables - {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"}
        ),
        generation_marks="generation" in template and "endgeneration" in template,
    )
    if not fmt.stop_ids:
        report.problems.append("no stop token: set eos_token or generation_config.eos_token_id")
    if fmt.family.name == "plain":
        report.notes.append("no known tool-call format: outputs are returned as content")
    messages = probe_conversation(fmt.reasoning)
    try:
        try:
            _round_trips(fmt, report, messages, kwargs)
        except UnrenderableTurnError:
            if not fmt.reasoning:
                raise
            report.notes.append("with these template variables the model does not reason (thinking is off)")
            messages = probe_conversation(False)
            _round_trips(fmt, report, messages, kwargs)
        turns = simulate_turns(fmt, messages, PROBE_TOOLS, kwargs)
    except (TemplateRenderError, UnrenderableTurnError) as exc:
        report.problems.append(str(exc))
        return report
    report.turn_sources = [t.source for t in turns]
    report.continues_after_tool_results = all(t.source == "continuation" for t in turns[1:3])
    report.continues_after_user_turn = turns[3].source == "continuation"
    report.rows_per_trajectory = len(rows_from_calls([(t.prompt_ids, t.sampled_ids, None) for t in turns], 0))
    report.sft_turns = True
    if not report.continues_after_tool_results or not report.continues_after_user_turn:
        report.notes.append(
            "the template re-renders history at some turns: those calls are rendered afresh and training "
            "rows fork there (still token-exact)"
        )
    return report


def _round_trips(fmt: ChatFormat, report: TemplateReport, messages: list[dict], kwargs: dict) -> None:
    """Render the probe's first call (and its reasoning) as the model writes it; parse it back."""
    prompt = fmt.render(messages[:2], PROBE_TOOLS, True, kwargs)
    span = assistant_span(fmt, messages, 2, PROBE_TOOLS, kwargs, prompt)
    if _PROBE_KEY not in span:
        report.tool_call_round_trip = None
        report.notes.append("the template does not render tool calls")
    else:
        parser = fmt.output_parser(prompt, PROBE_TOOLS, {"lookup"})
        decoded = fmt.tokenizer.decode(fmt.encode(span, start=False), skip_special_tokens=False)
        parser.feed(decoded)
        parser.finish()
        want = json.loads(messages[2]["tool_calls"][0]["function"]["arguments"])
        got = [(c.name, json.loads(c.arguments)) for c in parser.calls]
        report.tool_call_round_trip = got == [("lookup", want)]
        if not report.tool_call_round_trip:
            report.problems.append(f"a rendered tool call parses back as {got} (content {parser.content!r})")
        if fmt.reasoning and messages[2].get("reasoning_content"):
            report.reasoning_round_trip = parser.reasoning == messages[2].get("reasoning_content")
            if not report.reasoning_round_trip:
                report.notes.append(f"reasoning parses back as {parser.reasoning!r}")
    if response_template(fmt.family.name) is not None:
        report.tool_choice_prefix = fmt.tool_call_prefix(messages[:2], PROBE_TOOLS, kwargs, None)


_PROBE_KEY = "alpha"
