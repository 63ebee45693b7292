"""Plain dataclasses for what the coordinator reports: pools, engines, the cluster.

Protobuf stays inside the control package's wire code (``convert``, ``server``,
``client``); everything else in disagg (the driver, the engines, ``disagg ctl
--json``) sees these types. This module must never import grpc or protobuf.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum


class EngineState(str, Enum):
    """Life cycle of one rollout engine as the coordinator tracks it."""

    STARTING = "STARTING"  # process up, model loading
    WAITING_FOR_WEIGHTS = "WAITING_FOR_WEIGHTS"  # loaded, must not serve until a sync lands
    READY = "READY"  # serving its acknowledged policy version
    SYNCING = "SYNCING"  # receiving a new policy version
    DRAINING = "DRAINING"  # finishing in-flight requests; excluded from the commit
    DEAD = "DEAD"  # gone; excluded from the commit

    @property
    def is_live(self) -> bool:
        """Whether the engine counts towards the committed version."""
        return self not in (EngineState.DRAINING, EngineState.DEAD)


POOL_NAMES = ("trainer", "rollout")


@dataclass(frozen=True)
class PoolStatus:
    """One placement-group-backed pool, as registered by the driver."""

    name: str  # "trainer" or "rollout"
    num_bundles: int
    bundle_resources: str  # one bundle's resources, e.g. "CPU:1" or "GPU:1,CPU:4"
    placement_group_id: str
    num_workers: int
    registered_unix_s: float = 0.0  # set by the coordinator when it registers the pool


@dataclass(frozen=True)
class EngineInfo:
    """What a rollout engine says about itself when it registers."""

    engine_id: int
    node_ip: str
    pid: int
    address: str = ""  # the engine's serving address; empty if it serves none
    state: EngineState = EngineState.STARTING
    expected_tensors: tuple = ()  # TensorSpecs of its model as a trainer names them; () = not checked


@dataclass(frozen=True)
class EngineStatus:
    """One engine as the coordinator sees it now."""

    engine_id: int
    state: EngineState
    node_ip: str
    pid: int
    address: str
    policy_version: int  # the version the engine last acknowledged; 0 if none
    last_update_unix_s: float  # wall time of its last registration, state change or ack
    message: str = ""  # free text from its last state update, e.g. why it died
    inflight_groups: int = 0  # prompt groups the driver has in flight on it
    tokens_per_s: float = 0.0  # generated tokens per second over the last step

    @property
    def vllm_metrics_url(self) -> str:
        """vLLM's own Prometheus endpoint on the engine's OpenAI server; "" if it serves no HTTP."""
        return f"{self.address}/metrics" if self.address else ""


@dataclass(frozen=True)
class Event:
    """Something that happened to the job (an engine died, a sync was retried, ...)."""

    unix_s: float
    kind: str
    message: str


# ClusterStatus's driver-side run fields (defaults when a coordinator has no run); same names in the proto.
RUN_FIELDS = ("trainer_version", "buffer_groups", "inflight_groups", "rollout_paused", "phase", "total_steps",
              "target_engines", "training_groups")


@dataclass(frozen=True)
class LastSync:
    """The latest step's weight sync, from its metrics (``disagg ctl status``)."""

    step: int
    bytes: int  # what the version weighs
    bytes_on_wire: int  # what was sent: fewer for a delta (transport.delta)
    delta: bool
    changed_fraction: float  # of the elements, for a delta; -1 for a dense sync
    seconds: float

    @staticmethod
    def from_metrics(step: int, m: dict[str, float]) -> "LastSync | None":
        """From a step's metrics; None for a step without a sync (``weight_sync/skipped``)."""
        if "weight_sync/bytes" not in m or m.get("weight_sync/skipped"):
            return None
        dense = int(m["weight_sync/bytes"])
        return LastSync(step, dense, int(m.get("weight_sync/bytes_on_wire", dense)),
                        bool(m.get("weight_sync/delta", 0)), float(m.get("weight_sync/changed_fraction", -1.0)),
                        float(m.get("timing/weight_sync_s", 0.0)))


@dataclass(frozen=True)
class ClusterStatus:
    """A snapshot of the coordinator: what ``GetStatus`` and ``disagg ctl status`` show."""

    pools: tuple[PoolStatus, ...]
    engines: tuple[EngineStatus, ...]  # sorted by engine_id
    latest_version: int  # highest announced policy version; 0 if none
    committed_version: int  # highest version every live engine acknowledged; 0 if none
    max_staleness: int  # how many versions rollouts may lag the trainer
    trainer_step: int
    run_dir: str
    started_unix_s: float  # wall time the coordinator started
    trainer_version: int = 0  # policy version of the trainer's weights
    buffer_groups: int = 0  # complete groups waiting to be trained
    inflight_groups: int = 0  # groups generating or being scored
    rollout_paused: bool = False
    phase: str = ""  # starting | running | paused | stopping | stopped
    total_steps: int = 0
    target_engines: int = 0  # the rollout pool's size once scaling settles (0: no run)
    events: tuple[Event, ...] = ()  # the latest events, oldest first
    training_groups: int = 0  # groups handed to the trainer whose step's weights are not synced yet
    metrics_url: str = ""  # the coordinator's Prometheus endpoint; "" when control.metrics_port is null
    last_sync: LastSync | None = None  # the latest step's weight sync; None before the first

    def engine(self, engine_id: int) -> EngineStatus:
        for e in self.engines:
            if e.engine_id == engine_id:
                return e
        raise KeyError(f"engine {engine_id} is not registered (registered: {[e.engine_id for e in self.engines]})")

    def to_dict(self) -> dict:
        """JSON-ready dict; engine states become their names, and each engine gets its ``vllm_metrics_url``."""
        d = asdict(self)
        for e, engine in zip(d["engines"], self.engines):
            e["state"] = EngineState(e["state"]).value
            e["vllm_metrics_url"] = engine.vllm_metrics_url
        return d

    @staticmethod
    def from_dict(d: dict) -> "ClusterStatus":
        return ClusterStatus(
            pools=tuple(PoolStatus(**p) for p in d["pools"]),
            engines=tuple(EngineStatus(**{**{k: v for k, v in e.items() if k != "vllm_metrics_url"},
                                          "state": EngineState(e["state"])}) for e in d["engines"]),
            latest_version=int(d["latest_version"]),
            committed_version=int(d["committed_version"]),
            max_staleness=int(d["max_staleness"]),
            trainer_step=int(d["trainer_step"]),
            run_dir=d["run_dir"],
            started_unix_s=float(d["started_unix_s"]),
            **{k: d[k] for k in RUN_FIELDS if k in d},
            events=tuple(Event(**e) for e in d.get("events", ())),
            metrics_url=d.get("metrics_url", ""),
            last_sync=LastSync(**d["last_sync"]) if d.get("last_sync") else None,
        )
