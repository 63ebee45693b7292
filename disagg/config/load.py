"""Plain dict (hydra's composed YAML) -> ``Config``: every value type-checked against the schema.

A wrong type, an unknown key or a value outside a ``Literal`` raises a ``ConfigError``
naming the dotted key; the cross-field checks then run in ``checks.validate``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal

from disagg.config.checks import validate
from disagg.config.schema import Config
from disagg.errors import ConfigError


def _coerce(key: str, tp: Any, value: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(key, a, value)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}={value!r}: invalid value")
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={value!r}: expected a mapping")
        key_tp, value_tp = typing.get_args(tp)
        return {_coerce(key, key_tp, k): _coerce(f"{key}.{k}", value_tp, v) for k, v in value.items()}
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r}: must be one of {list(allowed)}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            if isinstance(value, str) and typing.get_args(tp)[-1] is Ellipsis:
                value = [value]
            else:
                raise ConfigError(f"{key}={value!r}: expected a list")
        args = typing.get_args(tp)
        if args and args[-1] is Ellipsis:
            return tuple(_coerce(f"{key}[{i}]", args[0], v) for i, v in enumerate(value))
        if len(args) != len(value):
            raise ConfigError(f"{key}={value!r}: expected {len(args)} values")
        return tuple(_coerce(f"{key}[{i}]", a, v) for i, (a, v) in enumerate(zip(args, value)))
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}={value!r}: expected true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}={value!r}: expected an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}={value!r}: expected a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}={value!r}: expected a string")
        return value
    if tp is Any:
        return value
    raise ConfigError(f"{key}: unsupported config type {tp}")


RENAMED_KEYS = {
    "logging.tensorboard": "logging.tensorboard was replaced by logging.backends, a list of jsonl, tensorboard, "
                           "wandb, mlflow (default [jsonl,tensorboard]; logging.backends=[jsonl] turns TensorBoard off)",
}
"""Keys that were replaced -> the message that names the new key."""


def _build(cls: type, data: Any, prefix: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}={data!r}: expected a mapping")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        where = f"{prefix}." if prefix else ""
        if f"{where}{unknown[0]}" in RENAMED_KEYS:
            raise ConfigError(RENAMED_KEYS[f"{where}{unknown[0]}"])
        raise ConfigError(f"unknown config key {where}{unknown[0]} (known under {prefix or 'root'}: {sorted(names)})")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            key = f"{prefix}.{f.name}" if prefix else f.name
            kwargs[f.name] = _coerce(key, hints[f.name], data[f.name])
    return cls(**kwargs)


def load_config(data: dict[str, Any] | None, *, check: bool = True, mode: str = "train") -> Config:
    """Build the validated Config from a plain dict (e.g. ``OmegaConf.to_container``)."""
    data = dict(data or {})
    data.pop("hydra", None)
    if mode == "generate":
        data["rollout"] = {**(data.get("rollout") or {}), "load_format": "auto"}
    cfg = _with_engine_defaults(_build(Config, data, ""))
    return validate(cfg, mode) if check else cfg


def _with_engine_defaults(cfg: Config) -> Config:
    """``rollout.openai_api`` left null: on where the engine serves one behind the weights gate (vLLM)."""
    if cfg.rollout.openai_api is not None:
        return cfg
    return dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, openai_api=cfg.rollout.engine == "vllm"))
