"""The chat scheduler: which engine serves a request (pure bookkeeping, no I/O).

Two rules. A new session (one multi-turn trajectory) goes to the healthy engine
with the fewest requests in flight (ties: fewest sessions, then round robin).
A session already placed stays on its engine while that engine is healthy or
draining, so every turn reuses the engine's prefix cache of the conversation so
far; a draining engine finishes its sessions but receives no new ones, and a
dead engine's sessions move to another engine on their next turn.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from enum import Enum

from disagg.errors import RolloutError


class EngineHealth(str, Enum):
    HEALTHY = "healthy"
    DRAINING = "draining"
    DEAD = "dead"


class ChatRouter:
    """Least-in-flight, session-sticky placement over engine ids."""

    def __init__(self, engine_ids: list[int] = (), max_sessions: int = 100_000) -> None:
        self.health: dict[int, EngineHealth] = {}
        self.inflight: Counter = Counter()  # engine -> requests in flight
        self.requests: Counter = Counter()  # engine -> requests routed (all time)
        self.sessions: OrderedDict[str, int] = OrderedDict()  # session -> engine, least recently used first
        self.moved_sessions = 0  # sessions re-placed because their engine died
        self.max_sessions = max_sessions
        self._rr = 0
        for e in engine_ids:
            self.add_engine(e)

    def add_engine(self, engine_id: int) -> None:
        self.health[engine_id] = EngineHealth.HEALTHY

    def set_health(self, engine_id: int, health: EngineHealth | str) -> None:
        if engine_id not in self.health:
            raise KeyError(f"engine {engine_id} is not routed (known: {sorted(self.health)})")
        self.health[engine_id] = EngineHealth(health)

    def acquire(self, session_id: str | None = None) -> int:
        """The engine for the next request of ``session_id`` (None: a one-off request); counts it in flight."""
        engine = self.sessions.get(session_id) if session_id is not None else None
        if engine is not None and self.health.get(engine) in (EngineHealth.HEALTHY, EngineHealth.DRAINING):
            self.sessions.move_to_end(session_id)
        else:
            if engine is not None:
                self.moved_sessions += 1
            engine = self._least_loaded()
            if session_id is not None:
                self.sessions[session_id] = engine
                while len(self.sessions) > self.max_sessions:
                    self.sessions.popitem(last=False)
        self.inflight[engine] += 1
        self.requests[engine] += 1
        return engine

    def release(self, engine_id: int) -> None:
        """A request to ``engine_id`` finished (or failed)."""
        if self.inflight[engine_id] <= 0:
            raise AssertionError(f"release of engine {engine_id} with nothing in flight")
        self.inflight[engine_id] -= 1

    def end_session(self, session_id: str) -> None:
        self.sessions.pop(session_id, None)

    def _least_loaded(self) -> int:
        healthy = sorted(e for e, h in self.health.items() if h is EngineHealth.HEALTHY)
        if not healthy:
            raise RolloutError(f"no healthy engine to route to (engines: "
                               f"{ {e: h.value for e, h in sorted(self.health.items())} })")
        sessions = Counter(self.sessions.values())
        n = len(healthy)
        best = min(range(n), key=lambda i: (self.inflight[healthy[i]], sessions[healthy[i]], (i - self._rr) % n))
        self._rr = (best + 1) % n
        return healthy[best]
