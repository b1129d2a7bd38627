"""The tiny family models the tests run on (artrl.local.families.family_models), shipped in tests/family_models
as FAMILY-KEY folders, as a test suite elsewhere downloads tiny fixture models from a hub: built once, they are
the same on every machine, so no test depends on how this machine's floats train them (CI built all seven
before every run: ~35 s each on a core). KEY hashes what a build depends on: the family's spec, its chat template
(trl's), family_models.py and the tiny shape.

    python tests/family_fixtures.py [FAMILY ...]   # build them anew (all by default), one thread each

tests/local/families/test_family_fixtures.py fails while a shipped folder is not its family's KEY."""

from __future__ import annotations

import hashlib
import inspect
import json
import shutil
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

SHIPPED = Path(__file__).parent / "family_models"


def fixture_key(family: str) -> str:
    import trl.chat_template_utils as trl_templates

    from artrl.config import TINY_MODEL_PRESETS
    from artrl.local.families import family_models

    spec = family_models.FAMILY_MODELS[family]
    parts = [
        family,
        repr(spec),
        getattr(trl_templates, spec.chat_template),  # (a trl that changes it: the fixture is built again)
        inspect.getsource(family_models),
        TINY_MODEL_PRESETS["tiny"].model_dump(),
    ]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:12]


def shipped_folder(family: str) -> Path:
    """Where the family's fixture is when it is today's (else the tests build it: see conftest's family_dirs)."""
    return SHIPPED / f"{family}-{fixture_key(family)}"


def _build(family: str) -> str:
    import torch

    from artrl.local.families.family_models import build_family_model

    torch.set_num_threads(1)  # (the same build whatever the machine's core count)
    folder = shipped_folder(family)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    build_family_model(tmp, family).rename(folder)
    return folder.name


def main(families: list[str]) -> None:
    from artrl.local.families.family_models import FAMILY_MODELS

    families = families or list(FAMILY_MODELS)
    SHIPPED.mkdir(exist_ok=True)
    for old in SHIPPED.iterdir():  # this family's other keys
        if (
            old.name.rsplit("-", 1)[0] in families
            and old.name != shipped_folder(old.name.rsplit("-", 1)[0]).name
        ):
            shutil.rmtree(old)
    todo = [f for f in families if not shipped_folder(f).exists()]
    with ProcessPoolExecutor(max_workers=2) as pool:
        for name in pool.map(_build, todo):
            print(f"built {SHIPPED / name}")


if __name__ == "__main__":
    main(sys.argv[1:])
