"""``TrainStep``: the train step in flight, its owner.

It holds the step's record from the batch to the trainer's answer, the trainer's refs, and which of
them the loop has already seen finish (a finished ref stays out of the loop's wait until its
siblings are done: ``ray.wait`` would return it at once and the driver would spin).
"""

from __future__ import annotations

import time

from disagg.pipeline.fleet import brief, is_done
from disagg.pipeline.recorder import StepRecord
from disagg.samples import TrainSample


class TrainStep:
    """The train step running on the trainer, if any (``record``), and its refs."""

    def __init__(self, job) -> None:
        self.job = job
        self.record: StepRecord | None = None
        self.refs: list | None = None
        self._seen: set = set()  # refs seen finished while a sibling still runs

    @property
    def running(self) -> bool:
        return self.record is not None

    def start(self, record: StepRecord, samples: list[TrainSample], snapshot_version: int | None) -> None:
        """Send ``samples`` to the trainer as ``record``'s step (``snapshot_version``: TrainerGroup.train_step)."""
        self.record = record
        self.refs = self.job.trainer.train_step_async(samples, snapshot_version)

    def waiting_refs(self) -> list:
        """The step's refs the loop still waits on."""
        return [r for r in self.refs or () if r not in self._seen]

    def noticed(self, ready: list) -> None:
        """``ready`` came back from the loop's wait: its refs of this step are finished."""
        mine = set(self.refs or ())
        self._seen.update(r for r in ready if r in mine)

    def done(self, ready: list) -> bool:
        return self.refs is not None and all(r in ready or is_done(r) for r in self.refs)

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
