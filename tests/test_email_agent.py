"""The email agent example (examples/email_agent): its inbox is deterministic and searchable, its tools
answer clearly, its reward adds up, and the whole loop runs on the tiny model (smoke)."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).parent.parent / "examples" / "email_agent"
sys.path.insert(0, str(EXAMPLE))

from inbox import Inbox, build  # noqa: E402
from train import expert, run_tool, score  # noqa: E402


def test_the_inbox_is_deterministic_and_every_easy_answer_is_found(tmp_path):
    first, second = build(tmp_path / "a.sqlite", 600, seed=3), build(tmp_path / "b.sqlite", 600, seed=3)
    assert first == second and {q.split for q in first} == {"easy", "hard"}
    dump = [
        sqlite3.connect(tmp_path / f).execute("SELECT * FROM messages ORDER BY id").fetchall()
        for f in ("a.sqlite", "b.sqlite")
    ]
    assert dump[0] == dump[1] and len(dump[0]) == 600
    inbox = Inbox(tmp_path / "a.sqlite")
    for q in first:
        body = inbox.read_email(q.source_id)["body"]
        assert q.answer in body
        if q.split == "easy":
            _, metrics = expert(inbox, q)
            assert metrics["correct"] == 1.0 and metrics["cited"] == 1.0, q


def test_tools_answer_clearly_and_the_reward_adds_up(tmp_path):
    questions = build(tmp_path / "i.sqlite", 300, seed=0)
    inbox = Inbox(tmp_path / "i.sqlite")
    q = questions[0]
    hits = json.loads(run_tool(inbox, "search_inbox", json.dumps({"keywords": q.question}))[0])
    assert isinstance(hits, list)
    assert run_tool(inbox, "read_email", '{"message_id": "nope"}')[0] == '"no such message"'
    assert run_tool(inbox, "search_inbox", "{not json")[0].startswith("error:")
    assert run_tool(inbox, "search_inbox", "{}")[0].startswith("error:")
    result, final = run_tool(
        inbox, "final_answer", json.dumps({"answer": q.answer, "source_id": q.source_id})
    )
    assert result == "ok" and score(q, final, 3)[0] == pytest.approx(1.0 + 0.1 - 0.06)
    assert score(q, None, 6)[0] == pytest.approx(-0.12)


@pytest.mark.slow
def test_the_smoke_run_trains_and_prints_the_table(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            str(EXAMPLE / "train.py"),
            "--out",
            str(tmp_path / "out"),
            "--messages",
            "600",
            "--steps",
            "1",
            "--groups",
            "2",
            "--group-size",
            "2",
            "--val-size",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| scripted expert | 1.00 | 1.00 |" in done.stdout and "(step 1)" in done.stdout
    history = tmp_path / "out" / "runs" / "email" / "email-agent" / "history.jsonl"
    assert [json.loads(line)["split"] for line in history.read_text().splitlines()] == ["train"]
