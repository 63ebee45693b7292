"""The coordinator's record of dead engines, and the fault points the fault-injection tests arm."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from disagg import faults
from disagg.control.state import CoordinatorState
from disagg.control.types import EngineInfo, EngineState
from disagg.transport.manifest import Manifest


def _state(n: int) -> CoordinatorState:
    state = CoordinatorState(max_staleness=1)
    for i in range(n):
        state.register_engine(EngineInfo(i, "127.0.0.1", 100 + i, "", EngineState.WAITING_FOR_WEIGHTS))
    state.set_transport_members(list(range(n)))
    state.announce_version(Manifest(policy_version=3, bucket_bytes=1024, tensors=(), buckets=()), trainer_step=2)
    return state


def test_a_dead_engine_no_longer_holds_the_committed_version():
    state = _state(2)
    state.ack_version(0, 3, state.get_manifest(3).layout_digest())
    assert state.committed_version() == 0  # engine 1 has not acked
    state.engine_died(1, "stuck: no answer to a health check for 60 s")
    assert state.committed_version() == 3
    st = state.status()
    assert st.engine(1).state is EngineState.DEAD and "stuck" in st.engine(1).message
    assert [(e.kind, e.message) for e in st.events] == [("engine_dead", "engine 1: stuck: no answer to a health check "
                                                                         "for 60 s")]


def test_only_the_latest_dead_engines_stay_in_the_status():
    state = _state(12)
    for i in range(11):
        state.engine_died(i, f"killed {i}")
    st = state.status()
    dead = [e.engine_id for e in st.engines if e.state is EngineState.DEAD]
    assert dead == list(range(3, 11))  # the last 8
    assert st.engine(11).state is EngineState.WAITING_FOR_WEIGHTS
    assert len(st.events) == 11


def test_events_keep_the_last_hundred_in_order():
    state = _state(0)
    for i in range(130):
        state.record_event("sync_retried", f"version {i}")
    events = state.status().events
    assert [e.message for e in events] == [f"version {i}" for i in range(30, 130)]


def test_an_armed_fault_point_fires_after_n_hits_and_only_once():
    faults.arm("receive_bucket", "raise", after=3)
    faults.hit("receive_bucket")
    faults.hit("receive_bucket")
    with pytest.raises(faults.FaultInjected, match="receive_bucket"):
        faults.hit("receive_bucket")
    faults.hit("receive_bucket")  # disarmed: nothing happens


@pytest.mark.parametrize("args,match", [(("nowhere",), "unknown fault point 'nowhere'"),
                                        (("receive_bucket", "explode"), "unknown fault action 'explode'"),
                                        (("receive_bucket", "exit", 0), "after must be >= 1")])
def test_bad_fault_specs_are_refused(args, match):
    with pytest.raises(ValueError, match=match):
        faults.arm(*args)


def test_faults_armed_from_the_environment_and_a_point_that_stops_its_process():
    """What `disagg train` arms from DISAGG_FAULTS in its driver: here the second hit stops the process."""
    code = ("from disagg import faults\nfaults.arm_from_env()\nfaults.hit('checkpoint_written')\n"
            "print('first hit passed', flush=True)\nfaults.hit('checkpoint_written')\n"
            "print('not stopped', flush=True)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, faults.ENV: "checkpoint_written:stop:2"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the process did not stop at the second hit"
            time.sleep(0.05)
    finally:
        proc.kill()
    out, _ = proc.communicate(timeout=30)
    assert out == "first hit passed\n"
