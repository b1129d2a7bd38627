"""artrl's one progress facility: a long call's progress as a bar on stderr.

Every long call publishes snapshots `{"phase", "rows_done", "rows_total"}` (a training call's TrainProgress:
queued, training with rows done of its rows, saving); a `CallBar` shows them, whoever produced them: a local
model's trainer (read every `POLL_S` by `watched`) or a training server (its streamed progress lines, read by
RemoteBackend). Loading a model and starting vLLM report through the `artrl` logger instead (log_handler.py):
their length is not known in rows. Shown when asked, or by default when stderr is a terminal."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

POLL_S = 0.25


def progress_shown(setting: bool | None) -> bool:
    """A config's `progress` setting: True/False as given; None = $ARTRL_PROGRESS (0/1) if set, else whether
    stderr is a terminal (no bars in a CI log or a notebook's captured stream unless asked)."""
    if setting is not None:
        return setting
    env = os.environ.get("ARTRL_PROGRESS")
    if env is not None:
        return env.strip().lower() not in ("", "0", "false", "no", "off")
    return sys.stderr.isatty()


class CallBar:
    """One call's bar: its label says the phase, its count the rows trained of the call's rows."""

    def __init__(self, label: str, shown: bool) -> None:
        from tqdm import tqdm

        self.label = label
        self.bar = tqdm(desc=label, unit="row", disable=not shown, leave=False)

    def show(self, snapshot: dict[str, Any]) -> None:
        self.bar.set_description(f"{self.label} ({snapshot.get('phase')})", refresh=False)
        total = int(snapshot.get("rows_total") or 0)
        if total and self.bar.total != total:
            self.bar.reset(total=total)
        self.bar.n = int(snapshot.get("rows_done") or 0)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


@contextlib.asynccontextmanager
async def watched(label: str, snapshot: Callable[[], dict[str, Any]], shown: bool) -> AsyncIterator[None]:
    """A bar following `snapshot()` while the block runs (nothing at all when not shown)."""
    if not shown:
        yield
        return
    bar = CallBar(label, shown)

    async def follow() -> None:
        last = None
        while True:
            now = snapshot()
            if now != last:
                bar.show(now)
                last = now
            await asyncio.sleep(POLL_S)

    task = asyncio.create_task(follow())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        bar.show(snapshot())  # (where the call ended: however short it was, its rows are shown done)
        bar.close()
