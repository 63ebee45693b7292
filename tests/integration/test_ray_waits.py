"""``ray_get_logged``, the one wait every driver-side Ray call goes through, on a real local Ray: the
results in order, a failed party surfacing while its siblings still run, and the deadline."""

from __future__ import annotations

import logging
import time

import pytest

from disagg.logs import ray_get_logged

log = logging.getLogger("test")


def test_results_come_back_in_order_a_failure_surfaces_before_its_siblings_finish_and_the_deadline_holds(
        ray_session, caplog):
    ray = ray_session

    @ray.remote
    def value(x, delay=0.0):
        time.sleep(delay)
        return x

    @ray.remote
    def fails():
        raise ValueError("party 1 broke")

    assert ray_get_logged([value.remote(1), value.remote(2, 0.2)], what="two", timeout_s=30, log=log) == [1, 2]
    assert ray_get_logged(value.remote("one"), what="one", timeout_s=30, log=log) == "one"

    slow = value.remote(3, 60.0)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="party 1 broke"):
        ray_get_logged([slow, fails.remote()], what="a sync", timeout_s=50, log=log, interval_s=0.5)
    assert time.monotonic() - t0 < 20  # not after the slow sibling's 60 s, nor the 50 s deadline

    caplog.set_level(logging.INFO, logger="test")
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"timed out after 2s waiting for the slow one \(1 of 1 pending\)"):
        ray_get_logged(slow, what="the slow one", timeout_s=2, log=log, interval_s=0.5)
    assert 1.9 < time.monotonic() - t0 < 15
    assert "still waiting for the slow one: 1 of 1 pending" in caplog.text
    ray.cancel(slow, force=True)
