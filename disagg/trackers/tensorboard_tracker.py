"""TensorBoard events in ``<run_dir>/tensorboard`` (``logging.backends`` entry ``tensorboard``)."""

from __future__ import annotations

from pathlib import Path


class TensorBoardTracker:
    name = "tensorboard"
    replaces_steps = True  # purge_step hides the events of steps after the checkpoint resumed from

    def __init__(self, run_dir: Path, resume_step: int | None):
        from torch.utils.tensorboard import SummaryWriter

        purge = resume_step + 1 if resume_step is not None else None
        self._writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=purge)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            self._writer.add_scalar(k, v, step)

    def close(self, failed: bool) -> None:
        self._writer.close()
