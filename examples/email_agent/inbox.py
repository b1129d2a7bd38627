"""A synthetic inbox, generated offline and deterministically, in SQLite with FTS5; the agent's two tools; and
questions with known answers and the message that holds each answer.

Thousands of ordinary messages (meetings, newsletters, lunch, reminders, replies in threads) between a few
dozen people, and among them *fact* messages: a storage-room code, a flight time, a budget, a meeting room,
an invoice's payment date. Each fact gives a question whose answer is in exactly one message. Splits:

- `easy`: the question names something only its message mentions (an invoice number, a project name):
  one search finds it;
- `hard`: facts that changed (the storage code was reset twice; the question asks for the latest one), so
  the agent must compare dates, or narrow by sender.
"""

from __future__ import annotations

import datetime as dt
import json
import random
import sqlite3
from dataclasses import asdict, dataclass
from pathlib import Path

FIRST = [
    "Ana",
    "Ben",
    "Chloe",
    "Dev",
    "Elif",
    "Femi",
    "Greta",
    "Hiro",
    "Ines",
    "Jon",
    "Kira",
    "Luis",
    "Maya",
    "Nils",
]
LAST = [
    "Berg",
    "Costa",
    "Diaz",
    "Eriksen",
    "Fischer",
    "Garcia",
    "Haddad",
    "Ito",
    "Jensen",
    "Kowalski",
    "Lind",
]
CITIES = ["Oslo", "Lisbon", "Tokyo", "Nairobi", "Lima", "Seoul", "Dublin", "Quito", "Riga", "Perth"]
PROJECTS = ["Aurora", "Basalt", "Cobalt", "Dune", "Ember", "Fjord", "Granite", "Harbor", "Iris", "Juniper"]
FILLER_SUBJECTS = [
    "Lunch on Friday?",
    "Weekly newsletter",
    "Reminder: timesheets",
    "Parking changes",
    "Team offsite ideas",
    "Printer on floor 3",
    "Coffee machine",
    "Welcome our new colleague",
    "Holiday schedule",
    "IT maintenance",
]
FILLER_LINES = [
    "Let me know what works for you.",
    "Thanks for the quick turnaround.",
    "See the notes from last week.",
    "The agenda is attached.",
    "Please review before Thursday.",
    "Happy to help if needed.",
    "We moved the sync to next week.",
    "Great work on the launch, everyone.",
    "Can we talk about this tomorrow?",
]
START = dt.date(2024, 1, 1)


@dataclass(frozen=True)
class Question:
    id: str
    question: str
    answer: str
    source_id: str  # the message that holds the answer
    split: str  # "easy" or "hard"


def _person(rng: random.Random) -> str:
    return f"{rng.choice(FIRST).lower()}.{rng.choice(LAST).lower()}@acme.example"


def generate(n_messages: int = 3000, seed: int = 0) -> tuple[list[dict], list[Question]]:
    """The inbox's messages and the questions about them (the same arguments give the same inbox)."""
    rng = random.Random(seed)
    messages: list[dict] = []
    questions: list[Question] = []

    def add(sender: str, to: str, subject: str, body: str, day: int) -> str:
        mid = f"m{len(messages):05d}"
        date = (START + dt.timedelta(days=day)).isoformat()
        messages.append(
            {"id": mid, "sender": sender, "to": to, "date": date, "subject": subject, "body": body}
        )
        return mid

    facts = max(1, n_messages // 30)
    for k in range(facts):
        day, sender, to = rng.randrange(360), _person(rng), _person(rng)
        kind = k % 4
        if kind == 0:
            invoice, paid = f"INV-{rng.randrange(10000, 99999)}", (START + dt.timedelta(days=day)).isoformat()
            mid = add(
                sender,
                to,
                f"Invoice {invoice}",
                f"Invoice {invoice} was paid on {paid}. No action needed.",
                day,
            )
            questions.append(Question(f"q{k}", f"When was invoice {invoice} paid?", paid, mid, "easy"))
        elif kind == 1:
            city, time = rng.choice(CITIES), f"{rng.randrange(5, 22):02d}:{rng.choice([0, 15, 30, 45]):02d}"
            code = f"flight {rng.randrange(100, 999)}"
            body = f"Booked: our {code} to {city} leaves at {time}. Be at the gate early."
            mid = add(sender, to, f"Trip to {city} ({code})", body, day)
            questions.append(Question(f"q{k}", f"What time does {code} to {city} leave?", time, mid, "easy"))
        elif kind == 2:
            project, budget = rng.choice(PROJECTS) + f"-{k}", f"${rng.randrange(5, 95)},000"
            mid = add(sender, to, f"{project} budget", f"The approved budget for {project} is {budget}.", day)
            questions.append(
                Question(f"q{k}", f"What is the approved budget for {project}?", budget, mid, "easy")
            )
        else:  # a code reset several times: the question wants the latest
            room = f"lab {k}"
            codes = [str(rng.randrange(1000, 9999)) for _ in range(3)]
            ids = [
                add(sender, to, f"New code for {room}", f"The code for {room} is now {code}.", day + 20 * i)
                for i, code in enumerate(codes)
            ]
            question = f"What is the current code for {room}?"
            questions.append(Question(f"q{k}", question, codes[-1], ids[-1], "hard"))
    while len(messages) < n_messages:  # ordinary mail, some of it in threads
        subject, day = rng.choice(FILLER_SUBJECTS), rng.randrange(365)
        sender, to = _person(rng), _person(rng)
        body = " ".join(rng.sample(FILLER_LINES, 3))
        add(sender, to, subject, body, day)
        if rng.random() < 0.3 and len(messages) < n_messages:
            add(
                to,
                sender,
                f"Re: {subject}",
                f"{rng.choice(FILLER_LINES)}\n> {body}",
                day + rng.randrange(1, 4),
            )
    order = sorted(range(len(messages)), key=lambda i: (messages[i]["date"], messages[i]["id"]))
    return [messages[i] for i in order], questions


def build(path: str | Path, n_messages: int = 3000, seed: int = 0) -> list[Question]:
    """Write the inbox to a SQLite file with an FTS5 index (rebuilt each time: deterministic); its questions."""
    path = Path(path)
    path.unlink(missing_ok=True)
    messages, questions = generate(n_messages, seed)
    db = sqlite3.connect(path)
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
    path.with_suffix(".questions.json").write_text(json.dumps([asdict(q) for q in questions], indent=1))
    return questions


class Inbox:
    """The agent's tools over one inbox file (read-only)."""

    def __init__(self, path: str | Path) -> None:
        self.db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)

    def search_inbox(
        self,
        keywords: str,
        sender: str | None = None,
        to: str | None = None,
        after: str | None = None,
        before: str | None = None,
        limit: int = 5,
    ) -> list[dict]:
        """Messages matching all the keywords (subject or body), newest first within the best matches."""
        terms = [t for t in "".join(c if c.isalnum() or c in "-$," else " " for c in keywords).split() if t]
        if not terms:
            return []
        query = " ".join('"' + t.replace('"', "") + '"' for t in terms)
        sql = (
            "SELECT m.id, m.date, m.sender, m.subject FROM search JOIN messages m ON m.id = search.id "
            "WHERE search MATCH ?"
        )
        args: list = [query]
        for column, value, op in (
            ("m.sender", sender, "LIKE"),
            ("m.recipient", to, "LIKE"),
            ("m.date", after, ">="),
            ("m.date", before, "<="),
        ):
            if value:
                sql += f" AND {column} {op} ?"
                args.append(f"%{value}%" if op == "LIKE" else value)
        sql += " ORDER BY rank, m.date DESC LIMIT ?"
        rows = self.db.execute(sql, [*args, limit]).fetchall()
        return [{"id": r[0], "date": r[1], "from": r[2], "subject": r[3]} for r in rows]

    def read_email(self, message_id: str) -> dict | None:
        row = self.db.execute(
            "SELECT id, date, sender, recipient, subject, body FROM messages WHERE id = ?", (message_id,)
        ).fetchone()
        keys = ("id", "date", "from", "to", "subject", "body")
        return None if row is None else dict(zip(keys, row, strict=True))


def load_questions(path: str | Path) -> list[Question]:
    return [Question(**q) for q in json.loads(Path(path).with_suffix(".questions.json").read_text())]
