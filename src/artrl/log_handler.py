"""artrl's log lines where a program set up no logging: a model loading, vLLM starting (minutes, on a real
model), a replica restarted, a step whose rows were not written... would otherwise go nowhere (Python shows
only warnings without a handler, and without their logger's name).

`ensure_log_handler()` (called by the backends and the CLI) adds one stderr handler to the `artrl` logger, at
INFO, once, unless the program configured logging itself (the root logger has a handler: theirs wins) or
`ARTRL_LOG_LEVEL` says otherwise (`WARNING`, `DEBUG`, ..., or `off`: no handler, Python's default of bare
warnings)."""

from __future__ import annotations

import logging
import os

_added: logging.Handler | None = None


def ensure_log_handler() -> None:
    global _added
    logger = logging.getLogger("artrl")
    if _added is not None or logger.handlers or logging.getLogger().handlers:
        return
    level = os.environ.get("ARTRL_LOG_LEVEL", "INFO").strip().upper()
    if level in ("OFF", "NONE", "0"):
        return
    handler = logging.StreamHandler()  # (stderr)
    handler.setFormatter(logging.Formatter("artrl %(levelname)s %(asctime)s %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)
    _added = handler
    value = logging.getLevelName(level)  # (an int for a level's name)
    logger.setLevel(value if isinstance(value, int) else logging.INFO)
    if not isinstance(value, int):
        logger.warning("ARTRL_LOG_LEVEL=%r is not a level (DEBUG, INFO, WARNING, ERROR or off): INFO", level)
