"""The elastic rollout pool on real parts: Ops.ScaleRollout over gRPC during a run scales
1 -> 2 engines (the new vLLM engine starts on dummy weights, joins a rebuilt gloo transport
group at the next sync, then takes prompt groups) and back 2 -> 1 (the newest engine drains
and leaves at a sync), with zero prompts lost."""

from __future__ import annotations

import grpc
import pytest

from tests.conftest import small_config


@pytest.fixture(scope="module")
def scaled_run(ray_session, model_cache, tmp_path_factory):
    from transformers import AutoTokenizer

    from disagg.control.client import ControlRpcError, CoordinatorClient
    from disagg.job import Job
    from disagg.model.warmstart import prepare_model
    from disagg.train import make_pipeline

    cfg = small_config(model_cache, trainer={"total_steps": 1000}, algorithm={"max_staleness": 1},
                       reward={"num_workers": 1})
    model_path = prepare_model(cfg)
    job = Job.start(cfg, tmp_path_factory.mktemp("elastic-run"), model_path)
    client = CoordinatorClient(job.coordinator.address, timeout_s=30, token=job.token)
    seen = {"errors": {}, "events": [], "status": [], "epochs": []}

    def on_step(step: int, rec: dict) -> None:
        st = client.status()
        seen["status"].append((step, st, dict(rec)))
        events = [e for e, _ in seen["events"]]
        if step == 1:
            for n in (0, 64):
                try:
                    client.scale_rollout(n)
                except ControlRpcError as e:
                    seen["errors"][n] = e
            seen["events"].append(("up", client.scale_rollout(2, "test: scale up")))
            seen["epochs"].append(job.transport_epoch)
        elif "down" not in events and rec["rollout/num_engines"] == 2 and pipeline.trained_by_engine[1] >= 3:
            seen["epochs"].append(job.transport_epoch)
            seen["events"].append(("down", client.scale_rollout(1, "test: scale down")))
        elif "down" in events and "stop" not in events and rec["rollout/engines_left"] == 1:
            seen["epochs"].append(job.transport_epoch)
            seen["events"].append(("stop", client.stop("test done")))
        elif step >= 600 and "stop" not in events:  # the test fails below; do not run 1000 steps
            seen["events"].append(("stop", client.stop("test timed out")))

    try:
        tok = AutoTokenizer.from_pretrained(model_path)
        job.sync_weights(1, trainer_step=0)
        pipeline = make_pipeline(cfg, job, tok, on_step=on_step)
        records = pipeline.run(cfg.trainer.total_steps)
        final = client.status()
        yield {"job": job, "pipeline": pipeline, "records": records, "seen": seen, "final": final}
    finally:
        client.close()
        job.shutdown()


def test_scale_rollout_rejects_bad_sizes_with_status_codes(scaled_run):
    errors = scaled_run["seen"]["errors"]
    assert errors[0].code == grpc.StatusCode.INVALID_ARGUMENT.name and "num_engines must be >= 1" in errors[0].details
    assert errors[64].code == grpc.StatusCode.FAILED_PRECONDITION.name
    assert "room for" in errors[64].details and "CPU" in errors[64].details


def test_scale_up_joins_at_a_sync_and_serves_trained_weights(scaled_run):
    pipeline, seen = scaled_run["pipeline"], scaled_run["seen"]
    events = dict(seen["events"])
    assert "scaling the rollout pool from 1 to 2 engines" in events["up"]
    # The new engine (id 1) trained groups, and none of its tokens came from before the
    # version whose sync it joined at: it never served its dummy weights.
    assert pipeline.trained_by_engine[1] >= 3
    assert pipeline.join_version[1] >= 2
    assert pipeline.first_trained_version[1] >= pipeline.join_version[1]
    # While both served, the status showed engine 1 ready, on the trainer's weights.
    both = [st for _, st, rec in seen["status"] if rec["rollout/num_engines"] == 2]
    assert both, "no step ran with two engines"
    e1 = both[-1].engine(1)
    assert e1.state.value in ("READY", "SYNCING") and e1.policy_version >= pipeline.join_version[1]
    assert any(st.engine(1).inflight_groups > 0 or st.engine(1).tokens_per_s > 0 for st in both)


def test_scale_down_drains_and_loses_no_prompt(scaled_run):
    pipeline, records, seen, final = (scaled_run[k] for k in ("pipeline", "records", "seen", "final"))
    engines = [r["rollout/num_engines"] for r in records]
    assert engines[0] == 1 and 2 in engines and engines[-1] == 1
    assert records[-1]["rollout/engines_joined"] == 1 and records[-1]["rollout/engines_left"] == 1
    # Every prompt group drawn was trained, dropped with a count, or is still in flight.
    assert all(r["rollout/prompts_lost"] == 0 for r in records)
    assert pipeline.prompts_lost() == 0
    assert records[-1]["rollout/prompts_drawn"] >= pipeline.fate["trained"] > 0
    # Up and down each rebuilt the transport group once (a new epoch each).
    start_epoch, up_done, down_done = seen["epochs"]
    assert up_done == start_epoch + 1 and down_done == up_done + 1
    assert [e.engine_id for e in final.engines] == [0]
    rollout_pool = [p for p in final.pools if p.name == "rollout"][0]
    assert rollout_pool.num_workers == 1 and final.target_engines == 1
    # The run went on after the engine left (steps with one engine again) and stopped cleanly.
    assert pipeline.stopped == "test done"
    assert engines.count(1) > engines.index(2)
