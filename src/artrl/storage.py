"""Where a model's files live on disk, and atomic writes (temp file + rename) for all of them.

{root}/{project}/{model}/model.json            config at register (secrets redacted)
{root}/{project}/{model}/.lock                 locked (flock) while a process has the model registered
{root}/{project}/{model}/checkpoints/{step:04d}/
{root}/{project}/{model}/history.jsonl
{root}/{project}/{model}/trajectories/{split}/{step:04d}.jsonl
{root}/{project}/{model}/trajectories/train/{step:04d}.rows.jsonl   what the step trained, token by token
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

LOCK_FILE = ".lock"


class FolderInUseError(RuntimeError):
    """Another process, or another backend of this one, has this model folder registered."""


class FolderLock:
    """An exclusive OS lock (`flock`) on a model folder's `.lock`, held from register until `release`. The OS
    drops it when the holder ends however it ends (SIGKILL too): no stale lock is ever left to remove. The
    file is never deleted (a lock file unlinked while another process opens it locks nothing)."""

    def __init__(self, fd: int | None) -> None:
        self._fd = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # (closing the only descriptor of the open file unlocks it)


def lock_model_dir(directory: Path) -> FolderLock:
    """The folder's lock, for as long as this process registers the model in it; `FolderInUseError`, saying
    who holds it, when another process (or another backend here) does. Two processes training one folder
    would share its temporary checkpoint folders, delete each other's checkpoints and record rows twice."""
    try:
        import fcntl
    except ImportError:  # (no flock on this OS: nothing to hold)
        return FolderLock(None)
    import datetime
    import errno
    import socket

    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)  # (not inherited by child processes)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _lock_holder(fd)
        os.close(fd)
        raise FolderInUseError(
            f"{directory} is in use by {holder}; close that process or use another path/name"
        ) from None
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):  # a filesystem without locks
            return FolderLock(None)
        raise
    except BaseException:
        os.close(fd)
        raise
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "started": started}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
    return FolderLock(fd)


def _lock_holder(fd: int) -> str:
    """Who holds the lock, as its holder wrote it: 'pid N (started ...)'."""
    import socket

    try:
        holder = json.loads(os.pread(fd, 4096, 0))
        pid, host, started = int(holder["pid"]), str(holder["host"]), str(holder["started"])
    except (OSError, ValueError, KeyError, TypeError):  # (being written this instant)
        return "another process"
    where = "" if host == socket.gethostname() else f" on host {host}"
    here = (
        ", this process: another LocalBackend has it registered" if pid == os.getpid() and not where else ""
    )
    return f"pid {pid}{where} (started {started}{here})"


def model_dir(root: str | os.PathLike[str], project: str, name: str) -> Path:
    return Path(root) / project / name


def fsync_path(path: Path) -> None:
    """Flush a file's or a directory's contents (a directory: the names in it) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_path(path.parent)  # the rename itself survives a power loss


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def checkpoint_steps(directory: Path) -> list[int]:
    """The complete checkpoints under `directory/checkpoints`, oldest first."""
    checkpoints = directory / "checkpoints"
    if not checkpoints.is_dir():
        return []
    return sorted(int(p.name) for p in checkpoints.iterdir() if p.is_dir() and p.name.isdigit())


def latest_step(directory: Path) -> int:
    """The highest complete checkpoint step under `directory/checkpoints` (0 if none)."""
    return max(checkpoint_steps(directory), default=0)


def delete_checkpoint(directory: Path, step: int) -> None:
    """Remove one checkpoint: renamed out of the step names first, so a crash mid-way never leaves a
    half-deleted folder that looks like a checkpoint."""
    import shutil

    final = checkpoint_dir(directory, step)
    doomed = final.parent / f".deleting-{step:04d}"
    shutil.rmtree(doomed, ignore_errors=True)
    os.replace(final, doomed)
    fsync_path(final.parent)
    shutil.rmtree(doomed, ignore_errors=True)


def checkpoint_dir(directory: Path, step: int) -> Path:
    return directory / "checkpoints" / f"{step:04d}"


def write_trajectories(directory: Path, split: str, step: int, groups: list[Any]) -> Path:
    """One JSON line per TrajectoryGroup, written atomically."""
    path = directory / "trajectories" / split / f"{step:04d}.jsonl"
    atomic_write_bytes(path, "".join(g.model_dump_json() + "\n" for g in groups).encode())
    return path


def rows_path(directory: Path, step: int) -> Path:
    return directory / "trajectories" / "train" / f"{step:04d}.rows.jsonl.gz"


def write_step_rows(directory: Path, step: int, records: list[dict[str, Any]]) -> Path:
    """What a training step trained, one gzipped JSON line per row, written atomically."""
    import gzip

    path = rows_path(directory, step)
    body = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records).encode()
    atomic_write_bytes(path, gzip.compress(body, compresslevel=5, mtime=0))
    return path


def read_step_rows(directory: Path, step: int) -> list[dict[str, Any]]:
    import gzip

    path = rows_path(directory, step)
    if not path.exists():
        return []
    return [json.loads(line) for line in gzip.decompress(path.read_bytes()).decode().splitlines() if line]


def append_history(directory: Path, row: dict[str, Any]) -> None:
    """Append one JSON line and fsync it; readers skip a line torn by a crash."""
    path = directory / "history.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    torn = path.exists() and path.stat().st_size > 0 and not path.read_bytes().endswith(b"\n")
    with open(path, "a", encoding="utf-8") as f:
        f.write(
            ("\n" if torn else "") + json.dumps(row, sort_keys=True) + "\n"
        )  # never glue onto a torn line
        f.flush()
        os.fsync(f.fileno())


def read_history(directory: Path) -> list[dict[str, Any]]:
    path = directory / "history.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line torn by a crash mid-write
    return rows


OLD_PREFIX = ".old-"  # `final` moved aside while publish_directory replaces it


def publish_directory(tmp: Path, final: Path) -> None:
    """Make a fully written temporary directory visible under its final name in one rename; its files, the
    directory and the rename are on disk before this returns (a crash or power loss at any instant leaves
    either the old state or the whole new directory). An existing `final` is moved aside to `.old-{name}`
    first and removed last: a crash between the two renames leaves it there, and
    `restore_interrupted_publishes` puts it back (deleting it first would lose it)."""
    import shutil

    _sync_tree(tmp)
    old = final.parent / f"{OLD_PREFIX}{final.name}"
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)  # (an earlier publish's: `final` is the newer copy)
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_path(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def publish_new_directory(tmp: Path, final: Path) -> None:
    """`publish_directory` where `final` must not hold anything: absent or an empty folder (removed first;
    rmdir itself refuses one that is not empty, so what another writer put there meanwhile stays)."""
    _sync_tree(tmp)
    if final.is_dir():
        final.rmdir()
    os.replace(tmp, final)
    fsync_path(final.parent)


def _sync_tree(tmp: Path) -> None:
    for file in tmp.rglob("*"):
        if file.is_file():
            fsync_path(file)
    fsync_path(tmp)


def restore_interrupted_publishes(directory: Path) -> list[Path]:
    """Put back what a crash inside `publish_directory` left moved aside (a checkpoint or the tokenizer
    whose replacement never landed) in the model folder `directory` and its checkpoints; returns the folders
    restored. Call it only where nothing publishes in that folder meanwhile (its lock held): a publish in
    flight has its `final` moved aside for an instant too."""
    import shutil

    restored = []
    for parent in (directory, directory / "checkpoints"):
        if not parent.is_dir():
            continue
        for old in sorted(parent.glob(f"{OLD_PREFIX}*")):
            final = parent / old.name.removeprefix(OLD_PREFIX)
            if final.exists():  # (the new copy landed: only the removal of the old one was cut off)
                shutil.rmtree(old, ignore_errors=True)
                continue
            os.replace(old, final)
            fsync_path(parent)
            restored.append(final)
    return restored


def repair_history(directory: Path) -> int:
    """Re-append the rows of checkpoints whose history line a crash cut off; returns how many."""
    have = {(row.get("step"), row.get("split")) for row in read_history(directory)}
    checkpoints = directory / "checkpoints"
    missing = []
    if checkpoints.is_dir():
        for folder in sorted(p for p in checkpoints.iterdir() if p.name.isdigit()):
            saved = folder / "history_row.json"
            if saved.exists():
                row = json.loads(saved.read_text())
                if (row.get("step"), row.get("split")) not in have:
                    missing.append(row)
    for row in missing:
        append_history(directory, row)
    return len(missing)


class OutputFolderError(ValueError):
    """An output folder that is not new or empty (writing there could overwrite a base model's files)."""


def prepare_output(out: str | os.PathLike[str]) -> Path:
    """`out` as a folder to create: refused (OutputFolderError) when something is there already."""
    path = Path(out)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise OutputFolderError(f"{path} exists and is not an empty folder; give a new output folder")
    if not path.parent.is_dir():
        raise OutputFolderError(
            f"{path.parent} does not exist; create it first or give another output folder"
        )
    return path
