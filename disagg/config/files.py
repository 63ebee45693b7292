"""Where the Hydra configs are, and ``configs/train.yaml`` composed as ``disagg train`` composes it.

The one place the CLI and the benchmarks take them from (neither imports the other for it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_PACKAGE = Path(__file__).resolve().parent.parent
_PACKAGED_CONFIGS = _PACKAGE / "configs"  # in an installed wheel (setup.py copies them)
CONFIG_DIR = _PACKAGED_CONFIGS if _PACKAGED_CONFIGS.is_dir() else _PACKAGE.parent / "configs"
"""The Hydra configs: the wheel's copy, else the checkout's ``configs/`` (editable install, source tree)."""


def compose_train(overrides: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """``configs/train.yaml`` composed with ``overrides`` (key=value, presets such as ``shape=...``), as
    ``disagg train`` composes it, as a plain dict without Hydra's own section."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        dc = compose(config_name="train", overrides=list(overrides))
    data = OmegaConf.to_container(dc, resolve=False)
    data.pop("hydra", None)
    return data
