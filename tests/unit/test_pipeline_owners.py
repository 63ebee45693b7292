"""The loop's bookkeeping owners without Ray: the step recorder, the engine fleet, the sync
controller, reward dispatch and generation's queues (disagg/pipeline/).

The pool, the coordinator's state and the job are small stand-ins that record what the owners ask
of them: these tests pin the owners' decisions; the integration tests (test_async_pipeline,
test_elastic, test_faults) run the same owners with real Ray, vLLM and transport groups.
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest

from disagg.weightsync import PendingSync, SyncStats
from disagg.pipeline.fleet import AgentRunners, EngineFleet
from disagg.pipeline.generation import Generation
from disagg.pipeline.recorder import StepRecord, StepRecorder
from disagg.pipeline.rewards import RewardDispatch
from disagg.pipeline.scheduler import Group, GroupScheduler
from disagg.pipeline.sync_control import SyncController
from disagg.pipeline.train_step import TrainStep
from disagg.rollout.types import SamplingSpec
from disagg.samples import TrainSample


def _cfg(**rollout):
    roll = {"replace_dead_engines": True, "start_timeout_s": 60.0, "health_interval_s": 1.0, "health_timeout_s": 5.0}
    roll.update(rollout)
    return SimpleNamespace(rollout=SimpleNamespace(**roll), cluster=SimpleNamespace(placement_timeout_s=60.0,
                           actor_timeout_s=60.0), transport=SimpleNamespace(max_sync_retries=2, arm=True,
                                                                            timeout_s=30.0),
                           reward=SimpleNamespace(num_workers=0), algorithm=SimpleNamespace(sync_interval=1))


class _Handle:
    def __init__(self, eid: int, log: list) -> None:
        self.eid, self.log = eid, log
        self.set_draining = SimpleNamespace(remote=lambda on, why: log.append(("draining", eid, on)))


class _Pool:
    """The rollout pool's surface the fleet uses: members, launches, retirements."""

    def __init__(self, n: int) -> None:
        self.log: list = []
        self.engine_ids = list(range(n))
        self.engines = [_Handle(i, self.log) for i in range(n)]
        self._next = n
        self.tp = 1

    def handle(self, eid: int):
        return self.engines[self.engine_ids.index(eid)]

    def launch(self):
        eid, self._next = self._next, self._next + 1
        self.log.append(("launch", eid))
        return eid, _Handle(eid, self.log), f"start-ref-{eid}"

    def retire(self, eid, handle, background=False):
        self.log.append(("retire", eid))

    def discard(self, eid, handle):
        self.log.append(("discard", eid))
        i = self.engine_ids.index(eid)
        del self.engine_ids[i], self.engines[i]


class _State:
    """The coordinator state's surface the owners use: the scale target and the event log."""

    def __init__(self, target=None) -> None:
        self.target, self.events, self.died, self.removed = target, [], [], []

    def scale_target(self):
        return self.target

    def set_scale_target(self, n, why):
        self.target = n
        self.events.append(("target", n))

    def record_event(self, kind, text):
        self.events.append((kind, text))

    def engine_died(self, eid, why):
        self.died.append((eid, why))

    def remove_engine(self, eid):
        self.removed.append(eid)


def _fleet(n=2, target=None, **rollout):
    pool, state = _Pool(n), _State(target)
    # the scheduler counts each engine's groups generating (the fleet asks it)
    job = SimpleNamespace(rollout=pool, transport_epoch=1, changes=[], sched=GroupScheduler(4, 64))

    def change_engines(members):  # Job.change_engines: the members become the pool's engines
        job.changes.append([eid for eid, _ in members])
        pool.engine_ids, pool.engines = [eid for eid, _ in members], [h for _, h in members]

    job.change_engines = change_engines
    requeued: list[int] = []
    streams = {0: [10, 11], 1: [12]}  # gids still owed by each engine's calls
    fleet = EngineFleet(_cfg(**rollout), job, state, AgentRunners(_cfg()), requeue=requeued.extend,
                        streams_of=lambda eid: streams.pop(eid, []), generating=job.sched.generating_on)
    fleet.start()
    return fleet, pool, state, job, requeued


def _samples(versions, n_tokens=3, reward=1.0):
    return [TrainSample([1], [7] * n_tokens, [-0.1] * n_tokens, 0.0, reward, v) for v in versions]


def _group(gid, engine, versions, reward=1.0):
    g = Group(gid, {}, (1,), engine, min(versions), 0.0)
    g.samples, g.rewards = _samples(versions, reward=reward), [reward] * len(versions)
    return g


# ---- the step recorder -----------------------------------------------------------------------
def test_recorder_splits_the_trainers_time_into_waiting_for_a_batch_and_blocked_on_its_push() -> None:
    r = StepRecorder(now=100.0)
    r.batch_taken(102.0)  # waited 2 s for its first batch
    r.trained(105.0)  # trained 3 s
    r.trainer_free(106.5)  # its push kept it 1.5 s
    r.trainer_free(107.0)  # already free: nothing more counted
    r.batch_taken(108.0)  # then 1.5 s more waiting for a batch
    r.generated(engine=0, tokens=30, seconds=0.5)
    r.generated(engine=1, tokens=10, seconds=1.5)
    r.generated(engine=-1, tokens=5, seconds=1.0)  # an agent runner's group: no engine's tokens
    assert r.engine_rates({0: 2, 1: 0}, now=110.0) == {0: (2, 3.0), 1: (0, 1.0)}
    record = StepRecord(1, 1, [_group(0, 0, [1, 1]), _group(1, 1, [0, 1], reward=0.0)], t_batch=102.0, limit=0,
                        t_train_done=105.0, train={"loss": 0.5})
    rec = r.step_done(record, SyncStats(2, 4_000_000_000, 2.0, 1.0, 3, {"finish_s": 0.25, "worker_load_s": 0.5}),
                      now=110.0, run={"rollout/prompts_lost": 0})
    assert rec["weight_sync/engine_finish_s"] == 0.25 and rec["weight_sync/engine_worker_load_s"] == 0.5
    assert rec["timing/rollout_s"] == pytest.approx(3.5)
    assert rec["timing/trainer_sync_wait_s"] == pytest.approx(1.5)
    assert rec["timing/train_s"] == pytest.approx(3.0)
    assert rec["timing/step_s"] == pytest.approx(10.0)
    assert rec["rollout/tokens_per_s"] == pytest.approx(4.5)
    assert rec["rollout/group_seconds_max"] == 1.5 and rec["rollout/group_seconds_mean"] == pytest.approx(1.0)
    assert rec["weight_sync/gb_per_s"] == pytest.approx(2.0) and rec["train/loss"] == 0.5
    assert rec["reward/mean"] == pytest.approx(0.5) and rec["samples/trained"] == 4
    assert rec["policy/staleness_max"] == 1 and rec["samples/trained_beyond_staleness"] == 1  # a v0 token at limit 0
    assert rec["rollout/prompts_lost"] == 0 and r.records == [rec]
    assert r.trained_by_engine == Counter({0: 1, 1: 1}) and r.first_trained_version == {0: 1, 1: 0}
    # The next step starts from zero; the run's totals go on.
    assert r.engine_rates({0: 0}, now=111.0) == {0: (0, 0.0)}
    r.trained(112.0)  # the step whose batch was taken at 108
    r.trainer_free(112.5)
    rec2 = r.step_done(StepRecord(2, 2, [_group(2, 0, [2])], 108.0, 1, 112.0), SyncStats(3, 0, 0.0, 0.0, 0), 113.0, {})
    assert not any(k.startswith("weight_sync/engine_") for k in rec2)
    assert rec2["timing/trainer_sync_wait_s"] == pytest.approx(0.5) and rec2["timing/rollout_s"] == 0.0
    assert rec2["rollout/tokens_per_s"] == 0.0 and rec2["timing/step_s"] == pytest.approx(3.0)
    assert rec2["samples/trained_beyond_staleness"] == 1 and r.trained_samples == 5 and r.trained_tokens == 15


# ---- the engine fleet ------------------------------------------------------------------------
def _submit(fleet, sched, gid: int) -> int:
    """What ``Generation`` does with each group: place it, then submit it there."""
    eid = fleet.place()
    sched.submitted(Group(gid, {}, (1,), eid, 0, 0.0))
    return eid


def test_fleet_places_each_group_on_the_least_loaded_engine_round_robin_among_equals() -> None:
    fleet, _, _, job, _ = _fleet(n=3)
    assert [_submit(fleet, job.sched, gid) for gid in range(6)] == [0, 1, 2, 0, 1, 2]
    job.sched.generated(1, SimpleNamespace())  # engine 1's two groups came back
    job.sched.generated(4, SimpleNamespace())
    assert _submit(fleet, job.sched, 6) == 1 and _submit(fleet, job.sched, 7) == 1
    assert fleet.load == {0: 2, 1: 2, 2: 2}


def test_the_scheduler_counts_each_engines_groups_generating_until_back_failed_or_moved() -> None:
    sched = GroupScheduler(batch_groups=4, max_inflight=8)
    for gid, eid in ((0, 0), (1, 0), (2, 1), (3, -1)):  # -1: an agent runner's group, no engine's
        sched.submitted(Group(gid, {}, (1,), eid, 0, 0.0))
    assert [sched.generating_on(e) for e in (0, 1, -1)] == [2, 1, 0]
    sched.generated(0, SimpleNamespace())  # back: scored next, no longer on its engine
    sched.generated(0, SimpleNamespace())  # told twice: counted once
    sched.off_engine([2, 99])  # its call failed (99: not in flight)
    assert [sched.generating_on(e) for e in (0, 1)] == [1, 0] and sched.inflight[2].engine == 1
    sched.submitted(Group(2, {}, (1,), 0, 1, 0.0))  # generated again, on engine 0
    sched.submitted(Group(1, {}, (1,), 1, 1, 0.0))  # and one moved while still counted on engine 0
    assert [sched.generating_on(e) for e in (0, 1)] == [1, 1]
    sched.finished(2, None)  # dropped while generating
    sched.finished(0, None)  # dropped after it came back: already off its engine
    assert [sched.generating_on(e) for e in (0, 1)] == [0, 1]


def test_fleet_death_requeues_the_engines_groups_and_starts_a_replacement() -> None:
    fleet, pool, state, _, requeued = _fleet(n=2)
    fleet.died_now(0, "health check failed", gids=[5])
    assert requeued == [5, 10, 11]  # the failed call's groups, then what its other calls owed
    assert fleet.serving == [1] and 0 not in fleet.load and fleet.died == {0}
    assert ("discard", 0) in pool.log and ("launch", 2) in pool.log
    assert state.died[0][0] == 0 and "3 prompt group(s) back in the queue" in state.died[0][1]
    assert fleet.counts["engine_deaths"] == 1 and fleet.counts["engines_replaced"] == 1
    assert fleet.active() == 2  # the replacement counts as coming
    fleet.died_now(0, "again", gids=[6])  # a second report of the same death only requeues
    assert requeued[-1] == 6 and fleet.counts["engine_deaths"] == 1


def test_fleet_does_not_replace_a_dead_engine_when_no_step_is_left() -> None:
    fleet, _, state, *_ = _fleet(n=2, target=2)
    fleet.apply_scale(more_steps=False)
    fleet.died_now(1, "actor died")
    assert not fleet.launching and state.target == 1  # the operator's target follows what is left


def test_fleet_scales_up_by_taking_back_a_draining_engine_before_launching() -> None:
    fleet, pool, state, *_ = _fleet(n=3, target=2)
    fleet.apply_scale(more_steps=True)
    assert fleet.serving == [0, 1] and fleet.draining == {2} and ("draining", 2, True) in pool.log
    state.target = 4
    fleet.apply_scale(more_steps=True)
    assert fleet.serving == [0, 1, 2] and not fleet.draining and ("draining", 2, False) in pool.log
    assert [eid for eid, _, _ in fleet.launching.values()] == [3]
    state.target = 3
    fleet.apply_scale(more_steps=True)  # the one still starting is cancelled first
    assert not fleet.launching and state.removed == [3]


def test_fleet_membership_changes_at_a_sync_and_joined_engines_serve_once_it_lands() -> None:
    fleet, pool, state, job, _ = _fleet(n=3, target=2)
    fleet.apply_scale(more_steps=True)  # engine 2 drains
    eid = 3
    fleet.joining[eid] = _Handle(eid, pool.log)
    job.sched.submitted(Group(9, {}, (1,), 2, 3, 0.0))  # still has a group: it stays a member
    fleet.change_at_sync(version=4, rebuild=False)
    assert job.changes == [[0, 1, 2, 3]] and fleet.joined == [3] and fleet.join_version == {3: 4}
    assert 3 not in fleet.serving and fleet.draining == {2}
    fleet.synced(4)
    assert fleet.serving == [0, 1, 3] and not fleet.joined
    assert fleet.load == {0: 0, 1: 0, 3: 0, 2: 1}
    job.sched.generated(9, SimpleNamespace())  # its group came back: it leaves at the next sync
    fleet.change_at_sync(version=5, rebuild=False)
    assert job.changes[-1] == [0, 1, 3] and state.removed == [2] and ("retire", 2) in pool.log
    assert fleet.counts["engines_left"] == 1 and fleet.counts["engines_joined"] == 1
    fleet.change_at_sync(version=6, rebuild=False)  # nobody comes or goes: no rebuild
    assert len(job.changes) == 2
    fleet.change_at_sync(version=6, rebuild=True)  # after a failed sync: rebuilt anyway
    assert len(job.changes) == 3


# ---- the sync controller ---------------------------------------------------------------------
def _sync(overlap_push: bool):
    fleet, _, state, job, _ = _fleet(n=1)
    job.trainer = SimpleNamespace(overlap_push=overlap_push)
    job.started = []

    def start_sync(version, step, from_snapshot=False):
        job.started.append((version, step, from_snapshot))
        return PendingSync(version, 0.0, refs=[], from_snapshot=from_snapshot)

    job.start_sync = start_sync
    job.finish_sync = lambda pending: SyncStats(pending.policy_version, 10, 1.0, 0.5, 1)
    return SyncController(_cfg(), job, state, fleet), job


def test_sync_waits_for_the_previous_one_and_blocks_the_trainer_until_its_push_left() -> None:
    sync, job = _sync(overlap_push=False)
    assert sync.idle and not sync.blocks_trainer(1)
    assert sync.snapshot_for(1, limit=1) is None  # no overlap_push: no copy
    sync.trained(StepRecord(1, 1, [], 0.0))
    assert sync.blocks_trainer(2)  # its weights have not gone out
    sync.start_queued(2)
    assert job.started == [(2, 1, False)] and sync.queued is None and not sync.idle
    sync.pending.pushed = False  # the push failed: still blocked
    assert sync.blocks_trainer(2)
    sync.pending.pushed = True  # the push left the trainer: it may train while engines load
    assert not sync.blocks_trainer(2)
    sync.trained(StepRecord(2, 2, [], 0.0))
    sync.start_queued(3)  # one sync at a time
    assert len(job.started) == 1 and sync.queued.step == 2
    stats, record = sync.finish(step=2, trainer_holds=None)
    assert stats.policy_version == 2 and record.step == 1 and sync.pending is None
    sync.start_queued(3)
    assert job.started[-1] == (3, 2, False)


def test_engines_are_armed_only_at_staleness_0_when_idle_and_nothing_else_happens_at_the_sync() -> None:
    sync, job = _sync(overlap_push=False)
    job.armed_for = []
    job.arm_sync = lambda version, timeout_s: job.armed_for.append((version, timeout_s))
    sync.arm(2, limit=1, engines_idle=True)  # staleness 1: the engines generate while the step trains
    sync.arm(2, limit=0, engines_idle=False)  # something still generating
    assert job.armed_for == []
    sync.arm(2, limit=0, engines_idle=True)
    assert job.armed_for == [(2, 60.0 + 30.0)]  # the loop's stall limit plus the transport's timeout
    sync.fleet.draining.add(0)  # an engine leaves at the next sync: the group changes there
    sync.arm(3, limit=0, engines_idle=True)
    sync.fleet.draining.clear()
    sync.rebuild = True  # the last sync failed: the next one rebuilds the group
    sync.arm(3, limit=0, engines_idle=True)
    sync.rebuild = False
    sync.trained(StepRecord(1, 1, [], 0.0))  # a step waits for its sync
    sync.arm(3, limit=0, engines_idle=True)
    assert job.armed_for == [(2, 90.0)]
    sync.queued = None
    sync.cfg.transport.arm = False
    sync.arm(3, limit=0, engines_idle=True)
    assert job.armed_for == [(2, 90.0)]


def test_with_a_sync_interval_only_every_nth_version_and_the_last_are_due_capped_by_the_limit() -> None:
    sync, job = _sync(overlap_push=True)
    sync.begin(1)  # the version the run starts from
    assert all(sync.due(v, limit=4, last=False) for v in (2, 3))  # an interval of 1: every version
    sync.cfg.algorithm.sync_interval = 3
    assert [sync.due(v, limit=4, last=False) for v in (2, 3, 4)] == [False, False, True]
    assert sync.due(2, limit=4, last=True)  # the run's last version always goes out
    assert [sync.due(v, limit=2, last=False) for v in (2, 3)] == [False, True]  # capped by the limit in force
    assert sync.due(2, limit=0, last=False)  # staleness 0: every version
    sync.trained(StepRecord(3, 3, [], 0.0))  # version 4 queued: the next ones count from it
    assert [sync.due(v, limit=4, last=False) for v in (5, 6, 7)] == [False, False, True]
    sync.hold(StepRecord(4, 4, [], 0.0))  # version 5 not due, finished while version 4 waits to go out
    assert sync.released() == []  # its metrics follow step 3's
    sync.start_queued(4)
    assert sync.released() == []
    sync.trained(StepRecord(5, 5, [], 0.0))  # the run's last step, due, queued behind step 3's sync
    sync.finish(step=3, trainer_holds=None)
    assert [r.step for r in sync.released()] == [4] and sync.released() == []  # before step 5's
    sync.start_queued(6)
    sync.finish(step=5, trainer_holds=None)
    sync.join_replacements(8, step=7)  # a sync of no step also sets where the count starts
    assert not sync.due(9, limit=4, last=False) and sync.due(11, limit=4, last=False)


def test_a_snapshot_lets_the_trainer_take_its_next_batch_before_its_sync_starts() -> None:
    sync, job = _sync(overlap_push=True)
    assert sync.snapshot_for(1, limit=0) is None  # staleness 0: the engines must have it first
    assert sync.snapshot_for(1, limit=1) == 2 and sync.snapshots == [2]
    sync.trained(StepRecord(1, 1, [], 0.0))
    assert not sync.blocks_trainer(2)  # queued, but pushed from a copy
    sync.start_queued(2)
    assert job.started == [(2, 1, True)] and not sync.blocks_trainer(2)
    sync.trained(StepRecord(2, 2, [], 0.0))
    assert sync.blocks_trainer(3)  # version 3 has no copy and a sync is running: wait


def test_a_sync_to_send_again_waits_while_no_engine_can_receive_it_and_brings_the_replacement_in() -> None:
    sync, job = _sync(overlap_push=False)
    fleet = sync.fleet
    fleet.more_steps = True
    fleet.died_now(0, "exited in the middle of the sync of version 3")  # the only engine
    assert not fleet.can_receive() and [eid for eid, _, _ in fleet.launching.values()] == [1]
    record = StepRecord(2, 2, [], 0.0)
    sync.retry = (3, 2, record)  # what finish() leaves when the trainer's side of version 3 failed
    sync.trained(StepRecord(3, 3, [], 0.0))
    assert not sync.idle and sync.blocks_trainer(4) and sync.syncing is record
    sync.start_queued(4)
    assert job.started == [] and job.changes == []  # no sync into an empty group
    ref = next(iter(fleet.launching))
    fleet.launching.pop(ref)
    fleet.joining[1] = "engine 1"  # the replacement started on dummy weights
    sync.start_queued(4)
    assert job.changes == [[1]] and job.started == [(3, 2, False)]  # version 3 again, with the replacement
    assert sync.record is record and sync.retry is None and sync.queued.step == 3 and fleet.joined == [1]
    stats, done = sync.finish(step=3, trainer_holds=None)
    assert done is record and stats.policy_version == 3
    fleet.synced(3)
    sync.start_queued(4)  # then the step trained meanwhile
    assert fleet.serving == [1] and job.started[-1] == (4, 3, False)


def _sole_receiver_dies_after_the_push(sync, monkeypatch, version: int, trainer_holds: int | None):
    """The sync of ``version`` fails: the trainer sent all of it (NCCL completes into the receiver's
    buffers), its only receiver, engine 0, died. What ``finish`` decides."""
    import ray

    from disagg.errors import TransportError

    record = StepRecord(version - 1, version - 1, [], 0.0)
    sync.pending, sync.record = PendingSync(version, 0.0, ["push", "recv0"], 1, (0,)), record
    outcomes = {"push": None, "recv0": ray.exceptions.RayActorError()}
    monkeypatch.setattr(sync, "_outcome", outcomes.get)

    def finish_sync(pending):
        raise TransportError("engine 0: actor died")

    sync.job.finish_sync = finish_sync
    sync.fleet.more_steps = True
    return record, sync.finish(step=version - 1, trainer_holds=trainer_holds)


@pytest.mark.parametrize("held_by", ["snapshot", "live weights"])
def test_a_pushed_version_that_reached_no_engine_is_sent_again_to_the_replacement(monkeypatch, held_by) -> None:
    sync, job = _sync(overlap_push=held_by == "snapshot")
    if held_by == "snapshot":
        sync.snapshot_for(2, limit=1)  # the step that made version 3 took a copy; the trainer trains on
    record, finished = _sole_receiver_dies_after_the_push(sync, monkeypatch, 3,
                                                          trainer_holds=None if held_by == "snapshot" else 3)
    assert finished is None and sync.retry == (3, 2, record)
    assert sync.counts["sync_failures"] == 1 and sync.counts["sync_retries"] == 1
    assert sync.fleet.died == {0} and [eid for eid, _, _ in sync.fleet.launching.values()] == [1]
    assert sync.blocks_trainer(3) == (held_by == "live weights")  # its weights are still to go out


def test_a_pushed_version_that_reached_no_engine_and_that_the_trainer_trained_past_is_superseded(monkeypatch) -> None:
    import ray

    sync, job = _sync(overlap_push=False)
    job.sync_stats = lambda pending, pushes: SyncStats(pending.policy_version, 10, 1.0, 0.5, 1)
    monkeypatch.setattr(ray, "get", lambda refs, timeout=None: [None for _ in refs])
    record, (stats, done) = _sole_receiver_dies_after_the_push(sync, monkeypatch, 3, trainer_holds=None)
    assert done is record and stats.policy_version == 3 and sync.retry is None
    assert sync.counts["sync_failures"] == 1 and sync.counts["sync_retries"] == 0
    assert [k for k, _ in sync.state.events][-1] == "sync_superseded"


@pytest.mark.parametrize("trainer_holds", [3, None], ids=["held", "trained past"])
def test_an_engine_that_rejected_a_version_whole_is_kept_and_gets_it_again(monkeypatch, trainer_holds) -> None:
    # a checksum mismatch, or a delta against a version the engine does not hold: nothing loaded,
    # its last version serves on. Not killed: the version goes again on the rebuilt (dense) group
    # while the trainer holds it; else the next version reaches it.
    import ray

    from disagg.errors import ChecksumError, TransportError

    sync, job = _sync(overlap_push=False)
    job.sync_stats = lambda pending, pushes: SyncStats(pending.policy_version, 10, 1.0, 0.5, 1)
    record = StepRecord(2, 2, [], 0.0)
    sync.pending, sync.record = PendingSync(3, 0.0, ["push", "recv0"], 1, (0,)), record
    outcomes = {"push": None, "recv0": ChecksumError("engine 0: policy_version=3 was sent as changes to version 2, "
                                                     "this receiver holds none")}
    monkeypatch.setattr(sync, "_outcome", outcomes.get)
    monkeypatch.setattr(ray, "get", lambda refs, timeout=None: [None for _ in refs])

    def finish_sync(pending):
        raise TransportError("engine 0: rejected")

    job.finish_sync = finish_sync
    finished = sync.finish(step=2, trainer_holds=trainer_holds)
    assert sync.fleet.died == set() and sync.counts["sync_failures"] == 1 and sync.rebuild
    if trainer_holds == 3:
        assert finished is None and sync.retry == (3, 2, record) and sync.counts["sync_retries"] == 1
        assert [k for k, _ in sync.state.events][-2:] == ["sync_rejected", "sync_retried"]
    else:
        stats, done = finished
        assert done is record and stats.policy_version == 3 and sync.retry is None
        assert sync.counts["sync_retries"] == 0
        return
    # the retry rejected too: a faulty engine, replaced (a rejection can go on no longer than that)
    sync.pending, sync.record = PendingSync(3, 0.0, ["push", "recv0"], 1, (0,)), record
    assert sync.finish(step=2, trainer_holds=3) is None
    assert sync.fleet.died == {0} and sync.counts["sync_failures"] == 2


def test_replacements_join_in_a_sync_of_no_step() -> None:
    sync, job = _sync(overlap_push=False)
    sync.join_replacements(version=3, step=2)
    stats, record = sync.finish(step=2, trainer_holds=3)
    assert job.started == [(3, 2, False)] and record is None and stats.policy_version == 3


# ---- reward dispatch and generation's queues ---------------------------------------------------
class _Scorer:
    def reward(self, text, row, counts):
        if text == "bad":
            counts["reward_errors"] += 1
            return 0.0
        return float(len(text)) + row["bonus"]


def test_rewards_are_scored_on_the_driver_without_workers_and_held_while_generating_when_not_overlapped() -> None:
    overlapped = RewardDispatch(_cfg(), _Scorer(), overlap=True)
    overlapped.finished(3, ["ab", "bad"], {"bonus": 1.0})
    assert overlapped.inflight() == 1
    assert overlapped.flush(generating=True) == [(3, [3.0, 0.0], {"reward_errors": 1})]
    assert overlapped.inflight() == 0 and overlapped.flush(generating=False) == []
    serial = RewardDispatch(_cfg(), _Scorer(), overlap=False)
    serial.finished(1, ["a"], {"bonus": 0.0})
    serial.finished(2, ["abc"], {"bonus": 0.0})
    assert serial.flush(generating=True) == [] and serial.inflight() == 2  # held until nothing generates
    assert serial.flush(generating=False) == [(1, [1.0], {}), (2, [3.0], {})]
    assert overlapped.counts["reward_calls"] == serial.counts["reward_calls"] == 0  # no worker was called


class _LentWorker:
    """A reward worker a benchmark started and lends to each run (``Pipeline(reward_workers=...)``)."""

    def __init__(self, log):
        self.log = log
        self.set_latency = SimpleNamespace(remote=lambda s: log.append(("latency", s)))
        self.score_groups = SimpleNamespace(remote=lambda groups: log.append(("score", len(groups))) or len(log))


def test_lent_reward_workers_take_the_runs_latency_score_its_groups_and_outlive_it(monkeypatch) -> None:
    import ray

    killed: list = []
    monkeypatch.setattr(ray, "get", lambda refs, timeout=None: [None for _ in refs])
    monkeypatch.setattr(ray, "kill", killed.append)
    log: list = []
    lent = [_LentWorker(log), _LentWorker(log)]
    cfg = _cfg()
    cfg.reward = SimpleNamespace(num_workers=2, latency_s=0.25)
    rewards = RewardDispatch(cfg, _Scorer(), overlap=True, workers=lent)
    rewards.start()
    assert log == [("latency", 0.25), ("latency", 0.25)] and rewards.workers == lent
    for gid in (1, 2, 3):
        rewards.finished(gid, ["ab"], {"bonus": 0.0})
    assert rewards.flush(generating=True) == []  # sent to the lent workers, not scored on the driver
    assert [x for x in log if x[0] == "score"] == [("score", 2), ("score", 1)]
    rewards.close()
    assert killed == [] and rewards.workers == []  # the lender ends them, after its last run


class _Stream:
    def __init__(self, log, eid):
        self.log, self.eid = log, eid

    def options(self, **kw):
        return self

    def remote(self, reqs):
        self.log.append((self.eid, [r.request_id for r in reqs]))
        return f"stream-{self.eid}-{len(self.log)}"


def test_generation_sends_requeued_groups_first_and_one_call_per_engine() -> None:
    fleet, pool, _, job, _ = _fleet(n=2)
    calls: list = []
    pool.engines = [SimpleNamespace(generate_stream=_Stream(calls, e)) for e in pool.engine_ids]
    sched = job.sched
    rows = iter([SimpleNamespace(row={"i": i}, prompt=f"p{i}", index=i) for i in range(10)])
    gen = Generation(SimpleNamespace(rollout=pool), sched, rows, lambda text: (len(text),), SamplingSpec(max_tokens=4),
                     None)
    gen.submit(fleet, engine_version=1, new=3)
    assert calls == [(0, ["g0", "g2"]), (1, ["g1"])] and gen.inflight() == 3 and gen.next_gid == 3
    stream_of_0 = next(ref for ref, owed in gen.calls.items() if "g0" in owed)
    assert fleet.load == {0: 2, 1: 1}
    gen.requeue(gen.streams_of(0))  # engine 0 died: its groups come back first
    assert list(gen.again) == [0, 2] and stream_of_0 not in gen.calls and gen.counts["groups_requeued"] == 2
    assert sched.generating_on(0) == 0  # no longer generating there
    fleet.serving.remove(0)
    gen.submit(fleet, engine_version=2, new=1)
    assert calls[-1][0] == 1 and calls[-1][1][:2] == ["g0-again0", "g2-again1"] and calls[-1][1][2] == "g3"
    assert sched.inflight[0].engine == 1 and sched.inflight[0].submitted_version == 2 and not gen.again


def test_generation_runs_an_agent_group_again_at_most_three_times_and_counts_dummy_tokens() -> None:
    from disagg.rollout.types import Completion, GenResult

    gen = Generation(SimpleNamespace(rollout=None), GroupScheduler(batch_groups=4, max_inflight=8), iter(()),
                     lambda text: (), SamplingSpec(max_tokens=4), None)
    lost = GenResult("g5", -1, [1], dropped="engine_unreachable")
    assert [gen.run_again(5, lost) for _ in range(4)] == [True, True, True, False]
    assert list(gen.again) == [5, 5, 5] and gen.counts["groups_requeued"] == 3
    assert not gen.run_again(6, GenResult("g6", 0, [1], [Completion([3], [-0.1], "stop", [1])], 1, 1))
    gen.served(GenResult("g7", 0, [1], [Completion([3, 4], [-0.1, -0.2], "stop", [1, 1])], 1, 1))
    assert gen.dummy_served == 0
    gen.served(GenResult("g8", 0, [1], [Completion([3, 4], [-0.1, -0.2], "stop", [0, 1])], 0, 1))
    assert gen.dummy_served == 1


def test_the_loop_ends_with_an_error_when_no_engine_is_left_for_a_sync_that_waits_for_one() -> None:
    from disagg.errors import RolloutError
    from disagg.pipeline.loop import Pipeline

    sync, _ = _sync(overlap_push=False)
    fleet = sync.fleet
    fleet.cfg.rollout.replace_dead_engines = False
    fleet.died_now(0, "exited mid-sync")  # the only engine; no replacement
    sync.retry = (3, 2, StepRecord(2, 2, [], 0.0))
    loop = SimpleNamespace(train=TrainStep(None), sync=sync, gen=SimpleNamespace(calls={}),
                           rewards=SimpleNamespace(calls={}), fleet=fleet, cfg=fleet.cfg, step=2, last_step=2)
    # The last step is done but its weights still wait for an engine: not an idle wait for a resume.
    with pytest.raises(RolloutError, match=r"every rollout engine died \(\[0\]\)"):
        Pipeline._wait(loop, paused=False, limit=1)


def test_a_syncs_engine_phases_are_the_slowest_engines_and_the_bytes_the_trainers() -> None:
    from disagg.job import Job
    from disagg.rollout.types import SyncReport

    pending = PendingSync(4, t0=0.0, refs=[], num_trainer_refs=1, engine_ids=(0, 1))
    sent = [{"bytes": 100, "send_s": 0.5, "num_buckets": 2}]
    reports = [SyncReport(0, 4, 100, 2, 5, 0.4, 0.6, {"update_s": 0.4, "finish_s": 0.05}),
               SyncReport(1, 4, 100, 2, 5, 0.3, 0.7, {"update_s": 0.3, "finish_s": 0.09, "quiesce_s": 0.02})]
    s = Job.sync_stats(None, pending, sent, reports)
    assert s.engine_phases == {"update_s": 0.4, "finish_s": 0.09, "quiesce_s": 0.02}
    assert (s.policy_version, s.bytes, s.send_s, s.num_buckets) == (4, 100, 0.5, 2)
    assert Job.sync_stats(None, pending, sent).engine_phases == {}


def test_the_recorder_makes_the_run_totals_from_the_counts_each_owner_keeps() -> None:
    sched = GroupScheduler(batch_groups=4, max_inflight=8)
    sched.counts.update(dropped_stale=2, dropped_stale_groups=1)
    gen = SimpleNamespace(next_gid=9, dummy_served=0, counts=Counter(groups_requeued=3), inflight=lambda: 2)
    fleet = SimpleNamespace(serving=[0, 1], counts=Counter(engine_deaths=1, engines_replaced=1, engines_joined=2))
    sync = SimpleNamespace(counts=Counter(sync_failures=1, sync_retries=1))
    totals = StepRecorder.run_totals(scored=Counter(reward_errors=4, invalid_groups=1), sched=sched, gen=gen,
                                     fleet=fleet, sync=sync, skipped_rows=5, prompts_lost=0)
    assert {k: totals[k] for k in ("samples/dropped_stale", "samples/reward_errors", "samples/invalid_groups",
                                   "rollout/groups_requeued", "rollout/engine_deaths", "rollout/engines_replaced",
                                   "rollout/engines_joined", "rollout/engines_left", "transport/sync_failures",
                                   "transport/sync_retries", "data/skipped_rows", "rollout/prompts_drawn",
                                   "rollout/num_engines")} == {
        "samples/dropped_stale": 2, "samples/reward_errors": 4, "samples/invalid_groups": 1,
        "rollout/groups_requeued": 3, "rollout/engine_deaths": 1, "rollout/engines_replaced": 1,
        "rollout/engines_joined": 2, "rollout/engines_left": 0, "transport/sync_failures": 1,
        "transport/sync_retries": 1, "data/skipped_rows": 5, "rollout/prompts_drawn": 9, "rollout/num_engines": 2}
    live = StepRecorder.live_stats(sched, gen, SimpleNamespace(inflight=lambda: 1), [])
    assert live == {"buffer_groups": 0, "training_groups": 0, "inflight_groups": 3}


def test_the_train_step_keeps_its_refs_out_of_the_wait_once_seen_finished() -> None:
    sent = []
    trainer = SimpleNamespace(train_step_async=lambda samples, snap: sent.append((samples, snap)) or ["r0", "r1"])
    step = TrainStep(SimpleNamespace(trainer=trainer))
    assert not step.running and step.waiting_refs() == [] and not step.done([])
    step.start(StepRecord(4, 3, [], 0.0), ["s"], 4)
    assert step.running and sent == [(["s"], 4)] and step.waiting_refs() == ["r0", "r1"]
    step.noticed(["r0", "engine-call"])  # one rank finished, the other trains on
    assert step.waiting_refs() == ["r1"]
    assert step.done(["r0", "r1"])
