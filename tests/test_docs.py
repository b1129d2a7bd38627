"""The README stays short and every page it points to, and every relative link in the docs, exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "examples" / "README.md"]


def test_the_readme_is_at_most_150_lines():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert broken == []


def test_every_docs_page_is_reachable_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    assert [p.name for p in (ROOT / "docs").glob("*.md") if f"docs/{p.name}" not in readme] == []


def test_every_benchmark_script_starts():
    """The benchmarks share benchmarks/harness.py; each script still imports and parses its arguments."""
    import subprocess
    import sys

    for script in [*sorted((ROOT / "benchmarks").glob("bench_*.py")), ROOT / "benchmarks" / "gpu_check.py"]:
        done = subprocess.run(
            [sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, (script.name, done.stderr[-2000:])
        assert len(script.read_text().splitlines()) <= 450, script.name
