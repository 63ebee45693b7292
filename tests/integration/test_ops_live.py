"""Operating a live `disagg train` run (a subprocess: real Ray, vLLM, gloo) over the Ops gRPC service:
token, watch, pause/resume, set-staleness, checkpoint, graceful stop; and scraping its Prometheus
endpoints (the coordinator's and each engine's vLLM /metrics) while it runs."""

from __future__ import annotations

import json
import os
import stat
import threading
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from disagg.control.auth import read_token
from disagg.control import ctl
from disagg.control.client import ControlRpcError, CoordinatorClient
from tests.conftest import SMALL_CLI, disagg_process

ARGS = ["trainer.total_steps=2000", *SMALL_CLI]  # far more steps than the test lets it run: it ends on Stop
BATCH_GROUPS = 4  # algorithm.prompts_per_step in SMALL_CLI


def _wait(cond, timeout_s: float, what: str, proc=None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run exited ({proc.returncode}) while waiting for {what}: "
                                 f"{proc.stderr.read()[-3000:]}")
        value = cond()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


@pytest.fixture(scope="module")
def live_run(tmp_path_factory, model_cache):
    run_dir = tmp_path_factory.mktemp("ops") / "run"
    proc = disagg_process(["train", *ARGS, f"model.cache_dir={model_cache}", f"hydra.run.dir={run_dir}"])
    try:
        _wait(lambda: (run_dir / "coordinator.addr").exists() and (run_dir / "control.token").exists(), 300,
              "the coordinator's address and token", proc)
        client = CoordinatorClient((run_dir / "coordinator.addr").read_text().strip(), timeout_s=10,
                                   token=read_token(run_dir / "control.token"))
        _wait(lambda: client.status().trainer_step >= 2, 600, "two trained steps", proc)
        yield run_dir, proc, client
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)


def _scrape(url: str) -> dict[str, float]:
    """{sample name with its labels: value} of one scrape, parsed by prometheus-client."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {s.name + "".join(f",{k}={v}" for k, v in sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_prometheus_endpoints_of_a_live_run(live_run, capsys):
    run_dir, proc, client = live_run
    assert ctl.main(["status", "--run-dir", str(run_dir), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    url = shown["metrics_url"]
    assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
    assert ctl.main(["status", "--run-dir", str(run_dir)]) == 0
    assert url in capsys.readouterr().out

    def agreeing():  # a scrape, the status, a scrape: the same versions and engine states when no step
        # finished and no sync began or ended between them (a sync flips an engine READY <-> SYNCING)
        before, st, after = _scrape(url), client.status(), _scrape(url)
        keys = [("disagg_trainer_policy_version", st.trainer_version), ("disagg_trainer_step", st.trainer_step),
                ("disagg_committed_policy_version", st.committed_version),
                *[(f"disagg_engine_state,disagg_engine_state={e.state.value},engine_id={e.engine_id}", 1)
                  for e in st.engines]]
        if all(before.get(k) == v == after.get(k) for k, v in keys):
            return after, st

    first, st = _wait(agreeing, 60, "a scrape that agrees with the status", proc)
    assert first["disagg_max_staleness"] == st.max_staleness
    _wait(lambda: client.status().trainer_step >= st.trainer_step + 2, 120, "two more steps", proc)
    second, st2 = _wait(agreeing, 60, "a scrape that agrees with the status", proc)
    assert second["disagg_trainer_policy_version"] > first["disagg_trainer_policy_version"]
    assert second["disagg_committed_policy_version"] >= first["disagg_trainer_policy_version"]
    assert second["disagg_weight_sync_seconds_count"] > first["disagg_weight_sync_seconds_count"] >= 1
    assert second["disagg_weight_sync_seconds_sum"] > 0
    assert second["disagg_staleness_max_seen"] <= second["disagg_max_staleness"]
    for must_be_zero in ("disagg_dummy_served_groups_total", "disagg_trained_beyond_staleness_samples_total",
                         "disagg_prompts_lost", "disagg_engine_deaths_total"):
        assert second[must_be_zero] == 0, must_be_zero
    engine_ids = [e.engine_id for e in st2.engines]
    assert sum(second[f"disagg_engine_tokens_per_second,engine_id={i}"] for i in engine_ids) > 0
    for e in st2.engines:
        assert second[f"disagg_engine_state,disagg_engine_state={e.state.value},engine_id={e.engine_id}"] == 1

    # Each engine's own vLLM /metrics, at the address ctl status lists: vLLM's engine metrics, counting tokens.
    for e in shown["engines"]:
        assert e["vllm_metrics_url"] == e["address"] + "/metrics"
        vllm = _scrape(e["vllm_metrics_url"])
        generated = [v for k, v in vllm.items() if k.startswith("vllm:generation_tokens_total")]
        assert generated and sum(generated) > 0, sorted(k for k in vllm if k.startswith("vllm:"))[:20]


def test_operating_a_live_run(live_run):
    run_dir, proc, client = live_run
    assert stat.S_IMODE(os.stat(run_dir / "control.token").st_mode) == 0o600
    anonymous = CoordinatorClient(client.address, timeout_s=5)
    with pytest.raises(ControlRpcError) as e:
        anonymous.status()
    assert e.value.code == "UNAUTHENTICATED"

    # watch: steps stream in as they finish.
    watched: list[tuple[int, dict]] = []
    watcher = threading.Thread(target=lambda: watched.extend(client.watch_metrics(from_step=1)), daemon=True)
    watcher.start()
    st = client.status()
    assert st.phase == "running" and st.total_steps == 2000 and st.engines[0].address.startswith("http")

    # pause: in-flight groups finish, then nothing new starts and training stops for want of samples
    # (a buffered batch may still train first). Once the driver has acted on the pause (its event;
    # what the status shows from then on comes after its last wave): nothing generating, no batch
    # left in the buffer, no step training or syncing.
    client.pause_rollout("test")

    def stopped() -> bool:
        s = client.status()
        return (any(e.kind == "rollout_paused" for e in s.events) and s.inflight_groups == 0
                and s.training_groups == 0 and s.buffer_groups < BATCH_GROUPS)

    _wait(stopped, 120, "the rollout to drain and training to stop", proc)
    step_paused = client.status().trainer_step
    time.sleep(3.0)
    st = client.status()
    assert st.trainer_step == step_paused and st.inflight_groups == 0, "trained or generated while paused"
    with pytest.raises(ControlRpcError) as e:
        client.pause_rollout()
    assert e.value.code == "FAILED_PRECONDITION"

    client.resume_rollout()
    _wait(lambda: client.status().trainer_step >= step_paused + 2, 120, "steps after resume", proc)
    assert client.set_max_staleness(2) == 2 and client.status().max_staleness == 2
    with pytest.raises(ControlRpcError) as e:
        client.set_max_staleness(-5)
    assert e.value.code == "INVALID_ARGUMENT"

    # checkpoint: returns once on disk; HF loads it.
    step, version, path = client.checkpoint(timeout_s=120)
    assert step > step_paused and version == step + 1
    saved = json.loads((run_dir / "checkpoints" / f"step_{step:06d}" / "state.json").read_text())
    assert saved["step"] == step and saved["policy_version"] == version and saved["data_cursor"] > 0
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(path)
    AutoTokenizer.from_pretrained(path)
    import torch

    opt = torch.load(os.path.join(path, "optimizer.pt"), weights_only=False)
    assert opt["scheduler"]["last_epoch"] == step and opt["optimizer"]["state"]

    # stop: the step in progress finishes, a final checkpoint, exit 0.
    assert "stopping" in client.stop("end of test")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = recs[-1]["step"]
    assert last < 2000 and [r["step"] for r in recs] == list(range(1, last + 1))
    final = json.loads((run_dir / "checkpoints" / f"step_{last:06d}" / "state.json").read_text())
    assert final["step"] == last and final["policy_version"] == recs[-1]["policy_version"]
    assert "stopped on request (end of test)" in out + err
    watcher.join(timeout=30)
    assert not watcher.is_alive(), "the metrics stream did not end with the run"
    assert [s for s, _ in watched] == list(range(1, last + 1))
    assert watched[-1][1]["reward/mean"] == pytest.approx(recs[-1]["reward/mean"])
