"""ART·E's data made offline, for the port of ART·E (examples/from_art/art_e) where the Hugging Face hub is out
of reach: artrl's synthetic inboxes (examples/email_agent/inbox.py) written as the two datasets ART·E loads,
with their columns: the emails of `corbt/enron-emails` and the questions of
`corbt/enron_emails_sample_questions` (ART·E's SyntheticQuery, a `train` and a `test` split, the test
questions from an inbox of other people, projects and numbers).

    python examples/from_art/art_e_data.py DIR [--messages 2000]

writes DIR/emails and DIR/questions; ART's code reads them, and builds its SQLite database from the emails,
when told where:

    ART_E_EMAILS=DIR/emails ART_E_QUESTIONS=DIR/questions ART_E_DB=DIR/enron_emails.db
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "email_agent"))
import inbox

FIRST_ID = 1000  # question ids (ART·E leaves out a few of its own below 400 as known bad)


def write(directory: str | Path, n_messages: int = 2000, seed: int = 0) -> dict[str, int]:
    """Write DIR/emails/train.parquet and DIR/questions/{train,test}.parquet (the same arguments, the same
    data); return how many questions each split has."""
    from datasets import Dataset, Features, Sequence, Value

    directory = Path(directory)
    emails, counts = [], {}
    next_id = FIRST_ID
    for split, art_split in (("train", "train"), ("val", "test")):
        messages, questions = inbox.generate(split, n_messages, seed)
        by_id = {m["id"]: m for m in messages}
        last_day = max(m["date"] for m in messages)
        emails += [
            {
                "message_id": m["id"],
                "subject": m["subject"],
                "from": m["sender"],
                "to": [m["to"]],
                "cc": [],
                "bcc": [],
                "date": dt.datetime.fromisoformat(m["date"]),
                "body": m["body"],
                "file_name": f"{art_split}/{m['id']}",
            }
            for m in messages
        ]
        rows = []
        for q in questions:
            rows.append(
                {
                    "id": next_id,
                    "question": q.question,
                    "answer": q.answer,
                    "message_ids": [q.source_id],
                    "how_realistic": 1.0,
                    "inbox_address": by_id[q.source_id]["to"],  # the user whose mail holds the answer
                    "query_date": last_day,
                }
            )
            next_id += 1
        (directory / "questions").mkdir(parents=True, exist_ok=True)
        Dataset.from_list(rows).to_parquet(directory / "questions" / f"{art_split}.parquet")
        counts[art_split] = len(rows)
    features = Features(
        {
            "message_id": Value("string"),
            "subject": Value("string"),
            "from": Value("string"),
            "to": Sequence(Value("string")),
            "cc": Sequence(Value("string")),
            "bcc": Sequence(Value("string")),
            "date": Value("timestamp[us]"),
            "body": Value("string"),
            "file_name": Value("string"),
        }
    )
    (directory / "emails").mkdir(parents=True, exist_ok=True)
    Dataset.from_list(emails, features=features).to_parquet(directory / "emails" / "train.parquet")
    return counts


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("directory")
    parser.add_argument("--messages", type=int, default=2000, help="messages in each split's inbox")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    counts = write(args.directory, args.messages, args.seed)
    print(f"wrote {args.directory}/emails and {args.directory}/questions ({counts})")
