"""What the ``auto`` settings of a ``Config`` become on this machine: the bundles' device, the transport backend."""

from __future__ import annotations

from disagg.config.schema import Config
from disagg.errors import ConfigError


def resolve_device(cfg: Config) -> str:
    """'cpu' or 'cuda' for this run's bundles; a ConfigError where ``rollout.engine`` cannot run on it
    (before Ray starts: every run resolves its device first)."""
    device = cfg.cluster.device if cfg.cluster.device != "auto" else _detect_device()
    if device == "cpu" and cfg.rollout.engine == "sglang":
        raise ConfigError(f"rollout.engine='sglang' with cluster.device={cfg.cluster.device!r} resolved to 'cpu': "
                          "SGLang publishes no CPU build; run it on GPUs (or use rollout.engine=vllm)")
    return device


def _detect_device() -> str:
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


def shares_gpus(cfg: Config) -> bool:
    """Whether trainer and engine bundles ask for fractions of a GPU (so that they may share one)."""
    return cfg.trainer.gpus_per_worker < 1 or cfg.rollout.gpus_per_engine < 1


def resolve_backend(cfg: Config, device: str) -> str:
    if cfg.transport.load == "direct" and device != "cuda":
        raise ConfigError("transport.load='direct' needs cluster.device=cuda (CPU linear layers repack their "
                          "weights: vLLM's layerwise reload must load them); use 'auto' or 'layerwise'")
    if cfg.transport.backend != "auto":
        if cfg.transport.backend == "nccl" and device != "cuda":
            raise ConfigError("transport.backend='nccl' needs cluster.device=cuda; use 'gloo' on CPU")
        return cfg.transport.backend
    return "nccl" if device == "cuda" and not shares_gpus(cfg) else "gloo"
