"""The house plan, checked from the source: the light package pulls nothing heavy at import time, and every
import (lazy ones included) points to the same layer or a lower one (design.md §4)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).parent.parent / "src"
HEAVY = (
    *("torch", "transformers", "peft", "fastapi", "uvicorn", "trl", "artrl.local"),
    *("wandb", "tensorboard", "trackio"),  # experiment trackers: imported only when a model reports to them
)

# layer of each module (a package's modules share its layer unless listed); imports may only point down
LAYERS: dict[str, int] = {
    "artrl.trajectory": 0,
    "artrl.config": 0,
    "artrl.canonical": 0,
    "artrl.art_names": 0,  # ART's names for artrl's settings (pure translation)
    "artrl.random_ids": 0,  # unique ids without a system call each (stdlib)
    "artrl.storage": 1,
    "artrl.retry": 1,
    "artrl.dataset": 1,
    "artrl.capture_histories": 1,
    "artrl.model": 1,
    "artrl.prompted_model": 1,  # artrl.Model: a prompted model on any OpenAI-compatible endpoint
    "artrl.capturing": 1,
    "artrl.gather": 1,
    "artrl.rewards": 1,
    "artrl.mcp_tools": 1,
    "artrl.langchain_model": 1,
    "artrl.retention": 1,
    "artrl.trackers": 1,
    "artrl.history_table": 1,
    "artrl.local.chat_template": 2,
    "artrl.local.sampling": 2,
    "artrl.local.engine": 2,
    "artrl.local.advantages": 2,
    "artrl.local.loss": 2,
    "artrl.local.pack": 2,
    "artrl.local.chat_format": 2,
    "artrl.local.rows": 2,
    "artrl.local.run_folder": 2,  # a saved run read back (model.json, checkpoints): stdlib + storage
    "artrl.local.loading": 3,
    "artrl.local.tiny_model": 3,
    "artrl.local.batch": 3,
    "artrl.local.trainer": 3,
    "artrl.local.trainer_rank": 3,  # one FSDP2 trainer process (started by trainer_ranks)
    "artrl.local.trainer_ranks": 3,  # the trainer processes, seen from the main process
    "artrl.local.row_shards": 2,  # which rows each trainer rank trains
    "artrl.local.engine_hf": 3,
    "artrl.local.running_batch": 2,  # the running batch's prefill and decode steps (engine_hf's)
    "artrl.local.kv_cache": 2,
    "artrl.local.prefix_cache": 2,
    "artrl.local.cpu_attention": 2,  # an attention function registered with transformers
    "artrl.local.chunked_attention": 2,  # the training attention: one autograd function (pure torch)
    "artrl.local.merged_lora": 2,  # inference weights with the LoRA folded in
    "artrl.local.fused_decode": 2,  # the decode step without the module tree
    "artrl.local.scripted_layers": 2,  # its layers as TorchScript functions (pure torch)
    "artrl.local.fused_lora": 2,  # LoRA linears trained through one autograd function each
    "artrl.local.fused_norm": 2,  # RMS norms trained through one autograd function each
    "artrl.local.logprobs": 2,  # the trainer's forward: logprobs at trainable positions, shared prompts
    "artrl.local.idle_thread": 2,  # an executor whose one thread ends when idle (stdlib)
    "artrl.local.in_process": 2,  # an httpx transport to the gateway in the same process
    "artrl.local.engine_vllm": 3,
    "artrl.local.vllm_server": 3,
    "artrl.local.vllm_replicas": 3,  # the servers behind one gateway, what they must serve
    "artrl.local.vllm_supervisor": 3,  # a replica's state; the thread that keeps them alive
    "artrl.local.vllm_completions": 3,  # vLLM's /v1/completions on the wire
    "artrl.local.replica_router": 2,  # which replica serves a request, from token ids (pure)
    "artrl.local.server": 3,
    "artrl.local.gateway": 3,
    "artrl.local.family_models": 3,
    "artrl.local.hf_export": 3,
    "artrl.local.template_check": 4,
    "artrl.local.service": 4,
    "artrl.local.checkpoints": 4,
    "artrl.local.serve_run": 4,
    "artrl.local.row_renderer": 4,  # train_sft's rows rendered in worker processes too
    "artrl.local.render_worker": 2,  # one such worker process (rows through the chat template)
    "artrl.local.backend": 5,
    "artrl.local.service_child": 5,  # the service process of LocalBackend(in_process=False): a LocalBackend
    "artrl.local.service_process": 4,  # that process, seen from the user's (pipes, frames; no torch)
    "artrl.local.step_commits": 4,  # a trained step's checkpoint, weights to the engine, history row
    "artrl.local.shielded": 2,
    "artrl.local.piped_process": 2,  # a `python -m` child over two pipes of pickles (stdlib)
    "artrl.local.torch_threads": 2,  # torch's thread count: the default, set back by threads that train  # work a cancelled caller still waits for (stdlib)
    "artrl.tiny": 5,
    "artrl.cli": 5,
    "artrl.local.dashboard": 5,  # a local web app over run folders (fastapi, uvicorn, a tokenizer)
    "artrl": 6,  # the package's __init__: re-exports
}


def modules() -> dict[str, Path]:
    out = {}
    for path in (SRC / "artrl").rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def layer(module: str) -> int | None:
    while module:
        if module in LAYERS:
            return LAYERS[module]
        module = module.rpartition(".")[0]
    return None


def imports(path: Path, module_level_only: bool) -> list[tuple[str, int]]:
    """(imported module, line) of a file; with module_level_only, the imports that run at import time."""
    tree = ast.parse(path.read_text())
    found = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue  # annotations only
            inside = top and not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            if isinstance(child, ast.Import):
                found.extend(
                    (alias.name, child.lineno) for alias in child.names if top or not module_level_only
                )
            elif (
                isinstance(child, ast.ImportFrom)
                and child.module
                and child.level == 0
                and (top or not module_level_only)
            ):
                found.append((child.module, child.lineno))
            if inside or not module_level_only:
                visit(child, inside)

    visit(tree, True)
    return found


def test_every_module_has_a_layer():
    assert [m for m in modules() if layer(m) is None] == []


def test_the_light_package_imports_nothing_heavy_at_import_time():
    light = {m: p for m, p in modules().items() if not m.startswith("artrl.local")}
    offending = [
        f"{p.relative_to(SRC)}:{line} imports {name}"
        for m, p in light.items()
        for name, line in imports(p, module_level_only=True)
        if name.startswith(HEAVY)
    ]
    assert offending == []


def test_imports_point_down_only():
    offending = []
    for module, path in modules().items():
        for name, line in imports(path, module_level_only=False):
            if name.startswith("artrl") and (layer(name) or 0) > (layer(module) or 0):
                offending.append(
                    f"{path.relative_to(SRC)}:{line} ({layer(module)}) imports {name} ({layer(name)})"
                )
    assert offending == []


def test_no_import_cycle():
    """No two modules import each other, however indirectly (lazy imports included, annotations not)."""
    known = modules()

    def target(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    graph = {
        m: {t for name, _ in imports(p, module_level_only=False) if (t := target(name)) and t != m}
        for m, p in known.items()
        if m != "artrl"  # the package's __init__ re-exports everything: an edge into it is not a cycle
    }
    graph = {m: {t for t in targets if t != "artrl"} for m, targets in graph.items()}
    cycles, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []
