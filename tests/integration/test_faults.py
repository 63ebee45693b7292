"""Fault injection on real parts (Ray, vLLM on CPU, gloo, gRPC): nothing lost when things fail.

One run with two engines meets three engine failures, one after the other, each once the
previous replacement serves:
1. ``ray.kill`` of engine 0 while it generates;
2. engine 1's process exits in the middle of a weight sync, after two of the broadcast's
   buckets (a fault point armed in that engine: ``os._exit``, as a crash would);
3. engine 2 is frozen with SIGSTOP: alive, silent; the health check must call it stuck
   within ``rollout.health_timeout_s`` and kill it.
Every failure must end in a replacement that receives the trainer's weights before it takes
prompts, with no prompt group lost, no sample trained beyond the staleness limit and no
request answered on dummy weights.

The driver killed with SIGKILL in the middle of a `disagg train` run, then resumed: in
test_trainer_death.py (its chain of runs has that run already).
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.conftest import small_config
from tests.recovery import first_sync_and_pipeline

HEALTH_TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def faulty_run(ray_session, model_cache, tmp_path_factory):
    import ray

    from disagg.control.client import CoordinatorClient
    from disagg.job import Job
    from disagg.model.warmstart import prepare_model

    cfg = small_config(model_cache, trainer={"total_steps": 20_000}, algorithm={"max_staleness": 1},
                       reward={"num_workers": 1}, rollout={"num_engines": 2, "health_interval_s": 1.0,
                                                           "health_timeout_s": HEALTH_TIMEOUT_S},
                       # several buckets per sync, so a receiver can die in the middle of one
                       transport={"bucket_bytes": 256 * 1024, "timeout_s": 30})
    model_path = prepare_model(cfg)
    job = Job.start(cfg, tmp_path_factory.mktemp("faults-run"), model_path)
    client = CoordinatorClient(job.coordinator.address, timeout_s=30, token=job.token)
    faults: list[dict] = []  # what was done, when, to which engine
    status: list = []

    def serving_new(rec) -> int | None:
        """The newest engine, once it serves and trained groups (the previous fault is over)."""
        newest = max(pipeline.serving, default=None)
        if newest is not None and pipeline.trained_by_engine[newest] >= 2 and rec["rollout/num_engines"] == 2:
            return newest
        return None

    def on_step(step: int, rec: dict) -> None:
        status.append((step, client.status(), dict(rec)))
        done = len(faults)
        if done == 0 and step == 2:
            faults.append({"kind": "ray.kill", "engine": 0, "step": step, "t": time.perf_counter()})
            ray.kill(job.rollout.handle(0))
        elif done == 1 and serving_new(rec) == 2:
            faults.append({"kind": "exit mid-sync", "engine": 1, "step": step, "t": time.perf_counter()})
            ray.get(job.rollout.handle(1).arm_fault.remote("receive_bucket", "exit", 2))
        elif done == 2 and serving_new(rec) == 3:
            pid = client.status().engine(2).pid
            faults.append({"kind": "SIGSTOP", "engine": 2, "step": step, "t": time.perf_counter(), "pid": pid})
            os.kill(pid, signal.SIGSTOP)
        elif done == 3 and serving_new(rec) == 4:
            faults.append({"kind": "stop", "step": step})
            client.stop("test done")
        elif time.perf_counter() - t_start > 900 and faults[-1]["kind"] != "stop":  # the asserts below fail
            faults.append({"kind": "stop", "step": step})
            client.stop("test timed out")

    try:
        pipeline = first_sync_and_pipeline(cfg, job, model_path, on_step)
        t_start = time.perf_counter()
        records = pipeline.run(cfg.trainer.total_steps)
        yield {"job": job, "pipeline": pipeline, "records": records, "faults": faults, "status": status,
               "final": client.status()}
    finally:
        for f in faults:  # never leave a stopped process behind
            if f["kind"] == "SIGSTOP":
                try:
                    os.kill(f["pid"], signal.SIGCONT)
                except ProcessLookupError:
                    pass
        client.close()
        job.shutdown()


def test_every_fault_was_injected_and_the_run_finished(faulty_run):
    kinds = [f["kind"] for f in faulty_run["faults"]]
    assert kinds == ["ray.kill", "exit mid-sync", "SIGSTOP", "stop"], faulty_run["faults"]
    assert faulty_run["pipeline"].stopped == "test done"
    last = faulty_run["records"][-1]
    assert last["rollout/engine_deaths"] == 3
    assert last["rollout/engines_replaced"] == 3
    assert last["rollout/num_engines"] == 2


def test_nothing_lost_nothing_too_stale_nothing_served_on_dummy_weights(faulty_run):
    records, pipeline = faulty_run["records"], faulty_run["pipeline"]
    assert all(r["rollout/prompts_lost"] == 0 for r in records)
    assert pipeline.prompts_lost() == 0
    assert all(r["samples/trained_beyond_staleness"] == 0 for r in records)
    assert max(r["policy/staleness_max"] for r in records) <= 1
    assert all(r["rollout/dummy_served"] == 0 for r in records)
    # The groups the dead engines had in flight went back to the queue and were trained.
    assert records[-1]["rollout/groups_requeued"] >= 1
    # Every replacement trained groups, none of them older than the sync it joined at.
    for eid in (2, 3, 4):
        assert pipeline.trained_by_engine[eid] >= 2
        assert pipeline.first_trained_version[eid] >= pipeline.join_version[eid]


def test_a_receiver_dying_mid_sync_is_retried_on_a_rebuilt_group(faulty_run):
    records, pipeline = faulty_run["records"], faulty_run["pipeline"]
    assert records[0]["weight_sync/bytes"] > 2 * 256 * 1024  # more than two buckets: it died mid-broadcast
    assert records[-1]["transport/sync_failures"] >= 1
    assert records[-1]["transport/sync_retries"] >= 1
    versions = [r["policy_version"] for r in records]
    assert versions == list(range(versions[0], versions[0] + len(versions)))  # no version skipped
    # Its model process exited in the middle of the broadcast: whichever call noticed first says so.
    why = faulty_run["final"].engine(1).message
    assert "EngineDeadError" in why or "during the sync of version" in why, why
    retried = [e.message for e in faulty_run["final"].events if e.kind == "sync_retried"]
    failed = [e.message for e in faulty_run["final"].events if e.kind == "sync_failed"]
    assert [m.split(":")[0] for m in failed] == [m.split(" is sent")[0] for m in retried]


def test_a_stuck_engine_is_found_within_the_health_timeout(faulty_run):
    sigstop = next(f for f in faulty_run["faults"] if f["kind"] == "SIGSTOP")
    final = faulty_run["final"]
    dead = final.engine(2)
    assert dead.state.value == "DEAD" and "stuck" in dead.message
    found = next(e for e in final.events if e.kind == "engine_dead" and e.message.startswith("engine 2:"))
    # wall clock of the event vs the fault (both on this machine): within the timeout plus one check period
    elapsed = found.unix_s - (time.time() - (time.perf_counter() - sigstop["t"]))
    assert elapsed <= HEALTH_TIMEOUT_S + 5, elapsed


def test_the_status_shows_the_deaths_and_replacements(faulty_run):
    final = faulty_run["final"]
    assert [e.engine_id for e in final.engines if e.state.value == "DEAD"] == [0, 1, 2]
    kinds = [e.kind for e in final.events]
    assert kinds.count("engine_dead") == 3 and kinds.count("engine_replaced") == 3
    assert kinds.count("engine_joined") == 3
    assert "sync_failed" in kinds and "sync_retried" in kinds
    assert {e.engine_id for e in final.engines if e.state.value != "DEAD"} == {3, 4}
    # While a replacement was starting, the status listed the dead engine with its reason.
    assert any(st.engine(0).state.value == "DEAD" and "died" in st.engine(0).message
               for _, st, _ in faulty_run["status"] if 0 in {e.engine_id for e in st.engines})
