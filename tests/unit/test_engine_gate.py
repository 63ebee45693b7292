"""The engine actor's weights gate: a request is let through only by a check of the gate made in its
own task, so a sync that starts while the request is being let through holds it (no vLLM here: the
gate is the actor's own asyncio state; tests/integration/test_async_pipeline.py and
test_resubmit.py run it with vLLM)."""

from __future__ import annotations

import asyncio
import random
import re

import pytest

from disagg.config.schema import RolloutConfig
from disagg.rollout.engine import EngineActor


def _actor(tmp_path) -> EngineActor:
    actor = EngineActor(0, str(tmp_path), RolloutConfig(weights_wait_timeout_s=30.0), None, rpc_timeout_s=5.0)
    actor._weights_loaded.set()  # the first sync landed
    return actor


def test_a_sync_starting_while_a_request_is_let_through_holds_it(tmp_path):
    """Requests wait on a closed gate; a sync opens it and another closes it again after a random
    number of event-loop turns. Every request must find the gate open when it counts itself in
    flight (as ``_run`` does, with no await after the wait). Before the fix, a request whose wait
    ended went on a turn later, sometimes into the next sync: 580 of the 1200 here."""
    actor = _actor(tmp_path)
    rng = random.Random(0)
    seen: list[bool] = []

    async def request() -> None:
        await actor._wait_weights("a test request")
        seen.append(actor._weights_loaded.is_set() and actor._not_loading.is_set())  # what _run relies on

    async def main() -> None:
        for _ in range(300):
            actor._not_loading.clear()  # a sync loading
            waiting = [asyncio.ensure_future(request()) for _ in range(4)]
            await asyncio.sleep(0)
            actor._not_loading.set()  # it ended: the gate opens
            for _ in range(rng.randint(0, 3)):  # the next sync starts after a few turns of the loop
                await asyncio.sleep(0)
            actor._not_loading.clear()
            for _ in range(3):
                await asyncio.sleep(0)
            actor._not_loading.set()
            await asyncio.wait_for(asyncio.gather(*waiting), timeout=5)

    asyncio.run(main())
    assert len(seen) == 1200
    assert all(seen), f"{seen.count(False)} of {len(seen)} requests let through while a sync was loading"


def test_an_open_gate_lets_a_request_through_without_a_turn_of_the_loop(tmp_path):
    actor = _actor(tmp_path)
    order: list[str] = []

    async def request() -> None:
        await actor._wait_weights("a test request")
        order.append("request")

    async def main() -> None:
        task = asyncio.ensure_future(request())
        await asyncio.sleep(0)  # the request's first step: the gate is open, it goes straight on
        order.append("one turn later")
        await task

    asyncio.run(main())
    assert order == ["request", "one turn later"]


def test_a_closed_gate_times_out_naming_what_waited(tmp_path):
    actor = EngineActor(0, str(tmp_path), RolloutConfig(weights_wait_timeout_s=0.2, wait_log_interval_s=0.1), None,
                        rpc_timeout_s=5.0)

    async def main() -> None:
        await actor._wait_weights("first weights (request r1)")

    with pytest.raises(TimeoutError, match=re.escape("first weights (request r1)")):
        asyncio.run(main())
