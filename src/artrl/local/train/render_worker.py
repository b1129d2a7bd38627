"""The process a `RowRenderer` starts (it runs `main()`): it turns chunks of trajectories into training rows,
turn by turn through the chat template, beside the process that trains.

Requests on stdin, one pickle each: (format key, the pickled ChatFormat or None when this process has it
already, trajectories, index of the first, template kwargs). Replies on the original stdout, one pickle
each: ("ok", rows of each trajectory, ""), ("error", the exception, its traceback) or ("no format", None, why). Whatever a library prints goes to stderr.
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback


def main() -> None:
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # (a library that prints must not corrupt the replies)
    sys.stdout = sys.stderr
    requests = sys.stdin.buffer
    from artrl.local.train.rows import trajectory_rows

    chat_format, format_key = None, None
    while True:
        try:
            key, blob, trajectories, start, kwargs = pickle.load(requests)
        except EOFError:  # (the renderer closed: the backend is closing)
            return
        reply = _answer(trajectory_rows, key, blob, trajectories, start, kwargs, (chat_format, format_key))
        if reply[0] != "no format" and blob is not None:
            chat_format, format_key = reply[3], key
        replies.write(_pickled(reply[:3]))
        replies.flush()


def _answer(trajectory_rows, key, blob, trajectories, start, kwargs, held) -> tuple:
    """(status, value, detail, the chat format used): "ok" with the rows, "error" with the exception and its
    traceback, or "no format" when the chat format does not load here (a tokenizer class this process
    cannot import)."""
    chat_format, format_key = held
    if blob is not None:
        try:
            chat_format, format_key = pickle.loads(blob), key
        except Exception as exc:
            return ("no format", None, f"{type(exc).__name__}: {exc}", None)
    if format_key != key:
        return ("no format", None, "the renderer sent no chat format for this call", None)
    try:
        rows = [trajectory_rows(t, start + i, chat_format, True, kwargs) for i, t in enumerate(trajectories)]
        return ("ok", rows, "", chat_format)
    except Exception as exc:
        return ("error", exc, traceback.format_exc(), chat_format)


def _pickled(reply: tuple) -> bytes:
    try:
        return pickle.dumps(reply)
    except Exception:  # (an exception that does not pickle: its text)
        status, value, detail = reply
        return pickle.dumps((status, RuntimeError(f"{type(value).__name__}: {value}"), detail))


if __name__ == "__main__":
    main()
