"""trl's chat and response templates read as data (trl_data.py): the cached values are trl's own, a later process
reads them without importing trl, and a cache that cannot be used only costs the import."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from artrl.local.chat_format import trl_data
from artrl.local.chat_format.families import TRL_NAMES as NAMES

READ = """
import json, sys
from artrl.local.chat_format.trl_data import trl_values
values = trl_values(tuple(json.loads(sys.argv[1])))
print(json.dumps({"trl_imported": "trl.chat_template_utils" in sys.modules, "values": values}))
"""


def read_in_a_process(cache) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", READ, json.dumps(list(NAMES))],
        env={**os.environ, "ARTRL_CACHE_DIR": str(cache)},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(done.stdout)


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    monkeypatch.setenv("ARTRL_CACHE_DIR", str(tmp_path / "cache"))
    trl_data.trl_values.cache_clear()
    yield tmp_path / "cache"
    trl_data.trl_values.cache_clear()


def test_the_values_are_trls_own_and_a_later_process_reads_them_without_trl(fresh):
    import trl.chat_template_utils as trl_templates

    own = {name: getattr(trl_templates, name) for name in NAMES}
    assert trl_data.trl_values(NAMES) == own  # read from trl, and written
    (kept,) = (fresh / "trl-templates").glob("*.json")
    assert json.loads(kept.read_text()) == own
    later = read_in_a_process(fresh)
    assert later == {"trl_imported": False, "values": own}


def test_a_name_the_cache_lacks_is_read_from_trl_and_kept(fresh):
    first, other = NAMES[:2], NAMES[2:3]
    assert set(trl_data.trl_values(first)) == set(first)
    (kept,) = (fresh / "trl-templates").glob("*.json")
    assert set(json.loads(kept.read_text())) == set(first)
    trl_data.trl_values.cache_clear()
    assert set(trl_data.trl_values(other)) == set(other)
    assert set(json.loads(kept.read_text())) == {*first, *other}  # (added to what was kept)


def test_an_unusable_cache_only_costs_the_import(fresh, tmp_path):
    import trl.chat_template_utils as trl_templates

    fresh.parent.mkdir(parents=True, exist_ok=True)
    fresh.write_text("a file where the cache folder would be")  # (cannot be made: the values come from trl)
    assert trl_data.trl_values(NAMES[:1]) == {NAMES[0]: getattr(trl_templates, NAMES[0])}
    fresh.unlink()
    trl_data.trl_values.cache_clear()
    trl_data.trl_values(NAMES[:1])
    (kept,) = (fresh / "trl-templates").glob("*.json")
    kept.write_text('{"truncated')  # a damaged file: read from trl again and written whole
    trl_data.trl_values.cache_clear()
    assert trl_data.trl_values(NAMES[:1]) == {NAMES[0]: getattr(trl_templates, NAMES[0])}
    assert json.loads(kept.read_text()) == {NAMES[0]: getattr(trl_templates, NAMES[0])}
    assert not list(kept.parent.glob("*.tmp"))


def test_the_key_follows_transformers_version(fresh, monkeypatch):
    """trl's module checks transformers' version: another version is another cache file."""
    import transformers

    key = trl_data._trl_key()
    monkeypatch.setattr(transformers, "__version__", "0.0.1")
    assert trl_data._trl_key() not in {None, key}


def test_no_home_folder_only_costs_the_import(monkeypatch):
    """A service whose user has no home folder (HOME unset, no passwd entry) still reads trl's templates."""
    import trl.chat_template_utils as trl_templates

    def no_home() -> None:
        raise RuntimeError("Could not determine home directory.")

    for variable in ("ARTRL_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(trl_data.Path, "home", staticmethod(no_home))
    trl_data.trl_values.cache_clear()
    try:
        assert trl_data.trl_values(NAMES[:1]) == {NAMES[0]: getattr(trl_templates, NAMES[0])}
    finally:
        trl_data.trl_values.cache_clear()
