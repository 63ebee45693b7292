"""The sync controller: a trained step's weights out to the engines, one sync at a time.

A finished step waits (``queued``) until the previous sync is done, then its version goes out
(``pending``, carrying ``record``). With ``algorithm.sync_interval`` N > 1 only every N-th version
(and the run's last) goes out (``due``); the steps between finish without a sync (``hold``,
``released``: behind any step still syncing). Before a sync starts, engines that started join the
transport group and drained ones leave it (``EngineFleet.change_at_sync``). With ``transport.overlap_push``
and staleness >= 1 a step's push sends a snapshot the trainer took (``snapshots``), so the trainer
trains the next step while its previous version is still going out.

A failed sync is decided in ``finish``: a dead receiver is taken out like any dead engine; if the
trainer's side failed, the version is sent again on a rebuilt group (``retry``; the trainer's
weights have not changed: it is not free until its push succeeded); if the trainer sent everything,
receivers whose receive failed anyway hold partial weights: they are killed and replaced, and the
version counts as synced to the rest. A receiver that rejected the version whole (a checksum
mismatch, or a delta against a version it does not hold: ``ChecksumError``, nothing loaded) still
serves its last one: it is kept, and the version is sent again on the rebuilt group, which starts
dense, while the trainer still holds it (else its next version reaches it, dense); rejecting that
retry as well, it is replaced. More than ``transport.max_sync_retries`` failures in a row end
the run. No sync starts while no engine can receive it (every one died and the replacements are
still starting): it waits, and brings the replacements in when they have started.
"""

from __future__ import annotations

from collections import Counter

from disagg.pipeline.fleet import EngineFleet, SeenRefs, all_done, brief, is_done
from disagg.pipeline.recorder import StepRecord
from disagg.trainer.snapshot import KEEP as SNAPSHOTS_KEPT


class SyncController:
    """Owns the pending sync, the step waiting for it, the trainer's snapshots and the retry state.
    ``counts``: its own events (``sync_failures``, ``sync_retries``)."""

    def __init__(self, cfg, job, state, fleet: EngineFleet) -> None:
        self.cfg, self.job, self.state, self.fleet = cfg, job, state, fleet
        self.counts: Counter = Counter()
        self.queued: StepRecord | None = None  # a trained step waiting for the previous sync to finish
        self.pending = None  # Job.PendingSync in flight
        self.record: StepRecord | None = None  # the step whose weights ``pending`` carries (None: joins only)
        self.retry: tuple[int, int, StepRecord | None] | None = None  # (version, step, record) to send again
        self.snapshots: list[int] = []  # versions the trainer keeps a copy of (overlap_push), oldest first
        self.rebuild = False  # a sync failed: the next one rebuilds the transport group first
        self.failed = 0  # failed syncs in a row
        self._seen = SeenRefs()  # refs of the pending sync seen finished
        self.sent: int | None = None  # the newest version queued or sent to the engines (``begin`` sets the first)
        # steps with no sync of their own (sync_interval) that finished while an earlier step's sync was
        # going: their metrics follow that step's, in step order
        self.held: list[StepRecord] = []

    @property
    def idle(self) -> bool:
        return self.pending is None and self.queued is None and self.retry is None

    @property
    def syncing(self) -> StepRecord | None:
        """The step whose weights are going out (or are to be sent again)."""
        if self.pending is not None:
            return self.record
        return self.retry[2] if self.retry is not None else None

    def refs(self) -> list:
        return self.pending.refs if self.pending is not None else []

    def waiting_refs(self) -> list:
        """The pending sync's refs the loop still waits on."""
        return self._seen.waiting(self.refs())

    def noticed(self, ready: list) -> None:
        """``ready`` came back from the loop's wait: its refs of the pending sync are finished."""
        self._seen.noticed(self.refs(), ready)

    def snapshot_for(self, version: int, limit: int) -> int | None:
        """The version a train step starting now makes, if its push sends a copy (overlap_push, staleness >= 1)."""
        if not (self.job.trainer.overlap_push and limit >= 1):
            return None
        self.snapshots = [*self.snapshots[-(SNAPSHOTS_KEPT - 1):], version + 1]
        return version + 1

    def blocks_trainer(self, version: int) -> bool:
        """The trainer (on ``version``) may not train: a step waits for its sync, unless it pushes a
        snapshot and nothing else is syncing; or the push in flight has not left the trainer yet."""
        in_flight = self.pending is not None or self.retry is not None
        if self.queued is not None and (in_flight or version not in self.snapshots):
            return True
        if self.pending is not None:
            return not (self.pending.from_snapshot or self.pushed())
        return self.retry is not None and self.retry[0] not in self.snapshots

    def pushed(self) -> bool:
        """The trainer's side of the pending sync finished without error (its weights may change again)."""
        import ray

        p = self.pending
        if p.pushed is None and all(is_done(r) for r in p.trainer_refs):
            try:
                ray.get(p.trainer_refs, timeout=0)
                p.pushed = True
            except Exception:  # noqa: BLE001 - reported by finish
                p.pushed = False
        return bool(p.pushed)

    def arm(self, version: int, limit: int, engines_idle: bool) -> None:
        """A train step that makes ``version`` started. At staleness 0 the engines have nothing to generate
        until its weights arrive: their receives wait on the transport group meanwhile (``transport.arm``,
        ``WeightSync.arm``), so its sync starts with no dispatch to them. Not while anything else is to
        happen at that sync (engines joining or leaving, a rebuild, a sync still going)."""
        if not (self.cfg.transport.arm and limit == 0 and engines_idle and self.idle and not self.rebuild
                and not self.fleet.changes_pending()):
            return
        self.job.arm_sync(version, timeout_s=self.cfg.cluster.actor_timeout_s + self.cfg.transport.timeout_s)

    def begin(self, version: int) -> None:
        """A run starts from ``version``, which every engine already serves."""
        self.sent, self.held = version, []

    def due(self, version: int, limit: int, last: bool) -> bool:
        """Whether the version a finished step made goes to the engines: always with an interval of 1,
        at staleness 0 and for the run's last step; else once it is ``algorithm.sync_interval`` versions
        (capped by the staleness limit in force) past the newest version sent."""
        interval = min(self.cfg.algorithm.sync_interval, max(limit, 1))
        return interval <= 1 or last or self.sent is None or version - self.sent >= interval

    def hold(self, record: StepRecord) -> None:
        """A step whose version is not due to the engines: done once no earlier step is syncing (``released``)."""
        self.held.append(record)

    def released(self) -> list[StepRecord]:
        """The held steps that are done now (no earlier step still to sync), oldest first."""
        waiting = [r.step for r in (self.syncing, self.queued) if r is not None]
        first = min(waiting, default=None)
        out = [r for r in self.held if first is None or r.step < first]
        self.held = self.held[len(out):]
        return out

    def trained(self, record: StepRecord) -> None:
        """A train step finished: its weights (the version after the one it trained) go out once the
        previous sync is done."""
        self.queued, self.sent = record, record.version_trained + 1

    def start_queued(self, version: int) -> None:
        """Send again the version that failed, else the queued step's ``version``; neither while a sync
        is in flight or no engine could receive it."""
        if self.pending is not None or not self.fleet.can_receive():
            return
        if self.retry is not None:
            (v, step, record), self.retry = self.retry, None
            self.pending, self.record = self._start(v, step), record
        elif self.queued is not None:
            self.pending, self.record = self._start(version, self.queued.step), self.queued
            self.queued = None

    def join_replacements(self, version: int, step: int) -> None:
        """Every engine died: the replacements join now, with the trainer's weights (a sync of no step)."""
        self.pending, self.record = self._start(version, step), None

    def _start(self, version: int, step: int):
        self.sent = version if self.sent is None else max(self.sent, version)
        self.fleet.change_at_sync(version, self.rebuild)
        self.rebuild = False
        return self.job.start_sync(version, step, from_snapshot=version in self.snapshots)

    def done(self, ready: list) -> bool:
        return self.pending is not None and all_done(self.pending.refs, ready)

    def finish(self, step: int, trainer_holds: int | None):
        """The pending sync ended: (its SyncStats, its step's record), or None when it failed and is to
        be sent again (``start_queued``, on a rebuilt group; for step ``step`` if it carried none).
        ``trainer_holds``: the version the trainer's live weights hold (None while a step changes them)."""
        pending = self.pending
        self._seen.clear()
        sync = self._finish(pending, trainer_holds)
        if sync is None:  # failed before the trainer's side was through: again, on a rebuilt group
            self.retry = (pending.policy_version, self.record.step if self.record else step, self.record)
            self.pending, self.record = None, None
            return None
        record, self.pending, self.record = self.record, None, None
        return sync, record

    def _finish(self, pending, trainer_holds: int | None):
        """``WeightSync.finish``, surviving failed parties; where a sync retry is decided."""
        import ray

        from disagg.errors import ChecksumError, RolloutError, TransportError

        try:
            sync = self.job.finish_sync(pending)
            self.failed = 0
            return sync
        except TransportError as e:
            err = e
        v = pending.policy_version
        self.failed += 1
        self.counts["sync_failures"] += 1
        self.rebuild = True
        self.state.record_event("sync_failed", f"version {v}: {str(err)[:600]}")
        pushed, rejected = True, []
        for rank, ref in enumerate(pending.trainer_refs):
            if isinstance(e := self._outcome(ref), ray.exceptions.RayActorError):
                raise RolloutError(f"trainer rank {rank} died during the sync of version {v}: {brief(e)}; continue "
                                   f"from the last checkpoint with `disagg train resume={self.job.run_dir}`") from e
            pushed = pushed and e is None  # else the sync is sent again
        for eid, ref in pending.engine_refs.items():
            if eid in self.fleet.died or (e := self._outcome(ref)) is None:
                continue
            if isinstance(e, ray.exceptions.RayActorError):
                self.fleet.died_now(eid, f"died during the sync of version {v}: {brief(e)}")
            elif isinstance(e, ChecksumError) and self.failed == 1:  # rejected whole: its last version serves on
                rejected.append(eid)  # (rejecting the retry too, it is replaced below: a faulty engine)
            elif pushed:
                self.fleet.died_now(eid, f"its receive of version {v} failed after the trainer sent all of "
                                    f"it ({brief(e)}): its weights are incomplete")
            elif (why := self.fleet.failure(eid, e)) is not None:
                self.fleet.died_now(eid, f"failed during the sync of version {v}: {why}")
        if self.failed > self.cfg.transport.max_sync_retries:
            raise RolloutError(f"the weight sync of version {v} failed {self.failed} times in a row "
                               f"(transport.max_sync_retries={self.cfg.transport.max_sync_retries}): {err}") from err
        if rejected and (v in self.snapshots or trainer_holds == v):
            pushed = False  # sent again to every engine: dense, on the rebuilt group
            self.state.record_event("sync_rejected", f"engine(s) {rejected} rejected version {v} and serve their "
                                    "last one: it is sent again, dense")
        if pushed and self._delivered(pending, v, trainer_holds):
            self.failed = 0
            return self.job.sync_stats(pending, ray.get(pending.trainer_refs))
        self.counts["sync_retries"] += 1
        self.state.record_event("sync_retried", f"version {v} is sent again on a rebuilt transport group")
        return None

    @staticmethod
    def _outcome(ref) -> BaseException | None:
        """How a finished party's call of a sync ended: None, or what it raised."""
        import ray

        try:
            ray.get(ref, timeout=0)
        except Exception as e:  # noqa: BLE001 - the caller decides what each failure means
            return e
        return None

    def _delivered(self, pending, v: int, trainer_holds: int | None) -> bool:
        """A sync the trainer sent all of counts as done if an engine received it whole. If none did
        (NCCL lets the sender finish into its peers' buffers after the only receiver died; gloo would
        have failed the send), it is sent again to the replacements, as when the send failed, while the
        trainer still has that version: its snapshot, or its live weights not yet trained further."""
        if any(eid not in self.fleet.died for eid in pending.engine_refs):
            return True
        if v in self.snapshots or trainer_holds == v:
            return False
        self.state.record_event("sync_superseded", f"version {v} reached no engine and the trainer has trained "
                                "past it: the replacements join with the next version")
        return True
