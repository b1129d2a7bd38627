"""A synthetic inbox, generated offline and deterministically, in SQLite with FTS5; the agent's two tools; and
questions with known answers and the message that holds each one.

Ordinary mail (meetings, newsletters, reminders, replies in threads) between people of one company, and among
it *fact* messages, each the source of one question:

- easy: the question names something only its message mentions, and searching that finds it first —
  an invoice's payment date, a flight's departure time, a project's approved budget;
- hard: the first hit is not the answer. A lab's door code was set three times, and the question asks for
  the one set on a given date (the hits come newest first, so the agent must match the date); a budget was
  proposed, then revised in a reply, and the question asks for the first proposal (the revision comes first).

Every fact message holds other values beside the answer (an amount, a gate, last year's budget, the old code),
so an answer that pastes the message holds a value that is not the answer.

Train and validation inboxes are built from disjoint pools (`POOLS`): different people, cities, projects,
labs, invoice and flight numbers, and message ids (random `m` + 5 digits, the digits' sum even in one, odd in
the other), so no fact, name or id is shared.
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import random
import sqlite3
from dataclasses import asdict, dataclass, replace
from pathlib import Path

FIRST = ["ana", "ben", "chloe", "dev", "elif", "femi", "greta", "hiro", "ines", "jon", "kira", "luis"]
FIRST += ["maya", "nils", "olga", "pablo", "quinn", "rosa", "sami", "tara", "umar", "vera", "wen", "yara"]
LAST = ["berg", "costa", "diaz", "eriksen", "fischer", "garcia", "haddad", "ito", "jensen", "kowalski"]
LAST += ["lind", "moreau", "novak", "okafor", "park", "quist", "rossi", "sato", "tanaka", "weber"]
CITIES = ["Oslo", "Lisbon", "Tokyo", "Nairobi", "Lima", "Seoul", "Dublin", "Quito", "Riga", "Perth"]
CITIES += ["Cairo", "Hanoi", "Porto", "Bergen", "Denver", "Accra", "Kyoto", "Malmo", "Turin", "Zagreb"]
PROJECTS = ["Aurora", "Basalt", "Cobalt", "Dune", "Ember", "Fjord", "Granite", "Harbor", "Iris", "Juniper"]
PROJECTS += ["Kestrel", "Lumen", "Meadow", "Nimbus", "Onyx", "Prism", "Quartz", "Raven", "Sierra", "Tundra"]


@dataclass(frozen=True)
class Pool:
    """What one split's inboxes are made of (the two splits' pools share nothing)."""

    id_parity: int  # message ids: "m" and 5 digits whose sum has this parity
    first: tuple[str, ...]
    last: tuple[str, ...]
    cities: tuple[str, ...]
    projects: tuple[str, ...]
    numbers: tuple[int, ...]  # invoice, flight and lab numbers


def _half(items: list[str], k: int) -> tuple[str, ...]:
    return tuple(items[k::2])


def _numbers(parity: int) -> tuple[int, ...]:
    """1000..9999 whose digits sum to `parity` mod 2: both halves span every leading digit."""
    return tuple(n for n in range(1000, 10000) if sum(map(int, str(n))) % 2 == parity)


POOLS = {
    split: Pool(k, _half(FIRST, k), _half(LAST, k), _half(CITIES, k), _half(PROJECTS, k), _numbers(k))
    for split, k in (("train", 0), ("val", 1))
}
START = dt.date(2024, 1, 1)
FILLER_SUBJECTS = [
    "Lunch on Friday?",
    "Weekly newsletter",
    "Reminder: timesheets",
    "Parking changes",
    "Team offsite ideas",
    "Printer on floor 3",
    "Holiday schedule",
    "IT maintenance",
]
FILLER_LINES = [
    "Let me know what works for you.",
    "Thanks for the quick turnaround.",
    "See the notes from last week.",
    "Please review before Thursday.",
    "Happy to help if needed.",
    "We moved the sync to next week.",
    "Can we talk about this tomorrow?",
]
MESSAGES_PER_QUESTION = 25


@dataclass(frozen=True)
class Question:
    id: str
    question: str
    answer: str
    source_id: str  # the message that holds the answer
    kind: str  # "easy" or "hard"
    search: str  # the words that find the source (the scripted agent's right search)


def generate(
    split: str = "train", n_messages: int = 2000, seed: int = 0
) -> tuple[list[dict], list[Question]]:
    """The inbox's messages (oldest first) and its questions; the same arguments give the same inbox."""
    pool = POOLS[split]
    rng = random.Random(f"{split}-{seed}")
    messages: list[dict] = []
    questions: list[Question] = []
    numbers = rng.sample(pool.numbers, len(pool.numbers))  # each number names one thing in this inbox

    def person() -> str:
        return f"{rng.choice(pool.first)}.{rng.choice(pool.last)}@acme.example"

    def add(subject: str, body: str, day: int, sender: str | None = None, to: str | None = None) -> str:
        mid = f"tmp{len(messages)}"
        date = (START + dt.timedelta(days=day)).isoformat()
        messages.append(
            {"id": mid, "sender": sender or person(), "to": to or person(), "date": date}
            | {"subject": subject, "body": f"{body} {rng.choice(FILLER_LINES)}"}
        )
        return mid

    def question(text: str, answer: str, source: str, kind: str, search: str) -> None:
        questions.append(Question(f"{split}{seed}-q{len(questions)}", text, answer, source, kind, search))

    for k in range(max(4, n_messages // MESSAGES_PER_QUESTION)):
        day, number = rng.randrange(300), numbers.pop()
        kind = k % 5
        if kind == 0:  # easy: an invoice's payment date
            paid = (START + dt.timedelta(days=day)).isoformat()
            amount = f"${rng.randrange(1, 10)},{rng.randrange(100, 1000)}"
            mid = add(f"Invoice {number}", f"Invoice {number} was paid on {paid} (amount {amount}).", day)
            question(f"When was invoice {number} paid?", paid, mid, "easy", f"invoice {number}")
        elif kind == 1:  # easy: a flight's time
            city, time = (
                rng.choice(pool.cities),
                f"{rng.randrange(5, 22):02d}:{rng.choice([0, 15, 30, 45]):02d}",
            )
            body = f"Booked: flight {number} to {city} leaves at {time} from gate {rng.randrange(2, 60)}."
            mid = add(f"Trip to {city}", body, day)
            question(
                f"What time does flight {number} to {city} leave?", time, mid, "easy", f"flight {number}"
            )
        elif kind == 2:  # easy: a project's budget
            project, budget = f"project {number}", f"${rng.randrange(5, 95)},000"
            before = f"${rng.randrange(5, 95)},500"
            body = f"The approved budget for {project} is {budget}, up from {before} last year."
            mid = add(f"Budget for {project} ({rng.choice(pool.projects)})", body, day)
            question(f"What is the approved budget for {project}?", budget, mid, "easy", project)
        elif kind == 3:  # hard: the code set on a given date (not the newest: the first hit is wrong)
            codes = rng.sample(range(10000, 100000), 4)
            ids = [
                add(
                    f"New code for lab {number}",
                    f"The code for lab {number} is now {code} (was {old}).",
                    day + 15 * i,
                )
                for i, (old, code) in enumerate(itertools.pairwise(codes))
            ]
            codes = codes[1:]
            i = rng.randrange(2)  # the oldest or the middle one
            date = messages[-3 + i]["date"]
            text = f"On {date}, what code was set for lab {number}?"
            question(text, str(codes[i]), ids[i], "hard", f"lab {number}")
        else:  # hard: a budget proposed, then revised in a reply; asked: the first proposal
            project = f"project {number}"
            proposed, revised = (f"${v},000" for v in rng.sample(range(5, 95), 2))
            a, b = person(), person()
            subject = f"Proposal for {project} ({rng.choice(pool.projects)})"
            travel = f"${rng.randrange(1, 5)},000"
            body = f"We propose a budget of {proposed} for {project}, with {travel} of it for travel."
            mid = add(subject, body, day, a, b)
            add(f"Re: {subject}", f"Revised budget: {project} gets {revised} instead.", day + 3, b, a)
            question(f"What budget was first proposed for {project}?", proposed, mid, "hard", project)
    while len(messages) < n_messages:  # ordinary mail, some of it in threads
        subject, day, sender, to = rng.choice(FILLER_SUBJECTS), rng.randrange(330), person(), person()
        body = " ".join(rng.sample(FILLER_LINES, 2))
        add(subject, body, day, sender, to)
        if rng.random() < 0.3 and len(messages) < n_messages:
            add(f"Re: {subject}", rng.choice(FILLER_LINES), day + rng.randrange(1, 4), to, sender)
    # random ids (nothing in an id tells a fact, a date or a position), each split's from its own half
    ordered = sorted(messages, key=lambda m: (m["date"], int(m["id"][3:])))
    ids = [i for i in range(100000) if sum(map(int, f"{i:05d}")) % 2 == pool.id_parity]
    new_ids = {m["id"]: f"m{i:05d}" for m, i in zip(ordered, rng.sample(ids, len(ordered)), strict=True)}
    for m in ordered:
        m["id"] = new_ids[m["id"]]
    return ordered, [replace(q, source_id=new_ids[q.source_id]) for q in questions]


def build(path: str | Path, split: str = "train", n_messages: int = 2000, seed: int = 0) -> list[Question]:
    """Write the inbox to a SQLite file with an FTS5 index (rebuilt each time: deterministic); its questions."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    messages, questions = generate(split, n_messages, seed)
    db = sqlite3.connect(tmp)
    with db:
        db.execute(
            "CREATE TABLE messages (id TEXT PRIMARY KEY, sender TEXT, recipient TEXT, date TEXT, subject TEXT, body TEXT)"
        )
        db.execute("CREATE VIRTUAL TABLE search USING fts5(id UNINDEXED, subject, body)")
        for m in messages:
            row = (m["id"], m["sender"], m["to"], m["date"], m["subject"], m["body"])
            db.execute("INSERT INTO messages VALUES (?, ?, ?, ?, ?, ?)", row)
            db.execute("INSERT INTO search VALUES (?, ?, ?)", (m["id"], m["subject"], m["body"]))
    db.close()
    tmp.replace(path)
    path.with_suffix(".questions.json").write_text(json.dumps([asdict(q) for q in questions], indent=1))
    return questions


class Inbox:
    """The agent's tools over one inbox file (read-only)."""

    def __init__(self, path: str | Path, hits: int = 3) -> None:
        self.db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)
        self.hits = hits

    def search_inbox(self, keywords: str) -> list[dict]:
        """Messages whose subject or body hold every keyword, newest first, at most `hits` of them."""
        terms = "".join(c if c.isalnum() or c in "-$," else " " for c in keywords).split()
        if not terms:
            return []
        query = " ".join('"' + t + '"' for t in terms)
        try:
            rows = self.db.execute(
                "SELECT m.id, m.date, m.subject FROM search JOIN messages m ON m.id = search.id "
                "WHERE search MATCH ? ORDER BY m.date DESC, m.id DESC LIMIT ?",
                (query, self.hits),
            ).fetchall()
        except sqlite3.OperationalError:  # a query FTS5 cannot parse matches nothing
            return []
        return [{"id": r[0], "date": r[1], "subject": r[2]} for r in rows]

    def read_email(self, message_id: str) -> dict | None:
        row = self.db.execute(
            "SELECT id, date, sender, subject, body FROM messages WHERE id = ?", (message_id,)
        ).fetchone()
        return None if row is None else dict(zip(("id", "date", "from", "subject", "body"), row, strict=True))

    def close(self) -> None:
        self.db.close()


def load_questions(path: str | Path) -> list[Question]:
    return [Question(**q) for q in json.loads(Path(path).with_suffix(".questions.json").read_text())]
