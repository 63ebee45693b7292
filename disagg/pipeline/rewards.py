"""Reward dispatch: finished groups go to the reward workers while generation goes on.

Groups that finish together are scored together, one call per worker (``reward_calls``); with
``reward.num_workers=0`` the driver scores them itself. ``overlap=False`` holds finished groups
until nothing generates and scores them all then: the serial pattern other frameworks use, kept
for the benchmark's comparison.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from disagg.cluster import freeze_heap
from disagg.tasks.base import safe_reward

Scored = tuple[int, list[float], dict[str, int]]  # (gid, rewards, counts of reward errors and the like)


class RewardWorker:
    """A CPU actor scoring groups (wrapped with ``ray.remote`` by ``RewardDispatch``)."""

    def __init__(self, name: str | None, path: str | None, latency_s: float, log_level: str,
                 require_sandbox_isolation: bool = False) -> None:
        from disagg.logs import setup_logging
        from disagg.tasks import get_reward
        from disagg.sandbox import require_filesystem_isolation

        setup_logging("reward", log_level, actor=True)
        if require_sandbox_isolation:
            require_filesystem_isolation()
        self.fn, self.latency_s = get_reward(name, path), latency_s
        self._logged: set[str] = set()
        freeze_heap("reward worker")

    def set_latency(self, latency_s: float) -> None:
        """``reward.latency_s`` of the next run (a benchmark's runs share their workers)."""
        self.latency_s = latency_s

    def score(self, texts: list[str], row: dict[str, Any]) -> tuple[list[float], dict[str, int]]:
        """Rewards of a group's texts; a raising or NaN reward scores 0 and is counted."""
        counts: Counter = Counter()
        rewards = [safe_reward(self.fn, t, row, counts, self._logged, self.latency_s) for t in texts]
        return rewards, dict(counts)

    def score_groups(self, groups: list[tuple[list[str], dict[str, Any]]]) -> list[tuple[list[float], dict[str, int]]]:
        """``score`` of each (texts, row): the groups that finished together, in one call."""
        return [self.score(texts, row) for texts, row in groups]


def start_reward_workers(cfg) -> list[Any]:
    """``reward.num_workers`` reward worker actors for ``cfg`` (none: the driver scores)."""
    import ray

    rc = cfg.reward
    cls = ray.remote(RewardWorker).options(num_cpus=rc.cpus_per_worker)
    return [cls.remote(rc.name, rc.path, rc.latency_s, cfg.logging.level, rc.require_sandbox_isolation)
            for _ in range(rc.num_workers)]


def reward_calls(gids: list[int], num_workers: int, next_worker: int) -> list[tuple[int, list[int]]]:
    """How groups that finished together go to the reward workers (pure): one call per worker, at
    most ``num_workers`` calls, the groups dealt round-robin from worker ``next_worker`` on.
    Returns ``(worker index, gids)`` per call."""
    return [((next_worker + k) % num_workers, gids[k::num_workers]) for k in range(min(num_workers, len(gids)))]


class RewardDispatch:
    """Owns the reward workers and the groups between generation and the ready buffer: held
    (finished, not sent yet) and scoring (in a worker's call). ``counts``: its own events
    (``reward_calls``)."""

    def __init__(self, cfg, scorer, overlap: bool = True, workers: list[Any] | None = None) -> None:
        self.cfg, self.scorer, self.overlap = cfg, scorer, overlap
        self.counts: Counter = Counter()
        self.workers: list[Any] = []
        self._lent = workers  # started by the caller (a benchmark's runs share them): left alive at close
        self.held: list[tuple[int, list[str], dict[str, Any]]] = []  # (gid, texts, row)
        self.calls: dict[Any, list[int]] = {}  # a worker's call -> the gids it scores
        self._next_worker = 0  # the worker the next call goes to first

    def start(self) -> None:
        import ray

        if self._lent is not None:
            ray.get([w.set_latency.remote(self.cfg.reward.latency_s) for w in self._lent], timeout=120)
            self.workers = list(self._lent)
        else:
            self.workers = start_reward_workers(self.cfg)

    def close(self) -> None:
        import ray

        if self._lent is None:
            for w in self.workers:
                ray.kill(w)
        self.workers = []

    def scoring(self) -> int:
        """Groups in a worker's call."""
        return sum(len(g) for g in self.calls.values())

    def inflight(self) -> int:
        """Groups finished generating and not scored yet."""
        return self.scoring() + len(self.held)

    def finished(self, gid: int, texts: list[str], row: dict[str, Any]) -> None:
        """A group finished generating: it waits for the next ``flush``."""
        self.held.append((gid, texts, row))

    def flush(self, generating: bool) -> list[Scored]:
        """Send the held groups (all of them, at once, unless ``overlap`` is off and something still
        generates); what the driver scored itself comes back at once."""
        if not self.held or (not self.overlap and generating):
            return []
        held, self.held = self.held, []
        if not self.workers:
            out = []
            for gid, texts, row in held:
                counts: Counter = Counter()
                out.append((gid, [self.scorer.reward(t, row, counts) for t in texts], dict(counts)))
            return out
        # A call per group would cost each group a Ray task in a worker; on a small machine that
        # overhead alone took a quarter of a core.
        by_gid = {gid: (texts, row) for gid, texts, row in held}
        sent = reward_calls([gid for gid, _, _ in held], len(self.workers), self._next_worker)
        for worker, gids in sent:
            self.calls[self.workers[worker].score_groups.remote([by_gid[g] for g in gids])] = gids
        self._next_worker = (self._next_worker + len(sent)) % len(self.workers)
        self.counts["reward_calls"] += len(sent)
        return []

    def done(self, ref) -> list[Scored]:
        """A worker's call finished: its groups' rewards."""
        import ray

        return [(gid, rewards, counts) for gid, (rewards, counts) in zip(self.calls.pop(ref), ray.get(ref))]
