"""The coordinator's Prometheus endpoint: ``/metrics`` for Prometheus and Grafana.

prometheus-client does the work (registry, metric types, text format, the HTTP
server, TLS); this module is only the mapping from disagg's state to its
metrics. At scrape time a Collector reads ``CoordinatorState.status()`` (one
lock, as ``disagg ctl status``) and the last step the driver published; the
seconds of each published step's weight sync go into a Histogram, and engine
deaths and other events into Counters, as they happen (the exporter observes
the state). It never changes the state and never holds its lock.

Names carry the ``disagg_`` prefix and their unit; per-engine series are
labelled ``engine_id``. The names are listed in docs/operations.md and used by
docs/grafana-dashboard.json.
"""

from __future__ import annotations

import errno
import logging
import threading

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    StateSetMetricFamily,
)

from disagg.control.types import ClusterStatus, EngineState, Event
from disagg.errors import ControlError

logger = logging.getLogger("disagg.control")

# Gauges read from ClusterStatus: (name, help, attribute).
STATUS_GAUGES = (
    ("disagg_trainer_policy_version", "Policy version of the trainer's weights", "trainer_version"),
    ("disagg_latest_policy_version", "Highest policy version announced to the engines (0: none)", "latest_version"),
    ("disagg_committed_policy_version", "Highest policy version every live engine serves", "committed_version"),
    ("disagg_max_staleness", "Staleness limit: policy versions a trained sample may lag the trainer",
     "max_staleness"),
    ("disagg_trainer_step", "Optimizer steps trained", "trainer_step"),
    ("disagg_total_steps", "Optimizer steps the run is configured for", "total_steps"),
    ("disagg_inflight_groups", "Prompt groups generating or being scored", "inflight_groups"),
    ("disagg_ready_groups", "Complete prompt groups waiting to be trained", "buffer_groups"),
    ("disagg_training_groups", "Prompt groups handed to the trainer whose step's weights are not synced yet",
     "training_groups"),
    ("disagg_target_engines", "Rollout engines once scaling settles", "target_engines"),
    ("disagg_rollout_paused", "1 while an operator has paused the rollout", "rollout_paused"),
)

# Per-engine gauges read from ClusterStatus.engines, labelled engine_id: (name, help, attribute).
ENGINE_GAUGES = (
    ("disagg_engine_policy_version", "Policy version the engine last acknowledged", "policy_version"),
    ("disagg_engine_inflight_groups", "Prompt groups in flight on the engine", "inflight_groups"),
    ("disagg_engine_tokens_per_second", "Tokens the engine generated per second over the last step",
     "tokens_per_s"),
)

# Read from the last published step record: (name, help, record key). The record's values are the
# pipeline's running totals, so the counters restart with the driver process, as Prometheus expects.
RECORD_GAUGES = (
    ("disagg_staleness_max", "Largest staleness (policy versions) of a sample in the last trained batch",
     "policy/staleness_max"),
    ("disagg_prompts_lost", "Prompt groups drawn but neither trained, dropped (counted) nor pending; must be 0",
     "rollout/prompts_lost"),
)
RECORD_COUNTERS = (
    ("disagg_dummy_served_groups", "Prompt groups with a token generated on dummy weights; must be 0",
     "rollout/dummy_served"),
    ("disagg_trained_beyond_staleness_samples", "Samples trained older than the staleness limit; must be 0",
     "samples/trained_beyond_staleness"),
    ("disagg_dropped_stale_samples", "Samples dropped before training for exceeding the staleness limit",
     "samples/dropped_stale"),
    ("disagg_stopped_stale_groups", "Prompt groups their engine stopped while generating, once no step could "
     "train them (their samples are among the stale drops)", "samples/dropped_stale_in_flight_groups"),
    ("disagg_requeued_groups", "Prompt groups generated again because their engine died",
     "rollout/groups_requeued"),
)

# Histograms observed with each published step: (name, help, record key, buckets in seconds).
_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
STEP_HISTOGRAMS = (
    ("disagg_weight_sync_seconds", "Seconds of each step's weight sync, trainer to every engine",
     "timing/weight_sync_s", _SECONDS),
    ("disagg_step_seconds", "Seconds between two published steps", "timing/step_s", _SECONDS),
)

# Event kinds (CoordinatorState.record_event) with counters of their own; all kinds go to disagg_events_total.
EVENT_COUNTERS = (
    ("disagg_engine_deaths", "Rollout engines found dead or stuck", "engine_dead"),
    ("disagg_engine_replacements", "Rollout engines started in place of dead ones", "engine_replaced"),
)

PHASES = ("starting", "running", "paused", "stopping", "stopped", "failed")


class _StateCollector:
    """Builds the scrape-time families from the state and the exporter's last step record."""

    def __init__(self, state, exporter: MetricsExporter):
        self._state, self._exporter = state, exporter

    def collect(self):
        status: ClusterStatus = self._state.status()
        record, staleness_seen = self._exporter.last_record()
        for name, doc, attr in STATUS_GAUGES:
            yield GaugeMetricFamily(name, doc, value=float(getattr(status, attr)))
        yield GaugeMetricFamily("disagg_staleness_max_seen", "Largest staleness of a trained sample so far "
                                "(policy versions; compare with disagg_max_staleness)", value=staleness_seen)
        for name, doc, key in RECORD_GAUGES:
            yield GaugeMetricFamily(name, doc, value=record.get(key, 0.0))
        for name, doc, key in RECORD_COUNTERS:
            yield CounterMetricFamily(name, doc, value=record.get(key, 0.0))
        yield StateSetMetricFamily("disagg_phase", "The run's phase",
                                   value={p: p == status.phase for p in {*PHASES, status.phase}})
        yield InfoMetricFamily("disagg_run", "The run", value={"run_dir": status.run_dir})

        ids = [str(e.engine_id) for e in status.engines]
        for name, doc, attr in ENGINE_GAUGES:
            family = GaugeMetricFamily(name, doc, labels=["engine_id"])
            for i, e in zip(ids, status.engines):
                family.add_metric([i], float(getattr(e, attr)))
            yield family
        states = StateSetMetricFamily("disagg_engine_state", "Each engine's state", labels=["engine_id"])
        info = InfoMetricFamily("disagg_engine", "Each engine's node, pid and vLLM /metrics endpoint "
                                "(empty: the engine serves no HTTP, rollout.openai_api=false)", labels=["engine_id"])
        counts = GaugeMetricFamily("disagg_engines", "Engines in each state (dead ones are kept a while)",
                                   labels=["state"])
        for i, e in zip(ids, status.engines):
            states.add_metric([i], {s.value: s is e.state for s in EngineState})
            info.add_metric([i], {"node_ip": e.node_ip, "pid": str(e.pid), "vllm_metrics_url": e.vllm_metrics_url})
        for s in EngineState:
            counts.add_metric([s.value], float(sum(e.state is s for e in status.engines)))
        yield from (states, info, counts)


class MetricsExporter:
    """The Prometheus view of one ``CoordinatorState``: ``registry`` to scrape, ``serve`` to expose it."""

    def __init__(self, state):
        self.registry = CollectorRegistry()
        self.registry.register(_StateCollector(state, self))
        self._histograms = {key: Histogram(name, doc, buckets=buckets, registry=self.registry)
                            for name, doc, key, buckets in STEP_HISTOGRAMS}
        self._event_counters = {kind: Counter(name, doc, registry=self.registry) for name, doc, kind in EVENT_COUNTERS}
        self._events = Counter("disagg_events", "Events of the run, by kind (as in `disagg ctl status`)", ["kind"],
                               registry=self.registry)
        self._lock = threading.Lock()
        self._record: dict[str, float] = {}
        self._staleness_seen = 0.0
        self._httpd = None
        self._thread = None
        self.url = ""
        state.add_observer(self)

    # ---- what the state tells its observers ----------------------------------------------
    def step_published(self, step: int, values: dict[str, float]) -> None:
        for key, histogram in self._histograms.items():
            if key in values:
                histogram.observe(values[key])
        with self._lock:
            self._record = dict(values)
            self._staleness_seen = max(self._staleness_seen, values.get("policy/staleness_max", 0.0))

    def event_recorded(self, event: Event) -> None:
        self._events.labels(kind=event.kind).inc()
        if event.kind in self._event_counters:
            self._event_counters[event.kind].inc()

    def last_record(self) -> tuple[dict[str, float], float]:
        """The last published step's values and the largest staleness seen so far."""
        with self._lock:
            return self._record, self._staleness_seen

    # ---- HTTP ------------------------------------------------------------------------------
    def serve(self, host: str, port: int, certfile: str | None = None, keyfile: str | None = None) -> str:
        """Serve ``/metrics`` on ``host:port`` (0: a free port), over TLS with a cert and key; returns the URL."""
        try:
            self._httpd, self._thread = start_http_server(port, addr=host, registry=self.registry,
                                                          certfile=certfile, keyfile=keyfile)
        except OSError as e:
            why = "the port is in use" if e.errno == errno.EADDRINUSE else (e.strerror or str(e))
            raise ControlError(f"control.metrics_port={port}: cannot serve /metrics on {host}:{port}: {why} "
                               "(0 picks a free port; null turns the endpoint off)") from e
        bracketed = f"[{host}]" if ":" in host and not host.startswith("[") else host
        self.url = f"{'https' if certfile else 'http'}://{bracketed}:{self._httpd.server_port}/metrics"
        logger.info("[coordinator] Prometheus metrics at %s", self.url)
        return self.url

    def stop(self) -> None:
        """Stop serving (a no-op if not serving)."""
        if self._httpd is None:
            return
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5.0)
        self._httpd = self._thread = None
        logger.info("[coordinator] stopped serving metrics at %s", self.url)
