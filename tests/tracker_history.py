"""Read back what the trackers recorded, as a person would see it in their UIs: the history of a
wandb offline run (its ``.wandb`` files) and an MLflow run's metric history."""

from __future__ import annotations

import json
import struct
from pathlib import Path


def _wandb_records(path: Path):
    """The protobuf records of a ``.wandb`` file: a 7-byte header (":W&B", id, version), then
    LevelDB-log framing (32 KiB blocks; records of crc32, length, type: full/first/middle/last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    pos, part, block = 7, b"", 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # the rest of a block is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        part += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full, last
            rec = pb.Record()
            rec.ParseFromString(part)
            part = b""
            yield rec


def wandb_history(wandb_dir: Path, run_id: str) -> dict[int, dict[str, float]]:
    """step -> {metric: value} over every offline segment of run ``run_id`` under ``wandb_dir``
    (a resumed run writes a new ``offline-run-<time>-<id>`` directory with the same id)."""
    history: dict[int, dict[str, float]] = {}
    files = sorted(Path(wandb_dir).glob(f"wandb/offline-run-*-{run_id}*/run-{run_id}.wandb"))
    assert files, f"no offline wandb run {run_id} under {wandb_dir}"
    for f in files:
        for rec in _wandb_records(f):
            if rec.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                step = int(items.pop("_step"))
                assert step not in history, f"step {step} logged twice to wandb run {run_id}"
                history[step] = {k: v for k, v in items.items() if not k.startswith("_")}
    return history


def wandb_config(wandb_dir: Path, run_id: str) -> dict:
    """The config of the first segment of wandb run ``run_id``."""
    f = min(Path(wandb_dir).glob(f"wandb/offline-run-*-{run_id}*/run-{run_id}.wandb"))
    for rec in _wandb_records(f):
        if rec.WhichOneof("record_type") == "run":
            return {i.key: json.loads(i.value_json) for i in rec.run.config.update}
    raise AssertionError(f"no run record in {f}")


def mlflow_history(uri: str, run_id: str, key: str) -> dict[int, float]:
    """step -> value of metric ``key``; a step logged twice fails."""
    from mlflow import MlflowClient

    out: dict[int, float] = {}
    for m in MlflowClient(uri).get_metric_history(run_id, key):
        assert m.step not in out, f"step {m.step} of {key} logged twice to mlflow run {run_id}"
        out[m.step] = m.value
    return out
