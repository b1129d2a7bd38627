"""The house plan, read from the tree (docs/design-notes.md): the light package pulls nothing heavy at import
time, and in every folder the parts (its modules and subfolders) import one another without a cycle, so
each folder's parts stack in layers that the imports themselves define. No list of layers is kept by hand:
a new module joins the layer its imports give it, and the test fails on the import that closes a loop."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).parent.parent / "src"
HEAVY = (
    *("torch", "transformers", "peft", "fastapi", "uvicorn", "trl", "artrl.local"),
    *("wandb", "tensorboard", "trackio"),  # experiment trackers: imported only when a model reports to them
)
MAX_MODULES_PER_FOLDER = 15
NEVER = {  # parts that must not know each other in either direction: the service wires them
    ("artrl.local.gateway", "artrl.local.train"),
    ("artrl.local.engine", "artrl.local.train"),
}


def modules() -> dict[str, Path]:
    """Every module by dotted name; a package is named by its folder (its __init__.py)."""
    out = {}
    for path in (SRC / "artrl").rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


KNOWN = modules()
PACKAGES = {m for m, p in KNOWN.items() if p.name == "__init__.py"}


def resolve(name: str) -> str | None:
    """The module an imported name loads: the longest known prefix (`pkg.mod.Class` -> `pkg.mod`)."""
    while name and name not in KNOWN:
        name = name.rpartition(".")[0]
    return name or None


def imports(path: Path, module_level_only: bool) -> list[tuple[str, int]]:
    """(imported name, line) of a file, `from a import b` giving `a.b`; with module_level_only, only the
    imports that run at import time. Imports under `if TYPE_CHECKING:` are annotations and never count."""
    tree = ast.parse(path.read_text())
    found = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            inside = top and not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            if top or not module_level_only:
                if isinstance(child, ast.Import):
                    found.extend((alias.name, child.lineno) for alias in child.names)
                elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                    found.extend((f"{child.module}.{alias.name}", child.lineno) for alias in child.names)
            if inside or not module_level_only:
                visit(child, inside)

    visit(tree, True)
    return found


def package_of(module: str) -> str:
    return module if module in PACKAGES else module.rpartition(".")[0]


def part_edges() -> tuple[dict[str, dict[str, set[str]]], list[str]]:
    """For each folder, which of its parts import which (lazy imports included), and the imports that
    reach back into an enclosing package's own __init__ (a part leaning on the facade above it)."""
    edges: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    back = []
    for module, path in KNOWN.items():
        for name, line in imports(path, module_level_only=False):
            target = resolve(name) if name.startswith("artrl") else None
            if target is None or target == module:
                continue
            if target in PACKAGES and (package_of(module) + ".").startswith(target + "."):
                if module != "artrl":
                    back.append(f"{path.relative_to(SRC)}:{line} imports {target}, a package it is inside")
                continue
            a, b = module.split("."), target.split(".")
            common = 0
            while common < min(len(a), len(b)) and a[common] == b[common]:
                common += 1
            if common == len(a):  # a package's __init__ importing its own parts: it sits above them
                continue
            folder = ".".join(a[:common])
            edges[folder][".".join(a[: common + 1])].add(".".join(b[: common + 1]))
    return edges, back


def cycles_in(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def layers(folder: str) -> list[list[str]]:
    """A folder's parts bottom-up: each layer imports only the layers below it (for reading the plan:
    `python -c "from tests.test_import_boundaries import layers; print(layers('artrl.local'))"`)."""
    graph = part_edges()[0][folder]
    parts = {m for m in KNOWN if m.rpartition(".")[0] == folder and m != folder}
    placed: list[list[str]] = []
    done: set[str] = set()
    while parts - done:
        layer = sorted(p for p in parts - done if graph.get(p, set()) <= done)
        assert layer, f"a cycle among {sorted(parts - done)}"
        placed.append(layer)
        done |= set(layer)
    return placed


def test_the_light_package_imports_nothing_heavy_at_import_time():
    offending = [
        f"{p.relative_to(SRC)}:{line} imports {name}"
        for m, p in KNOWN.items()
        if not m.startswith("artrl.local")
        for name, line in imports(p, module_level_only=True)
        if name.startswith(HEAVY)
    ]
    assert offending == []


def test_no_folder_has_a_cycle_among_its_parts():
    """Modules of one folder, and the subfolders of one folder taken whole: an import from a lower part
    back up to a higher one closes a loop here, whichever module it is written in."""
    edges, _ = part_edges()
    assert {folder: c for folder, graph in edges.items() if (c := cycles_in(graph))} == {}


def test_no_part_imports_the_package_it_is_inside():
    assert part_edges()[1] == []


def test_the_service_wires_parts_that_never_meet():
    edges, _ = part_edges()
    meeting = [
        (a, b)
        for a, b in NEVER
        for x, y in ((a, b), (b, a))
        if y in edges[x.rpartition(".")[0]].get(x, set())
    ]
    assert meeting == []


def test_every_folder_is_small_and_says_what_it_holds():
    sizes = {p: sum(1 for m in KNOWN if m.rpartition(".")[0] == p and m not in PACKAGES) for p in PACKAGES}
    assert {p: n for p, n in sizes.items() if n > MAX_MODULES_PER_FOLDER} == {}
    assert [p for p in PACKAGES if not ast.get_docstring(ast.parse(KNOWN[p].read_text()))] == []


def test_the_checks_catch_a_loop_and_a_back_import():
    assert cycles_in({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles_in({"a": {"b"}, "b": set()}) == []
    floors = {part: i for i, layer in enumerate(layers("artrl.local")) for part in layer}
    assert floors["artrl.local.backend"] > floors["artrl.local.service"] > floors["artrl.local.engine"]
