"""The email agent's environment: its tools, one episode's state and its score, the agent (plain OpenAI-SDK
code), and a scripted agent whose transcripts make the warm start.

Reward (ART·E's shape): a correct answer scores 1 plus partial credit; partial credit is 0.1 each for
finding the source message in a search, reading it and citing it (at most 0.3, below any correct answer);
no answer scores the partial credit; a wrong answer scores it minus WRONG_ANSWER_PENALTY (below "I don't
know"); an episode ended by a call that does not parse scores it minus BROKEN_CALL_PENALTY (below a wrong
answer, as in ART·E: breaking the format is never a way out of answering). An answer is correct when it
holds the expected value and no other value (`is_correct`): pasting a message or every hit holds other
values, so it is never correct. The agent has MAX_CALLS model calls; an episode that runs out of calls or
outgrows the model's context ends and is scored as it stands.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass

import openai
from inbox import Inbox, Question

import artrl

MAX_CALLS = 5
WRONG_ANSWER_PENALTY = 0.2
BROKEN_CALL_PENALTY = 0.4
PARTIAL_CREDIT = 0.1
SYSTEM = (
    "You answer questions about the user's email inbox. Search it with search_inbox, read a message with "
    "read_email, and end with final_answer: the answer, and the id of the message it comes from."
)


def _tool(name: str, description: str, **args: str) -> dict:
    properties = {a: {"type": "string", "description": d} for a, d in args.items()}
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": list(args)},
        },
    }


TOOLS = [
    _tool("search_inbox", "Messages holding all the keywords, newest first.", keywords="words to find"),
    _tool("read_email", "Read one message.", message_id="its id"),
    _tool("final_answer", "Answer the question.", answer="the answer", source_id="the message it is from"),
]
# a value: a number, a date, a time, an amount (digits with , : - inside, a $ in front)
VALUE = re.compile(r"\$?\d(?:[\d,:-]*\d)?")


def values(text: str) -> list[str]:
    return VALUE.findall(text)


def is_correct(answer: str, question: Question) -> bool:
    """The answer holds the expected value, and every other value in it comes from the question."""
    named = set(values(question.question))
    found = values(answer)
    return question.answer in found and all(v == question.answer or v in named for v in found)


def answer_phrases(body: str, question: Question) -> list[str]:
    """The values of a message that the question does not name, each with the word before it as the message
    has it ("on 2024-07-29", "is $42,000"): in a source message the first is the answer (`inbox.py` writes
    it so), the others are the values beside it."""
    named = set(values(question.question))
    return [m.group(0) for m in re.finditer(rf"(\S+ )({VALUE.pattern})", body) if m.group(2) not in named]


@dataclass(frozen=True)
class Skill:
    """The scripted agent's chance of getting each decision right."""

    search: float  # search the question's key words (else a word of the question)
    read: float  # read the source among the hits (else another hit)
    answer: float  # answer with the message's first value (else another of its values)


@dataclass
class Episode:
    """One question's episode: the tool calls so far and what they achieved."""

    inbox: Inbox
    question: Question
    calls: int = 0
    found: bool = False  # a search listed the source message
    read: bool = False  # the agent read it
    answer: str | None = None
    source: str | None = None
    broken: bool = False  # the episode ended on a call that did not parse

    @property
    def done(self) -> bool:
        return self.answer is not None or self.calls >= MAX_CALLS

    def call(self, name: str, arguments: str) -> str:
        """Run one tool call; its result as the agent sees it (errors say what to do)."""
        try:
            args = json.loads(arguments)
        except json.JSONDecodeError:
            return json.dumps({"error": "the arguments must be a JSON object"})
        if not isinstance(args, dict):
            return json.dumps({"error": "the arguments must be a JSON object"})
        if name == "search_inbox":
            hits = self.inbox.search_inbox(str(args.get("keywords", "")))
            self.found |= any(h["id"] == self.question.source_id for h in hits)
            return json.dumps(hits)
        if name == "read_email":
            message_id = str(args.get("message_id", ""))
            message = self.inbox.read_email(message_id)
            if message is None:
                return json.dumps({"error": f"no message {message_id!r}; use an id from search_inbox"})
            self.read |= message_id == self.question.source_id
            return json.dumps(message)
        if name == "final_answer":
            self.answer, self.source = str(args.get("answer", "")), str(args.get("source_id", ""))
            return "ok"
        return json.dumps(
            {"error": f"no tool {name!r}; the tools are search_inbox, read_email, final_answer"}
        )

    def score(self) -> tuple[float, dict[str, float]]:
        cited = self.source == self.question.source_id
        partial = PARTIAL_CREDIT * (self.found + self.read + cited)
        correct = self.answer is not None and is_correct(self.answer, self.question)
        if self.answer is None:
            reward = partial - BROKEN_CALL_PENALTY * self.broken
        elif correct:
            reward = 1.0 + partial
        else:
            reward = partial - WRONG_ANSWER_PENALTY
        metrics = {"correct": correct, "cited": cited, "found": self.found, "read": self.read}
        metrics |= {"broken": self.broken}
        return reward, {k: float(v) for k, v in metrics.items()} | {
            "answered": float(self.answer is not None),
            "calls": float(self.calls),
        }


def start(question: Question) -> artrl.Trajectory:
    return artrl.Trajectory(
        messages_and_choices=[
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": question.question},
        ],
        tools=TOOLS,
        metadata={"question": question.id, "kind": question.kind},
    )


async def rollout(
    model: artrl.Model, inbox: Inbox, question: Question, seed: int, temperature: float = 1.0
) -> artrl.Trajectory:
    """The agent: ordinary OpenAI tool-calling code against the served model."""
    client = model.openai_client()
    traj = start(question)
    episode = Episode(inbox, question)
    while not episode.done:
        try:
            response = await client.chat.completions.create(
                model=model.get_inference_name(),
                messages=traj.messages(),
                tools=TOOLS,
                tool_choice="required",  # every turn is a tool call; the episode ends with final_answer
                max_tokens=48,
                temperature=temperature,
                seed=seed * 100 + episode.calls,
            )
        except openai.BadRequestError as exc:  # the episode outgrew the model's context: it ends, scored
            traj.metadata["ended"] = f"context: {exc.message[:120]}"
            break
        episode.calls += 1
        choice = response.choices[0]
        traj.messages_and_choices.append(choice)
        if not choice.message.tool_calls:
            traj.metadata["ended"] = "a call that did not parse"
            episode.broken = True
            break
        for call in choice.message.tool_calls:
            result = episode.call(call.function.name, call.function.arguments)
            traj.messages_and_choices.append({"role": "tool", "tool_call_id": call.id, "content": result})
            if episode.answer is not None:
                break
    traj.reward, traj.metrics = episode.score()
    return traj


def scripted_transcript(
    inbox: Inbox, question: Question, rng: random.Random, index: int, skill: Skill
) -> artrl.Trajectory:
    """A weak agent's transcript, for the warm start: well-formed calls, each decision right with its
    probability in `skill` — search the question's key words (else another word of the question), read the
    source among the hits (else another hit), answer with the message's first value (else another of its
    values) and cite the message read."""
    traj = start(question)
    episode = Episode(inbox, question)
    hits: list[dict] = []

    def act(name: str, arguments: dict) -> str:
        call_id = f"call_{index}_{episode.calls}"
        function = {"name": name, "arguments": json.dumps(arguments)}
        traj.messages_and_choices.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": call_id, "type": "function", "function": function}],
            }
        )
        episode.calls += 1
        result = episode.call(name, json.dumps(arguments))
        traj.messages_and_choices.append({"role": "tool", "tool_call_id": call_id, "content": result})
        return result

    key_words = question.search.lower().replace("-", " ").split()
    other_words = [w for w in re.findall(r"[A-Za-z]+", question.question) if w.lower() not in key_words]
    while not hits and episode.calls < MAX_CALLS - 2:
        keywords = question.search if rng.random() < skill.search else rng.choice(other_words).lower()
        hits = json.loads(act("search_inbox", {"keywords": keywords}))
    if hits:
        ids = [h["id"] for h in hits]
        right = question.source_id in ids and rng.random() < skill.read
        others = [i for i in ids if i != question.source_id] or ids
        chosen = question.source_id if right else rng.choice(others)
        phrases = answer_phrases(
            json.loads(act("read_email", {"message_id": chosen})).get("body", ""), question
        )
        answer = "I don't know"
        if phrases:
            answer = (
                phrases[0] if rng.random() < skill.answer or len(phrases) == 1 else rng.choice(phrases[1:])
            )
        act("final_answer", {"answer": answer, "source_id": chosen})
    traj.reward, traj.metrics = episode.score()
    return traj
