"""The root config: frozen dataclasses validated once, at the entry point.

Hydra composes YAML from ``configs/``; ``load_config`` turns the result into
these dataclasses, type-checks every field and runs the cross-field checks, so
a bad value fails before any actor starts, with one ``ConfigError`` naming the
key and the value. Each actor then gets only its own sub-config.

``schema`` holds the dataclasses (every field and its default), ``load`` the
dict-to-dataclass conversion, ``checks`` the cross-field checks and ``resolve``
what ``auto`` settings become on this machine.
"""

from disagg.config.checks import validate
from disagg.config.load import RENAMED_KEYS, load_config
from disagg.config.resolve import resolve_backend, resolve_device, shares_gpus
from disagg.config.schema import (
    AgentConfig,
    AlgorithmConfig,
    ClusterConfig,
    Config,
    ControlConfig,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    TinyModelConfig,
    TrainerConfig,
    TransportConfig,
    WarmStartConfig,
)
from disagg.errors import ConfigError

__all__ = [
    "RENAMED_KEYS",
    "AgentConfig",
    "AlgorithmConfig",
    "ClusterConfig",
    "Config",
    "ConfigError",
    "ControlConfig",
    "DataConfig",
    "LoggingConfig",
    "ModelConfig",
    "RewardConfig",
    "RolloutConfig",
    "TinyModelConfig",
    "TrainerConfig",
    "TransportConfig",
    "WarmStartConfig",
    "load_config",
    "resolve_backend",
    "resolve_device",
    "shares_gpus",
    "validate",
]
