"""Admission control and batch formation over prompt groups: pure bookkeeping, no Ray, no vLLM.

Staleness: a sample's staleness is the version being trained minus the oldest version among its
tokens. ``GroupScheduler`` enforces ``max_staleness`` where batches are formed (stale groups are
dropped and counted) and keeps generation from producing groups that would be dropped (in-flight
plus buffered groups never exceed what the train steps still able to take them can consume). A
group still generating when a sync makes it too stale for any step is stopped by its engine
(``GenRequest.stale_drop``) and counted here (``stopped_stale``): a long response that cannot make
the limit does not hold a slot and the engine's time until it ends.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from disagg.rollout.types import GenResult
from disagg.samples import TrainSample


@dataclass
class Group:
    """One prompt's group from submission to training."""

    gid: int
    row: dict[str, Any]
    prompt_ids: tuple[int, ...]
    engine: int
    submitted_version: int
    t_submit: float
    result: GenResult | None = None
    samples: list[TrainSample] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    generating: bool = True  # on its engine (or runner) until it comes back, its call fails or its engine dies

    @property
    def min_version(self) -> int:
        """The oldest policy version among the group's tokens (its submission version if none)."""
        return min((s.policy_version for s in self.samples), default=self.submitted_version)

    @property
    def max_version(self) -> int:
        return self.result.max_version if self.result is not None else self.submitted_version


class GroupScheduler:
    """Admission control and batch formation over prompt groups (no Ray, no vLLM).

    ``mode="stream"``: up to ``max_inflight`` groups generate at once and a batch is
    ``batch_groups`` complete groups, the oldest policy version first (then completion
    order); the others carry over. ``"batch"``:
    a step's groups are submitted together and the batch is handed over only when
    all of them completed.
    """

    def __init__(self, batch_groups: int, max_inflight: int, mode: str = "stream", stale_groups: str = "drop") -> None:
        if mode not in ("stream", "batch"):
            raise ValueError(f"rollout.scheduler must be 'stream' or 'batch', got {mode!r}")
        if stale_groups not in ("drop", "wait"):
            raise ValueError(f"algorithm.stale_groups must be 'drop' or 'wait', got {stale_groups!r}")
        self.batch_groups, self.max_inflight, self.mode = batch_groups, max_inflight, mode
        self.stale_groups = stale_groups
        self._held = False  # the next batch waits for groups that would be too stale after it ('wait')
        self.inflight: dict[int, Group] = {}  # generating or being scored
        self.ready: deque[Group] = deque()  # scored, waiting for a batch, in completion order
        self.counts: Counter = Counter()
        self._on_engine: Counter = Counter()  # engine id -> its groups generating (``generating_on``)

    def capacity(self, engine_version: int, next_train_version: int, max_staleness: int) -> int:
        """How many new groups may be submitted now.

        A group started now on ``engine_version`` can be trained by the steps on
        versions ``next_train_version`` .. ``engine_version + max_staleness``; each takes
        ``batch_groups`` groups, and the groups already in flight or ready come first.
        """
        steps = engine_version + max_staleness - next_train_version + 1
        room = max(0, steps) * self.batch_groups - len(self.inflight) - len(self.ready)
        if self.mode == "batch":
            return min(self.batch_groups, room) if not self.inflight and not self.ready else 0
        return max(0, min(self.max_inflight - len(self.inflight), room))

    def admit(self, engine_version: int, next_train_version: int, max_staleness: int) -> int:
        """The driver's admission step: drop ready groups the next step cannot train, then the capacity."""
        self.drop_stale(next_train_version, max_staleness)
        return self.capacity(engine_version, next_train_version, max_staleness)

    def submitted(self, group: Group) -> None:
        """``group`` goes to its engine (``engine`` < 0: an agent runner); a group generated again
        replaces its earlier entry."""
        old = self.inflight.get(group.gid)
        if old is not None:
            self._stopped(old)
        self.inflight[group.gid] = group
        if group.engine >= 0:
            self._on_engine[group.engine] += 1

    def generating_on(self, engine: int) -> int:
        """How many groups engine ``engine`` is generating now: the one count of it (the fleet places
        groups and lets a draining engine leave by it; the recorder reports it)."""
        return self._on_engine[engine]

    def _stopped(self, group: Group) -> None:
        if group.generating:
            group.generating = False
            if group.engine >= 0:
                self._on_engine[group.engine] -= 1

    def generated(self, gid: int, result: GenResult) -> Group:
        """Group ``gid`` came back from its engine or runner (scored next)."""
        group = self.inflight[gid]
        self._stopped(group)
        group.result = result
        return group

    def off_engine(self, gids: list[int]) -> None:
        """Groups whose call failed or whose engine died: no longer generating there (the caller
        submits them again or drops them)."""
        for gid in gids:
            if gid in self.inflight:
                self._stopped(self.inflight[gid])

    def finished(self, gid: int, samples: list[TrainSample] | None, rewards: list[float] | None = None) -> Group:
        """A group is done generating and scoring; ``samples=None`` means it was dropped (counted by the caller)."""
        group = self.inflight.pop(gid)
        self._stopped(group)
        if samples:
            group.samples, group.rewards = samples, list(rewards or [])
            self.ready.append(group)
        return group

    def drop_stale(self, train_version: int, max_staleness: int) -> int:
        """Drop (and count) ready groups too stale for a step on ``train_version``; returns how many.

        Done before admission too: buffered groups that can no longer be trained (the
        limit was lowered at run time) must not hold the room new groups need.
        """
        keep: deque[Group] = deque()
        for g in self.ready:
            if train_version - g.min_version > max_staleness:
                self.counts["dropped_stale"] += len(g.samples)
                self.counts["dropped_stale_groups"] += 1
            else:
                keep.append(g)
        dropped = len(self.ready) - len(keep)
        self.ready = keep
        return dropped

    def stopped_stale(self, gid: int, samples: int) -> None:
        """Group ``gid``'s engine stopped it once no step could train it (its answer ``dropped="stale"``):
        dropped and counted as stale like a ready group past the limit, ``samples`` samples, and
        counted as stopped in flight (``dropped_stale_in_flight_groups``)."""
        self.finished(gid, None)
        self.counts["dropped_stale"] += samples
        self.counts["dropped_stale_groups"] += 1
        self.counts["dropped_stale_in_flight_groups"] += 1

    def last_chance(self, train_version: int, max_staleness: int) -> list[Group]:
        """Groups still generating or scoring that only the step on ``train_version`` can train: the
        next one, on ``train_version + 1``, would find them too stale (``algorithm.stale_groups=wait``
        holds the step for them). Not those this step cannot train either (a limit lowered at run
        time): they are dropped as stale whatever the step does."""
        return [g for g in self.inflight.values()
                if train_version - g.min_version <= max_staleness < train_version + 1 - g.min_version]

    def take_batch(self, train_version: int, max_staleness: int) -> list[Group] | None:
        """The groups to train on ``train_version``, or None if not ready yet.

        Ready groups whose oldest token is more than ``max_staleness`` versions behind
        are dropped first (``counts['dropped_stale']`` samples, ``['dropped_stale_groups']``).
        With ``stale_groups="wait"`` (stream) no batch is formed while a group that only this step
        can train is still in flight (``last_chance``); it is then among the oldest, taken first.
        """
        self.drop_stale(train_version, max_staleness)
        if self.mode == "stream":
            if self.stale_groups == "wait" and self.last_chance(train_version, max_staleness):
                self._held = True
                return None
            if len(self.ready) < self.batch_groups:
                return None
            if self._held:
                self.counts["steps_held_for_old_groups"] += 1
                self._held = False
            # Oldest policy version first (completion order among equals): a long group that
            # finished late is trained before it becomes too stale, not behind newer short ones.
            order = sorted(range(len(self.ready)), key=lambda i: self.ready[i].min_version)[: self.batch_groups]
            chosen = set(order)
            batch = [self.ready[i] for i in sorted(order, key=lambda i: (self.ready[i].min_version, i))]
            self.ready = deque(g for i, g in enumerate(self.ready) if i not in chosen)
            return batch
        if self.inflight or not self.ready:
            return None
        batch = list(self.ready)
        self.ready.clear()
        return batch
