"""Typed configuration. Every default of the framework lives in this package (one module per layer:
engines, gateway, training, tiny_models; all of them re-exported here).

Configs are frozen pydantic models: a knob that is not declared here does not exist, and a typo in a
keyword argument is an error, not a silently ignored setting.
"""

from __future__ import annotations

from artrl.config.engines import EngineConfig, LoadConfig, VLLMConfig
from artrl.config.gateway import ClientConfig, DashboardConfig, GatewayConfig, is_loopback
from artrl.config.server import RemoteConfig, ServerConfig
from artrl.config.tiny_models import TINY_MODEL_PRESETS, TinyModelConfig
from artrl.config.training import (
    CheckpointRetention,
    LoraConfig,
    SFTConfig,
    TrackerName,
    TrainConfig,
    TrainerConfig,
)

__all__ = [
    "TINY_MODEL_PRESETS",
    "CheckpointRetention",
    "ClientConfig",
    "DashboardConfig",
    "EngineConfig",
    "GatewayConfig",
    "LoadConfig",
    "LoraConfig",
    "RemoteConfig",
    "SFTConfig",
    "ServerConfig",
    "TinyModelConfig",
    "TrackerName",
    "TrainConfig",
    "TrainerConfig",
    "VLLMConfig",
    "is_loopback",
]
