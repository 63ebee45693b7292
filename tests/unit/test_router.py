"""The chat scheduler: least in-flight placement of new sessions, sticky sessions, drained/dead engines."""

import random
from collections import Counter

import pytest

from disagg.agent.router import ChatRouter, EngineHealth
from disagg.errors import RolloutError


def _simulate(router: ChatRouter, num_sessions: int, turns: int, seed: int) -> dict[str, list[int]]:
    """Sessions interleaved at random, a few requests in flight at once; returns each session's engines."""
    rng = random.Random(seed)
    pending = {f"s{i}": turns for i in range(num_sessions)}
    placed: dict[str, list[int]] = {s: [] for s in pending}
    inflight: list[tuple[str, int]] = []
    while pending or inflight:
        busy = {x for x, _ in inflight}
        free = sorted(s for s in pending if s not in busy)  # a session's turns are sequential
        if free and (len(inflight) < 6 or rng.random() < 0.3):
            s = rng.choice(free)
            e = router.acquire(s)
            placed[s].append(e)
            inflight.append((s, e))
            pending[s] -= 1
            if pending[s] == 0:
                del pending[s]
        else:
            s, e = inflight.pop(rng.randrange(len(inflight)))
            router.release(e)
    return placed


@pytest.mark.parametrize("num_engines", [2, 3, 5])
def test_sessions_stick_and_load_spreads(num_engines):
    router = ChatRouter(list(range(num_engines)))
    placed = _simulate(router, num_sessions=60, turns=4, seed=num_engines)
    for s, engines in placed.items():
        assert len(set(engines)) == 1, f"session {s} moved between healthy engines: {engines}"
    per_engine = Counter(router.requests)
    assert sum(per_engine.values()) == 240
    # Least in-flight placement spreads sessions evenly: no engine gets more than 1.5x its share.
    share = 240 / num_engines
    assert max(per_engine.values()) <= 1.5 * share, per_engine
    assert min(per_engine.values()) >= 0.5 * share, per_engine
    assert all(v == 0 for v in router.inflight.values())


def test_new_session_goes_to_least_loaded_engine():
    router = ChatRouter([0, 1, 2])
    busy = [router.acquire(None) for _ in range(3)]  # one request on each
    assert sorted(busy) == [0, 1, 2]
    router.acquire(None)  # a second on some engine
    router.release(1)  # engine 1 now has nothing in flight
    assert router.acquire("new") == 1


def test_draining_engine_keeps_its_sessions_but_gets_no_new_ones():
    router = ChatRouter([0, 1])
    first = router.acquire("a")
    router.release(first)
    router.set_health(first, EngineHealth.DRAINING)
    assert router.acquire("a") == first  # the running trajectory finishes where its prefix cache is
    router.release(first)
    other = 1 - first
    assert {router.acquire(f"n{i}") for i in range(10)} == {other}


def test_dead_engine_sessions_move_and_no_healthy_engine_is_an_error():
    router = ChatRouter([0, 1])
    e = router.acquire("a")
    router.release(e)
    router.set_health(e, "dead")
    assert router.acquire("a") == 1 - e
    assert router.moved_sessions == 1
    router.set_health(1 - e, "dead")
    with pytest.raises(RolloutError, match="no healthy engine"):
        router.acquire("b")
    with pytest.raises(KeyError, match="engine 7"):
        router.set_health(7, "dead")


def test_session_table_is_bounded():
    router = ChatRouter([0, 1], max_sessions=10)
    for i in range(50):
        router.release(router.acquire(f"s{i}"))
    assert len(router.sessions) == 10 and "s49" in router.sessions and "s0" not in router.sessions
