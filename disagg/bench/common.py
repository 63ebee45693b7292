"""What the benchmarks share: the device a run asks for, the GPU presets, the machine's name (the
composed config is ``disagg.config.files.compose_train``). Pure or nearly (``machine`` and
``visible_gpus`` ask torch)."""

from __future__ import annotations

import os


def bench_device(requested: str, gpus: int) -> str:
    """``--device`` (cpu, cuda or auto) resolved for ``gpus`` visible GPUs; ValueError names a bad one."""
    device = requested
    if device == "auto":
        device = "cuda" if gpus else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu, cuda or auto, got {requested!r}")
    if device == "cuda" and not gpus:
        raise ValueError("--device cuda: this process sees no GPU")
    return device


def gpu_overrides(overrides: tuple[str, ...] | list[str], gpus: int) -> tuple[str, ...]:
    """``overrides`` with, unless they pick them, ``shape=qwen2.5-0.5b`` and ``cluster=gpu`` (2+ GPUs:
    NCCL) or ``cluster=one_gpu`` (both sides on one GPU, gloo) in front: a bench's run on cuda."""
    out = list(overrides)
    keys = {o.lstrip("+~").split("=", 1)[0] for o in out}
    if "shape" not in keys:
        out.insert(0, "shape=qwen2.5-0.5b")
    if "cluster" not in keys:
        out.insert(0, "cluster=gpu" if gpus >= 2 else "cluster=one_gpu")
    return tuple(out)


def machine(device: str) -> str:
    """The machine a report was measured on, in words."""
    if device == "cuda":
        import torch

        n = torch.cuda.device_count()
        return f"{n} x {torch.cuda.get_device_name(0)}"
    return f"{os.cpu_count()} CPUs"


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
