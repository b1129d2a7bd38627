"""`LocalBackend`: serve and train models on this machine, in this process or in a child process."""

from artrl.local.backend.local_backend import CheckpointError, LocalBackend

__all__ = ["CheckpointError", "LocalBackend"]
