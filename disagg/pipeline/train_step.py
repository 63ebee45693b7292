"""``TrainStep``: the train step in flight, its owner.

It holds the step's record from the batch to the trainer's answer, the trainer's refs, and which of
them the loop has already seen finish (``SeenRefs``).
"""

from __future__ import annotations

import time

from disagg.pipeline.fleet import SeenRefs, all_done, brief
from disagg.pipeline.recorder import StepRecord
from disagg.samples import TrainSample


class TrainStep:
    """The train step running on the trainer, if any (``record``), and its refs."""

    def __init__(self, job) -> None:
        self.job = job
        self.record: StepRecord | None = None
        self.refs: list | None = None
        self._seen = SeenRefs()

    @property
    def running(self) -> bool:
        return self.record is not None

    def start(self, record: StepRecord, samples: list[TrainSample], snapshot_version: int | None) -> None:
        """Send ``samples`` to the trainer as ``record``'s step (``snapshot_version``: TrainerGroup.train_step)."""
        self.record = record
        self.refs = self.job.trainer.train_step_async(samples, snapshot_version)

    def waiting_refs(self) -> list:
        """The step's refs the loop still waits on."""
        return self._seen.waiting(self.refs or ())

    def noticed(self, ready: list) -> None:
        """``ready`` came back from the loop's wait: its refs of this step are finished."""
        self._seen.noticed(self.refs or (), ready)

    def done(self, ready: list) -> bool:
        return self.refs is not None and all_done(self.refs, ready)

    def finish(self) -> StepRecord:
        """The finished step's record, with the trainer's figures; a trainer worker that died is a
        ``RolloutError`` that says how to resume."""
        import ray

        from disagg.errors import RolloutError

        record = self.record
        try:
            record.train = self.job.trainer.summarise(ray.get(self.refs))
        except ray.exceptions.RayActorError as e:
            raise RolloutError(f"a trainer worker died during train step {record.step}: {brief(e)}; continue from "
                               f"the last checkpoint with `disagg train resume={self.job.run_dir}`") from e
        record.t_train_done = time.perf_counter()
        self.record, self.refs = None, None
        self._seen.clear()
        return record
