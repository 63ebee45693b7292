"""GroupScheduler: admission control, staleness at batch formation, stream vs batch.

A simulated cluster (no Ray): engines finish groups in a random order with
heavy-tailed delays while a trainer takes batches; every group submitted must
end trained, dropped as stale (counted) or still carried over - never lost.
"""

from __future__ import annotations

import random

import pytest

from disagg.pipeline import Group, GroupScheduler
from disagg.samples import TrainSample


def _group(gid: int, version: int) -> Group:
    return Group(gid, {"i": gid}, (1, 2), engine=0, submitted_version=version, t_submit=0.0)


def _samples(gid: int, versions: list[int]) -> list[TrainSample]:
    return [TrainSample([1, 2], [3, gid], [-0.1, -0.2], 0.5, 1.0, v) for v in versions]


def test_admission_bounds_inflight_plus_buffered_by_what_can_still_be_trained() -> None:
    s = GroupScheduler(batch_groups=4, max_inflight=100)
    # Synchronous (limit 0): one batch at the current version, nothing while its step runs.
    assert s.capacity(engine_version=3, next_train_version=3, max_staleness=0) == 4
    assert s.capacity(engine_version=3, next_train_version=4, max_staleness=0) == 0
    # One step of staleness: the next batch may generate during the running step.
    assert s.capacity(engine_version=3, next_train_version=4, max_staleness=1) == 4
    assert s.capacity(engine_version=3, next_train_version=3, max_staleness=2) == 12
    for gid in range(5):
        s.submitted(_group(gid, 3))
    s.finished(0, _samples(0, [3, 3]))
    # 4 in flight + 1 ready count against the 12 groups steps 3, 4 and 5 can take.
    assert s.capacity(engine_version=3, next_train_version=3, max_staleness=2) == 7
    # max_inflight caps what generates at once, whatever the staleness allows.
    t = GroupScheduler(batch_groups=4, max_inflight=6)
    assert t.capacity(engine_version=1, next_train_version=1, max_staleness=5) == 6


def test_stream_hands_over_the_first_complete_groups_and_carries_the_rest() -> None:
    s = GroupScheduler(batch_groups=2, max_inflight=8)
    for gid in range(4):
        s.submitted(_group(gid, 1))
    s.finished(2, _samples(2, [1, 1]))
    assert s.take_batch(train_version=1, max_staleness=0) is None  # one complete group is not a batch
    s.finished(0, _samples(0, [1, 1]))
    batch = s.take_batch(train_version=1, max_staleness=0)
    assert [g.gid for g in batch] == [2, 0]  # completion order, not submission order
    assert set(s.inflight) == {1, 3}  # unfinished groups carried over


def test_stream_trains_the_oldest_complete_groups_first() -> None:
    s = GroupScheduler(batch_groups=2, max_inflight=8)
    for gid, v in [(0, 4), (1, 2), (2, 4), (3, 3)]:
        s.submitted(_group(gid, v))
    for gid, versions in [(0, [4]), (2, [4]), (1, [2, 3, 4]), (3, [3, 4])]:  # the long ones finish last
        s.finished(gid, _samples(gid, versions))
    assert [g.gid for g in s.take_batch(train_version=4, max_staleness=2)] == [1, 3]
    assert [g.gid for g in s.ready] == [0, 2]


def test_batch_mode_waits_for_every_group_of_the_step() -> None:
    s = GroupScheduler(batch_groups=3, max_inflight=8, mode="batch")
    assert s.capacity(1, 1, 1) == 3
    for gid in range(3):
        s.submitted(_group(gid, 1))
    assert s.capacity(1, 1, 1) == 0  # nothing more until this batch is handed over
    s.finished(0, _samples(0, [1]))
    s.finished(1, _samples(1, [1]))
    assert s.take_batch(1, 1) is None
    s.finished(2, _samples(2, [1]))
    assert [g.gid for g in s.take_batch(1, 1)] == [0, 1, 2]


def test_stale_groups_are_dropped_at_batch_formation_and_counted() -> None:
    s = GroupScheduler(batch_groups=1, max_inflight=8)
    for gid, v in [(0, 1), (1, 2), (2, 3)]:
        s.submitted(_group(gid, v))
    # Group 0 was interrupted by updates: its oldest token is version 1.
    s.finished(0, _samples(0, [1, 2]))
    s.finished(1, _samples(1, [2, 2, 3]))
    s.finished(2, _samples(2, [3]))
    batch = s.take_batch(train_version=3, max_staleness=1)
    assert [g.gid for g in batch] == [1]
    assert s.counts["dropped_stale"] == 2 and s.counts["dropped_stale_groups"] == 1
    assert [g.gid for g in s.take_batch(train_version=4, max_staleness=1)] == [2]


def test_lowering_the_limit_frees_the_room_held_by_groups_that_became_too_stale() -> None:
    s = GroupScheduler(batch_groups=2, max_inflight=8)
    for gid in range(4):
        s.submitted(_group(gid, 5))
        s.finished(gid, _samples(gid, [5]))
    # Limit 2 at version 6: 4 buffered groups fill the room of steps 6 and 7 ...
    assert s.capacity(engine_version=6, next_train_version=6, max_staleness=2) == 2
    # ... limit lowered to 0: they can never be trained; once dropped, a batch can be generated.
    assert s.capacity(engine_version=6, next_train_version=6, max_staleness=0) == 0
    assert s.drop_stale(6, 0) == 4 and s.counts["dropped_stale"] == 4
    assert s.capacity(engine_version=6, next_train_version=6, max_staleness=0) == 2


def test_a_dropped_group_is_not_buffered() -> None:
    s = GroupScheduler(batch_groups=1, max_inflight=4)
    s.submitted(_group(0, 1))
    s.finished(0, None)
    assert not s.inflight and not s.ready


def test_a_group_its_engine_stopped_as_stale_frees_its_slot_and_is_counted() -> None:
    s = GroupScheduler(batch_groups=2, max_inflight=3)
    for gid in range(3):
        s.submitted(_group(gid, 5))
    assert s.capacity(engine_version=7, next_train_version=7, max_staleness=4) == 0  # every slot held
    s.generated(1, None)
    s.stopped_stale(1, samples=4)
    assert 1 not in s.inflight and not s.ready and s.generating_on(0) == 2
    assert s.capacity(engine_version=7, next_train_version=7, max_staleness=4) == 1
    assert (s.counts["dropped_stale"], s.counts["dropped_stale_groups"], s.counts["dropped_stale_in_flight_groups"]) \
        == (4, 1, 1)


def test_a_kept_responses_first_token_version_comes_from_its_first_cut_with_tokens() -> None:
    from disagg.rollout.engine_receive import first_token_version

    assert first_token_version(4, []) is None  # no sync yet: its tokens (if any) are the serving version's
    assert first_token_version(4, [(3, 5)]) == 4
    assert first_token_version(4, [(0, 5), (0, 6), (2, 7)]) == 6  # two pauses before its first token
    assert first_token_version(4, [(0, 5)]) is None


@pytest.mark.parametrize("mode", ["stream", "batch"])
@pytest.mark.parametrize("limit,lowered", [(0, None), (1, None), (3, None), (3, 0), (2, 1)])
def test_simulated_run_loses_no_group_and_trains_nothing_too_stale(mode: str, limit: int, lowered) -> None:
    _simulated_run(mode, limit, lowered)


def _simulated_run(mode: str, limit: int, lowered, stale_groups: str = "drop") -> GroupScheduler:
    """The driver's decisions (admit, then take a batch when the trainer is free) against a simulated
    cluster; ``lowered``: the limit is lowered at run time, as `disagg ctl set-staleness` does."""
    rng = random.Random(limit * 7 + len(mode))
    s = GroupScheduler(batch_groups=4, max_inflight=16, mode=mode, stale_groups=stale_groups)
    version, engine_version, submitted, trained, running = 1, 1, 0, [], []
    finish_at: dict[int, float] = {}
    clock = 0.0
    train_done_at: float | None = None
    for it in range(4000):
        if lowered is not None and it == 2000:
            limit = lowered
        next_train = version + (1 if train_done_at is not None else 0)
        for _ in range(s.admit(engine_version, next_train, limit)):
            s.submitted(_group(submitted, engine_version))
            finish_at[submitted] = clock + (50.0 if rng.random() < 0.1 else rng.uniform(0.5, 2.0))  # long tail
            submitted += 1
        if train_done_at is None:
            batch = s.take_batch(version, limit)
            if batch is not None:
                trained.extend((version, g, limit) for g in batch)
                train_done_at = clock + 1.0
        # Where the driver waits: something must be generating or training, else it stalled.
        assert s.inflight or train_done_at is not None, (it, limit, len(s.ready))
        clock += 0.25
        for gid, t in list(finish_at.items()):
            if t <= clock:
                g = s.inflight[gid]
                # Tokens after the submission version come from the versions served since.
                s.finished(gid, _samples(gid, [g.submitted_version, engine_version]))
                del finish_at[gid]
        if train_done_at is not None and clock >= train_done_at:
            version += 1
            engine_version = version  # the sync lands
            train_done_at = None
        running.append(len(s.inflight))
    assert len(trained) > 50
    for v, g, lim in trained:
        assert v - g.min_version <= lim
    dropped = s.counts["dropped_stale_groups"]
    assert submitted == len(trained) + dropped + len(s.inflight) + len(s.ready)
    assert max(running) <= 16
    if limit == 0 and lowered is None:
        assert dropped == 0  # admission keeps the synchronous loop from producing stale groups
    return s


@pytest.mark.parametrize("limit", [1, 2])
def test_waiting_for_old_groups_trains_the_whole_tail_within_the_limit(limit: int) -> None:
    """A heavy tail (1 group in 10 takes 50 steps' worth of time) at a small limit: dropping loses the
    long groups; algorithm.stale_groups=wait holds the steps that are their last chance and loses none
    (every trained group within the limit: _simulated_run's own checks)."""
    dropping = _simulated_run("stream", limit, None, "drop")
    waiting = _simulated_run("stream", limit, None, "wait")
    assert dropping.counts["dropped_stale_groups"] > 0
    assert waiting.counts["dropped_stale_groups"] == 0 and waiting.counts["steps_held_for_old_groups"] > 0
    assert "steps_held_for_old_groups" not in dropping.counts


def test_a_step_waits_only_for_groups_it_is_the_last_to_be_able_to_train() -> None:
    s = GroupScheduler(batch_groups=2, max_inflight=8, stale_groups="wait")
    for gid, v in [(0, 5), (1, 5), (2, 4), (3, 3)]:
        s.submitted(_group(gid, v))
    s.finished(0, _samples(0, [5]))
    s.finished(1, _samples(1, [5]))
    # limit 2, training version 5: group 3 (from version 3) can be trained by this step only
    assert [g.gid for g in s.last_chance(5, 2)] == [3]
    assert s.take_batch(train_version=5, max_staleness=2) is None  # two groups ready, but 3 would be lost
    s.finished(3, _samples(3, [3, 4, 5]))
    assert [g.gid for g in s.take_batch(train_version=5, max_staleness=2)] == [3, 0]  # the oldest first
    assert s.counts["steps_held_for_old_groups"] == 1
    # group 2 (version 4) has one more step: the next step, on 6, is its last and waits for it
    assert s.take_batch(train_version=6, max_staleness=2) is None and not s.last_chance(5, 2)
    # the limit lowered to 0 at run time: no step can train group 2 any more, so none waits for it
    assert not s.last_chance(6, 0) and s.take_batch(train_version=6, max_staleness=0) is None  # 1 ready of 2
    with pytest.raises(ValueError, match="algorithm.stale_groups.*'keep'"):
        GroupScheduler(2, 8, stale_groups="keep")


@pytest.mark.parametrize("gids, workers, first, calls", [
    ([7, 8, 9, 10, 11, 12], 2, 0, [(0, [7, 9, 11]), (1, [8, 10, 12])]),  # six together: one call per worker
    ([7, 8, 9], 4, 3, [(3, [7]), (0, [8]), (1, [9])]),  # fewer groups than workers: a call each, round-robin on
    ([5], 2, 1, [(1, [5])]),
    ([], 2, 0, []),
])
def test_groups_that_finish_together_share_one_reward_call_per_worker(gids, workers, first, calls) -> None:
    from disagg.pipeline import reward_calls

    assert reward_calls(gids, workers, first) == calls


@pytest.mark.parametrize("seed", range(40))
def test_admission_waves_are_whole_batches_whatever_order_groups_finish_in(seed) -> None:
    """The driver's loop as the staleness-1 pipeline test runs it (tests/integration/test_async_pipeline.py):
    each admission is one wave (one streaming call per engine). Room for new groups opens only when a
    sync lands (a whole batch) or a group is dropped, so the first wave holds both batches the limit
    allows and each later one a batch per sync landed since, plus the groups dropped since: whatever
    the order groups finish in and however fast steps and syncs are, a 6-step run makes fewer than
    half as many waves as groups."""
    rng = random.Random(seed)
    weights = {"finish": rng.random(), "train": rng.random(), "sync": rng.random()}
    newest_first = rng.random()  # how often the newest group finishes first (the worst order for staleness)
    s = GroupScheduler(batch_groups=4, max_inflight=64)
    version = engine_version = 1
    training, queued, syncing = False, [], None  # a step runs / versions trained, not synced / syncing
    generating: dict[int, int] = {}  # gid -> the engine version it started on
    waves, groups, trained, landed, dropped = [], 0, 0, 0, 0
    while trained < 6:
        more_steps = trained + int(training) < 6
        room = s.admit(engine_version, version + int(training), 1)
        if room and more_steps:
            assert room == (8 if not waves else 4 * landed + s.counts["dropped_stale_groups"] - dropped), waves
            waves.append(room)
            landed, dropped = 0, s.counts["dropped_stale_groups"]
            for _ in range(room):
                s.submitted(_group(groups, engine_version))
                generating[groups] = engine_version
                groups += 1
        # Free once its step is done (its push sends a snapshot), unless an earlier sync still runs.
        if not training and (not queued or syncing is None) and s.take_batch(version, 1) is not None:
            training = True
        if queued and syncing is None:
            syncing = queued.pop(0)
        events = [e for e, possible in (("finish", generating), ("train", training), ("sync", syncing)) if possible]
        event = rng.choices(events, [weights[e] for e in events])[0]
        if event == "finish":
            gid = max(generating) if rng.random() < newest_first else rng.choice(sorted(generating))
            s.finished(gid, _samples(gid, [generating.pop(gid)]))
        elif event == "train":
            version, training, trained = version + 1, False, trained + 1
            queued.append(version)
        else:
            engine_version, syncing, landed = syncing, None, landed + 1
    assert waves[0] == 8 and len(waves) < groups / 2, (waves, groups)
