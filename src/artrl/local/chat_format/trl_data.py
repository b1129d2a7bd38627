"""Values of `trl.chat_template_utils` (real chat templates, response templates) read as data, kept on disk per
installed version.

Importing `trl.chat_template_utils` costs ~1-3 s in a process that already has torch and transformers (it
imports trl.data_utils, hence datasets and pandas), and every process that serves a model needs its values. They
are plain strings and JSON-shaped dicts, but computed by Python that checks transformers' version, so they are
read from trl once for each (trl's files, transformers' version) and kept as JSON under $ARTRL_CACHE_DIR
(default: $XDG_CACHE_HOME/artrl or ~/.cache/artrl); later processes read the file. A cache that cannot be read or
written is only a slower start: the values then come from trl itself."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from functools import cache
from pathlib import Path
from typing import Any

from artrl.storage import atomic_write_json

logger = logging.getLogger(__name__)
CACHE_DIR_VARIABLE = "ARTRL_CACHE_DIR"


def cache_dir() -> Path:
    """Where artrl keeps what it derives from installed packages: $ARTRL_CACHE_DIR, else $XDG_CACHE_HOME/artrl,
    else ~/.cache/artrl."""
    if os.environ.get(CACHE_DIR_VARIABLE):
        return Path(os.environ[CACHE_DIR_VARIABLE])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "artrl"


def _trl_key() -> str | None:
    """A hash of what the values depend on: trl's chat_template_utils.py and chat_templates/ (their bytes) and
    transformers' version (the module's checks). None when trl's files cannot be found without importing it."""
    spec = importlib.util.find_spec("trl")  # (finds the package; runs none of its code)
    if spec is None or not spec.submodule_search_locations:
        return None
    package = Path(next(iter(spec.submodule_search_locations)))
    module = package / "chat_template_utils.py"
    if not module.is_file():
        return None
    import transformers  # (a service process has it already)

    digest = hashlib.sha256(f"transformers {transformers.__version__}\n".encode())
    for path in [module, *sorted((package / "chat_templates").glob("**/*"))]:
        if path.is_file():
            digest.update(f"{path.relative_to(package)}\n".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _from_trl(names: tuple[str, ...]) -> dict[str, Any]:
    import trl.chat_template_utils as trl_templates

    return {name: getattr(trl_templates, name) for name in names}


@cache
def trl_values(names: tuple[str, ...]) -> dict[str, Any]:
    """{name: value of trl.chat_template_utils.<name>} for these names, from the cache where it has them."""
    try:
        key = _trl_key()
        path = None if key is None else cache_dir() / "trl-templates" / f"{key}.json"
    except (OSError, RuntimeError) as exc:  # (trl's files unreadable; no home folder to keep a cache in)
        logger.debug("trl's templates not cached: %s", exc)
        path = None
    kept: dict[str, Any] = {}
    if path is not None:
        try:
            kept = json.loads(path.read_text())
            if all(name in kept for name in names):
                return {name: kept[name] for name in names}
        except (OSError, ValueError):
            kept = {}  # (none yet, or unreadable: read trl, and write it)
    values = _from_trl(names)
    if path is not None:
        _write(path, {**kept, **values})
    return values


def _write(path: Path, values: dict[str, Any]) -> None:
    """The values as JSON at `path`, whole or not at all (another process may be reading it)."""
    try:
        atomic_write_json(path, values)
    except (OSError, TypeError, ValueError) as exc:
        logger.debug("trl's templates not cached at %s: %s", path, exc)
