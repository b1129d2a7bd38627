"""The process a `RowRenderer` starts (`python -m artrl.local.render_worker`): it turns chunks of trajectories
into training rows, turn by turn through the chat template, beside the process that trains.

Requests on stdin, one pickle each: (format key, the pickled ChatFormat or None when this process has it
already, trajectories, index of the first, template kwargs). Replies on the original stdout, one pickle
each: ("ok", rows of each trajectory) or ("error", the exception). Whatever a library prints goes to stderr.
"""

from __future__ import annotations

import os
import pickle
import sys


def main() -> None:
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # (a library that prints must not corrupt the replies)
    sys.stdout = sys.stderr
    requests = sys.stdin.buffer
    from artrl.local.rows import trajectory_rows

    chat_format, format_key = None, None
    while True:
        try:
            key, blob, trajectories, start, kwargs = pickle.load(requests)
        except EOFError:  # (the renderer closed: the backend is closing)
            return
        try:
            if blob is not None:
                chat_format, format_key = pickle.loads(blob), key
            if format_key != key:
                raise RuntimeError("the row renderer sent no chat format for this call")
            rows = [
                trajectory_rows(t, start + i, chat_format, True, kwargs) for i, t in enumerate(trajectories)
            ]
            reply = pickle.dumps(("ok", rows))
        except Exception as exc:
            try:
                reply = pickle.dumps(("error", exc))
            except Exception:  # (an exception that does not pickle: its text)
                reply = pickle.dumps(("error", RuntimeError(f"{type(exc).__name__}: {exc}")))
        replies.write(reply)
        replies.flush()


if __name__ == "__main__":
    main()
