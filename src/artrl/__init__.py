"""artrl: reinforcement learning for multi-turn, tool-using LLM agents.

`import artrl` is light (no torch): agent code imports it freely. The engine, gateway and trainer live in
`artrl.local` and load when a model is registered with a `LocalBackend`.
"""

from importlib.metadata import version as _version
from typing import TYPE_CHECKING

from artrl import rewards
from artrl.capturing.block import Capture, CaptureError, capture
from artrl.config import (
    CheckpointRetention,
    ClientConfig,
    DashboardConfig,
    EngineConfig,
    GatewayConfig,
    LoadConfig,
    LoraConfig,
    SFTConfig,
    TinyModelConfig,
    TrainConfig,
    TrainerConfig,
    VLLMConfig,
)
from artrl.integrations.langchain_model import langchain_chat_model
from artrl.integrations.mcp_tools import MCPTools
from artrl.model import TrainableModel, TrainResult
from artrl.prompted_model import Model
from artrl.remote.backend import RemoteBackend, RemoteError
from artrl.rollouts.concurrency import limit_concurrency
from artrl.rollouts.dataset import DatasetBatch, iterate_dataset
from artrl.rollouts.gather import GatherError, gather_trajectories, gather_trajectory_groups
from artrl.rollouts.pipeline import rollouts_ahead
from artrl.rollouts.recording import current_trajectory, trajectory, trajectory_group
from artrl.rollouts.retry import retry
from artrl.tiny import build_tiny_model, ensure_tiny_model
from artrl.trajectory import (
    History,
    Messages,
    MessagesAndChoices,
    PendingGroup,
    Tools,
    Trajectory,
    TrajectoryGroup,
)

__all__ = [
    "Capture",
    "CaptureError",
    "CheckpointError",
    "CheckpointRetention",
    "ClientConfig",
    "DashboardConfig",
    "DatasetBatch",
    "EngineConfig",
    "GatewayConfig",
    "GatherError",
    "History",
    "LoRAConfig",
    "LoadConfig",
    "LocalBackend",
    "LoraConfig",
    "MCPTools",
    "Messages",
    "MessagesAndChoices",
    "Model",
    "PendingGroup",
    "RemoteBackend",
    "RemoteError",
    "SFTConfig",
    "TinyModelConfig",
    "Tools",
    "TrainConfig",
    "TrainResult",
    "TrainSFTConfig",
    "TrainableModel",
    "TrainerConfig",
    "TrainerRanksError",
    "Trajectory",
    "TrajectoryGroup",
    "VLLMConfig",
    "build_tiny_model",
    "capture",
    "current_trajectory",
    "ensure_tiny_model",
    "gather_trajectories",
    "gather_trajectory_groups",
    "iterate_dataset",
    "langchain_chat_model",
    "limit_concurrency",
    "retry",
    "rewards",
    "rollouts_ahead",
    "trajectory",
    "trajectory_group",
]
# ART's names of the same configs (`art.LoRAConfig`, `art.TrainSFTConfig`: code written for ART runs as is)
LoRAConfig = LoraConfig
TrainSFTConfig = SFTConfig

if TYPE_CHECKING:  # for type checkers and IDEs; at run time see __getattr__ below
    from artrl.local.backend.local_backend import CheckpointError, LocalBackend
    from artrl.local.train.ranks.trainer_ranks import TrainerRanksError

__version__ = _version("artrl")


def __getattr__(name: str):
    """`artrl.LocalBackend` and `artrl.CheckpointError` live with the rest of the local wiring, in
    `artrl.local.backend.local_backend`; they are imported on first use (still without torch: that loads on `register`)."""
    if name in ("LocalBackend", "CheckpointError"):
        from artrl.local.backend import local_backend as backend

        return getattr(backend, name)
    if name == "TrainerRanksError":  # (raised by a train call when a trainer rank fails; imports torch)
        from artrl.local.train.ranks import trainer_ranks

        return trainer_ranks.TrainerRanksError
    raise AttributeError(f"module 'artrl' has no attribute {name!r}")
