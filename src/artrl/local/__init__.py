"""Heavy parts of artrl (torch, transformers, fastapi). Import explicitly; `import artrl` never does."""


def __getattr__(name: str):
    """`from artrl.local import LocalBackend` (where ART keeps its `LocalBackend`) without loading the rest."""
    if name in ("LocalBackend", "CheckpointError"):
        from artrl.local.backend import local_backend as backend

        return getattr(backend, name)
    raise AttributeError(f"module 'artrl.local' has no attribute {name!r}")
