"""The coordinator's Prometheus exporter: a state filled by hand, scraped and parsed with prometheus-client."""

from __future__ import annotations

import json
import re
import socket
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from disagg.config import load_config
from disagg.control.prometheus import MetricsExporter
from disagg.control.server import CoordinatorServer, CoordinatorState
from disagg.control.types import EngineInfo, EngineState
from disagg.errors import ConfigError, ControlError
from disagg.transport.manifest import Manifest


def _scrape(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of an exposition."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _state() -> CoordinatorState:
    state = CoordinatorState(max_staleness=2, run_dir="/runs/r1")
    for i in range(3):
        address = f"http://127.0.0.1:{8000 + i}" if i < 2 else ""  # engine 2 serves no HTTP
        state.register_engine(EngineInfo(i, "127.0.0.1", 100 + i, address, EngineState.WAITING_FOR_WEIGHTS))
    state.set_transport_members([0, 1, 2])
    state.announce_version(Manifest(policy_version=4, bucket_bytes=1024, tensors=(), buckets=()), trainer_step=3)
    digest = state.get_manifest(4).layout_digest()
    state.ack_version(0, 4, digest)
    state.ack_version(1, 4, digest)
    state.update_engine_state(0, EngineState.READY)
    state.update_engine_state(1, EngineState.SYNCING)
    state.engine_died(2, "stuck")
    state.record_event("engine_replaced", "engine 3 starts in place of engine 2")
    state.set_phase("running")
    state.set_run_stats(trainer_version=5, buffer_groups=6, inflight_groups=7, training_groups=2, total_steps=50,
                        engine_load={0: (3, 1234.5), 1: (4, 987.0)})
    return state


def _record(step: int, sync_s: float, staleness: int) -> dict:
    return {"policy_version": step + 1, "policy/staleness_max": staleness, "timing/weight_sync_s": sync_s,
            "timing/step_s": 1.5, "rollout/prompts_lost": 0, "rollout/dummy_served": 0,
            "samples/trained_beyond_staleness": 0, "samples/dropped_stale": 9, "rollout/groups_requeued": 2,
            "samples/dropped_stale_in_flight_groups": 1}


def test_the_scrape_reports_the_state():
    state = _state()
    exporter = MetricsExporter(state)
    state.publish_metrics(1, _record(1, 0.03, staleness=2))
    state.publish_metrics(2, _record(2, 0.4, staleness=1))
    m = _scrape(generate_latest(exporter.registry).decode())
    st = state.status()

    assert m[("disagg_trainer_policy_version", ())] == st.trainer_version == 5
    assert m[("disagg_latest_policy_version", ())] == st.latest_version == 4
    assert m[("disagg_committed_policy_version", ())] == st.committed_version == 4
    assert m[("disagg_max_staleness", ())] == st.max_staleness == 2
    assert m[("disagg_staleness_max", ())] == 1  # the last step's
    assert m[("disagg_staleness_max_seen", ())] == 2  # the run's
    assert m[("disagg_inflight_groups", ())] == 7 and m[("disagg_ready_groups", ())] == 6
    assert m[("disagg_training_groups", ())] == 2 and m[("disagg_trainer_step", ())] == 3

    eng = lambda i: (("engine_id", str(i)),)
    assert m[("disagg_engine_tokens_per_second", eng(0))] == 1234.5
    assert m[("disagg_engine_tokens_per_second", eng(1))] == 987.0
    assert m[("disagg_engine_inflight_groups", eng(1))] == 4
    assert m[("disagg_engine_policy_version", eng(0))] == 4
    for i, s in ((0, "READY"), (1, "SYNCING"), (2, "DEAD")):
        assert m[("disagg_engine_state", (("disagg_engine_state", s), *eng(i)))] == 1
        assert m[("disagg_engine_state", (("disagg_engine_state", "STARTING"), *eng(i)))] == 0
    assert m[("disagg_engines", (("state", "DEAD"),))] == 1 and m[("disagg_engines", (("state", "READY"),))] == 1
    urls = {dict(k[1])["engine_id"]: dict(k[1])["vllm_metrics_url"] for k in m if k[0] == "disagg_engine_info"}
    assert urls == {"0": "http://127.0.0.1:8000/metrics", "1": "http://127.0.0.1:8001/metrics", "2": ""}
    assert m[("disagg_phase", (("disagg_phase", "running"),))] == 1
    assert m[("disagg_phase", (("disagg_phase", "stopped"),))] == 0
    assert m[("disagg_run_info", (("run_dir", "/runs/r1"),))] == 1

    # Events count from when the exporter observes the state: the death and the replacement above were before.
    assert ("disagg_engine_deaths_total", ()) in m and m[("disagg_engine_deaths_total", ())] == 0
    state.engine_died(1, "OOM")
    state.record_event("engine_replaced", "engine 4 starts in place of engine 1")
    state.record_event("sync_retried", "version 5 is sent again")
    m = _scrape(generate_latest(exporter.registry).decode())
    assert m[("disagg_engine_deaths_total", ())] == 1 and m[("disagg_engine_replacements_total", ())] == 1
    assert m[("disagg_events_total", (("kind", "sync_retried"),))] == 1
    assert m[("disagg_events_total", (("kind", "engine_dead"),))] == 1


def test_step_records_feed_the_histogram_and_the_must_be_zero_counters():
    state = _state()
    exporter = MetricsExporter(state)
    m = _scrape(generate_latest(exporter.registry).decode())
    assert m[("disagg_weight_sync_seconds_count", ())] == 0
    assert m[("disagg_dummy_served_groups_total", ())] == 0  # no step yet
    state.publish_metrics(1, _record(1, 0.03, staleness=0))
    state.publish_metrics(2, {**_record(2, 0.4, staleness=0), "rollout/dummy_served": 1,
                              "samples/trained_beyond_staleness": 3, "rollout/prompts_lost": 2})
    m = _scrape(generate_latest(exporter.registry).decode())
    assert m[("disagg_weight_sync_seconds_count", ())] == 2
    assert m[("disagg_weight_sync_seconds_sum", ())] == pytest.approx(0.43)
    assert m[("disagg_weight_sync_seconds_bucket", (("le", "0.05"),))] == 1
    assert m[("disagg_weight_sync_seconds_bucket", (("le", "0.5"),))] == 2
    assert m[("disagg_step_seconds_count", ())] == 2
    assert m[("disagg_dummy_served_groups_total", ())] == 1
    assert m[("disagg_trained_beyond_staleness_samples_total", ())] == 3
    assert m[("disagg_prompts_lost", ())] == 2
    assert m[("disagg_dropped_stale_samples_total", ())] == 9
    assert m[("disagg_stopped_stale_groups_total", ())] == 1
    assert m[("disagg_requeued_groups_total", ())] == 2


def test_the_coordinator_serves_metrics_over_http_and_its_url_in_the_status():
    with CoordinatorServer(metrics_port=0) as server:
        url = server.state.status().metrics_url
        assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
        server.state.set_run_stats(trainer_version=9)
        with urllib.request.urlopen(url, timeout=10) as r:
            m = _scrape(r.read().decode())
        assert m[("disagg_trainer_policy_version", ())] == 9
    with pytest.raises(OSError):  # stopped with the coordinator
        urllib.request.urlopen(url, timeout=2)
    with CoordinatorServer() as server:  # metrics_port=None: off
        assert server.metrics is None and server.state.status().metrics_url == ""


def test_a_metrics_port_in_use_is_an_error_naming_the_key():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = CoordinatorServer(metrics_port=port)
        with pytest.raises(ControlError, match=f"control.metrics_port={port}: .*in use"):
            server.start()
        with pytest.raises(ControlError, match="not started"):
            server.address  # the gRPC server was stopped again


@pytest.mark.parametrize("value, message", [
    (70000, r"control.metrics_port=70000: must be in \[0, 65535\]"),
    (-1, r"control.metrics_port=-1: must be in"),
    ("x", r"control.metrics_port='x'"),
])
def test_metrics_port_validation(value, message):
    with pytest.raises(ConfigError, match=message):
        load_config({"control": {"metrics_port": value}})


def test_metrics_port_defaults_on_and_can_be_turned_off():
    assert load_config({}).control.metrics_port == 0
    assert load_config({"control": {"metrics_port": None}}).control.metrics_port is None
    with pytest.raises(ConfigError, match="control.metrics_port=7000 and control.port=7000"):
        load_config({"control": {"metrics_port": 7000, "port": 7000}})


def test_the_grafana_dashboard_queries_only_names_the_exporter_serves():
    dashboard = json.loads((Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {n for e in exprs for n in re.findall(r"\bdisagg_[a-z_]+", e)}
    state = _state()
    exporter = MetricsExporter(state)
    state.publish_metrics(1, _record(1, 0.03, staleness=0))
    served = {name for name, _ in _scrape(generate_latest(exporter.registry).decode())}
    assert len(used) >= 15 and used <= served, sorted(used - served)
