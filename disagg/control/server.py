"""The coordinator: one gRPC server holding the cluster's control state.

The driver starts it in-process and reads the same state directly
(``server.state.committed_version()``, ``server.state.set_trainer_step(n)``);
engines and ``disagg ctl`` reach it over gRPC. It tracks pools, engines, the
manifests of the last few announced policy versions and which version each
engine serves, and derives the committed version from the acks.

It never moves weights or samples, and never blocks: every method takes one
lock for a few dictionary operations.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import grpc

from disagg.control import convert
from disagg.control.convert import pb, pb_grpc
from disagg.control.types import POOL_NAMES, ClusterStatus, EngineInfo, EngineState, EngineStatus, PoolStatus
from disagg.errors import ControlError
from disagg.transport.manifest import Manifest

logger = logging.getLogger("disagg.control")

# Manifests can list thousands of tensors; gRPC's default 4 MiB cap is too tight.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


class RejectedError(ControlError):
    """The coordinator refused a request; ``code`` is the gRPC status it answers with."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


class CoordinatorState:
    """Thread-safe control state; the gRPC servicer and the driver both call it."""

    def __init__(self, max_staleness: int = 0, run_dir: str = "", num_manifests_kept: int = 4):
        if num_manifests_kept < 1:
            raise ValueError(f"num_manifests_kept must be >= 1, got {num_manifests_kept}")
        self._lock = threading.Lock()
        self._pools: dict[str, PoolStatus] = {}
        self._engines: dict[int, EngineStatus] = {}
        # policy_version -> (manifest, layout digest), oldest first, at most num_manifests_kept.
        self._manifests: OrderedDict[int, tuple[Manifest, str]] = OrderedDict()
        self._num_manifests_kept = num_manifests_kept
        self._latest_version: int | None = None
        self._trainer_step = 0
        self._max_staleness = 0
        self.set_max_staleness(max_staleness)
        self._run_dir = run_dir
        self._started_unix_s = time.time()

    def register_pool(self, pool: PoolStatus) -> None:
        if pool.name not in POOL_NAMES:
            raise RejectedError(grpc.StatusCode.INVALID_ARGUMENT, f"pool name must be one of {POOL_NAMES}, got {pool.name!r}")
        with self._lock:
            self._pools[pool.name] = replace(pool, registered_unix_s=time.time())
        logger.info("[coordinator] pool %r registered: %d bundles of %s, %d workers", pool.name,
                    pool.num_bundles, pool.bundle_resources, pool.num_workers)

    def register_engine(self, info: EngineInfo) -> None:
        status = EngineStatus(info.engine_id, info.state, info.node_ip, info.pid, info.address, 0, time.time())
        with self._lock:
            previous = self._engines.get(info.engine_id)
            self._engines[info.engine_id] = status
        again = f" (replacing pid {previous.pid} on {previous.node_ip})" if previous else ""
        logger.info("[coordinator] engine %d registered from %s pid %d in %s%s", info.engine_id, info.node_ip,
                    info.pid, info.state.value, again)

    def update_engine_state(self, engine_id: int, state: EngineState, message: str = "") -> None:
        with self._lock:
            old = self._engine(engine_id)
            self._engines[engine_id] = replace(old, state=state, message=message, last_update_unix_s=time.time())
        # READY <-> SYNCING flips every step: keep those at debug level.
        routine = {old.state, state} <= {EngineState.READY, EngineState.SYNCING}
        log = logger.warning if state is EngineState.DEAD else (logger.debug if routine else logger.info)
        log("[coordinator] engine %d %s -> %s%s", engine_id, old.state.value, state.value, f": {message}" if message else "")

    def announce_version(self, manifest: Manifest, trainer_step: int) -> None:
        """Record a new policy version; re-announcing the latest with the same layout is a no-op."""
        version, digest = manifest.policy_version, manifest.layout_digest()
        with self._lock:
            latest = self._latest_version
            if latest is not None and version < latest:
                raise RejectedError(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"policy_version {version} announced after {latest}; versions must not go back")
            if version == latest and self._manifests[version][1] != digest:
                raise RejectedError(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"policy_version {version} re-announced with layout digest {digest}, "
                                    f"announced before with {self._manifests[version][1]}")
            self._manifests[version] = (manifest, digest)
            while len(self._manifests) > self._num_manifests_kept:
                self._manifests.popitem(last=False)
            self._latest_version = version
            self._trainer_step = trainer_step
        logger.debug("[coordinator] policy_version %d announced at trainer step %d: %d tensors in %d buckets, "
                    "%d bytes, layout %s", version, trainer_step, len(manifest.tensors), len(manifest.buckets),
                    manifest.total_bytes, digest)

    def get_manifest(self, policy_version: int) -> Manifest:
        with self._lock:
            if policy_version not in self._manifests:
                raise RejectedError(grpc.StatusCode.NOT_FOUND, self._unknown_version(policy_version))
            return self._manifests[policy_version][0]

    def ack_version(self, engine_id: int, policy_version: int, layout_digest: str) -> int:
        """Record that an engine serves ``policy_version``; return the committed version."""
        with self._lock:
            engine = self._engine(engine_id)
            if policy_version not in self._manifests:
                raise RejectedError(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"engine {engine_id} acked: {self._unknown_version(policy_version)}")
            expected = self._manifests[policy_version][1]
            if layout_digest != expected:
                raise RejectedError(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"engine {engine_id} acked policy_version {policy_version} with layout digest "
                                    f"{layout_digest!r}, but the announced manifest's digest is {expected!r}")
            self._engines[engine_id] = replace(engine, policy_version=policy_version, last_update_unix_s=time.time())
            committed = self._committed_locked()
        logger.debug("[coordinator] engine %d serves policy_version %d; committed version %d", engine_id,
                    policy_version, committed)
        return committed

    def committed_version(self) -> int:
        with self._lock:
            return self._committed_locked()

    def latest_version(self) -> int:
        with self._lock:
            return self._latest_version or 0

    def set_trainer_step(self, trainer_step: int) -> None:
        with self._lock:
            self._trainer_step = trainer_step

    def set_max_staleness(self, value: int) -> int:
        if value < 0:
            raise RejectedError(grpc.StatusCode.INVALID_ARGUMENT,
                                f"max_staleness must be >= 0 (0 means fully on-policy), got {value}")
        with self._lock:
            old, self._max_staleness = self._max_staleness, value
        if old != value:
            logger.info("[coordinator] max_staleness %d -> %d", old, value)
        return value

    def max_staleness(self) -> int:
        with self._lock:
            return self._max_staleness

    def status(self) -> ClusterStatus:
        with self._lock:
            return ClusterStatus(
                pools=tuple(self._pools[n] for n in sorted(self._pools)),
                engines=tuple(self._engines[i] for i in sorted(self._engines)),
                latest_version=self._latest_version or 0,
                committed_version=self._committed_locked(),
                max_staleness=self._max_staleness,
                trainer_step=self._trainer_step,
                run_dir=self._run_dir,
                started_unix_s=self._started_unix_s,
            )

    def _committed_locked(self) -> int:
        live = [e.policy_version for e in self._engines.values() if e.state.is_live]
        return min(live) if live else 0

    def _engine(self, engine_id: int) -> EngineStatus:
        if engine_id not in self._engines:
            raise RejectedError(grpc.StatusCode.NOT_FOUND, f"engine {engine_id} is not registered "
                                f"(registered: {sorted(self._engines)})")
        return self._engines[engine_id]

    def _unknown_version(self, policy_version: int) -> str:
        kept = list(self._manifests)
        if self._latest_version is not None and policy_version < kept[0]:
            return (f"policy_version {policy_version} is older than every kept manifest {kept} "
                    f"(only the last {self._num_manifests_kept} are kept)")
        return f"policy_version {policy_version} was never announced (kept: {kept})"


class _Servicer(pb_grpc.CoordinatorServicer):
    """Wire adapter: convert, call the state, map ``RejectedError`` to a status code."""

    def __init__(self, state: CoordinatorState):
        self._state = state

    def _run(self, context: grpc.ServicerContext, fn, *args):
        try:
            return fn(*args)
        except RejectedError as e:
            context.abort(e.code, str(e))
        except ValueError as e:  # a malformed request, e.g. an unset engine state
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    def RegisterPool(self, request, context):
        self._run(context, self._state.register_pool, convert.pool_from_proto(request))
        return pb.Ack()

    def RegisterEngine(self, request, context):
        self._run(context, lambda: self._state.register_engine(convert.engine_info_from_proto(request)))
        return pb.Ack()

    def UpdateEngineState(self, request, context):
        self._run(context, lambda: self._state.update_engine_state(
            request.engine_id, convert.engine_state_from_proto(request.state), request.message))
        return pb.Ack()

    def AnnounceVersion(self, request, context):
        manifest = convert.manifest_from_proto(request.manifest)
        if manifest.policy_version != request.policy_version:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"announcement for policy_version "
                          f"{request.policy_version} carries a manifest for {manifest.policy_version}")
        self._run(context, self._state.announce_version, manifest, request.trainer_step)
        return pb.Ack()

    def GetManifest(self, request, context):
        return convert.manifest_to_proto(self._run(context, self._state.get_manifest, request.policy_version))

    def AckVersion(self, request, context):
        committed = self._run(context, self._state.ack_version, request.engine_id, request.policy_version,
                              request.layout_digest)
        return pb.AckReply(committed_version=committed)

    def GetStatus(self, request, context):
        return convert.status_to_proto(self._state.status())

    def SetMaxStaleness(self, request, context):
        return pb.MaxStaleness(value=self._run(context, self._state.set_max_staleness, request.value))


class CoordinatorServer:
    """The coordinator's gRPC server around one ``CoordinatorState`` (``.state``)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, max_staleness: int = 0, run_dir: str = "",
                 max_workers: int = 8, num_manifests_kept: int = 4):
        self.host = host
        self.state = CoordinatorState(max_staleness, run_dir, num_manifests_kept)
        self._requested_port = port
        self._max_workers = max_workers
        self._server: grpc.Server | None = None
        self._port = 0

    def start(self) -> "CoordinatorServer":
        if self._server is not None:
            raise ControlError(f"coordinator already started at {self.address}")
        server = grpc.server(ThreadPoolExecutor(self._max_workers, thread_name_prefix="coordinator"),
                             options=GRPC_OPTIONS)
        pb_grpc.add_CoordinatorServicer_to_server(_Servicer(self.state), server)
        target = f"{_host_for_target(self.host)}:{self._requested_port}"
        try:
            port = server.add_insecure_port(target)
        except RuntimeError as e:
            raise ControlError(f"coordinator could not bind {target}: {e}") from e
        if port == 0:
            raise ControlError(f"coordinator could not bind {target}")
        server.start()
        self._server, self._port = server, port
        logger.info("[coordinator] serving at %s (max_staleness=%d)", self.address, self.state.max_staleness())
        return self

    @property
    def address(self) -> str:
        """``host:port`` with the port actually bound; only valid after ``start()``."""
        if self._server is None:
            raise ControlError("coordinator not started: call start() before reading its address")
        return f"{_host_for_target(self.host)}:{self._port}"

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop serving; in-flight calls get ``grace_s`` to finish. A no-op if not started."""
        if self._server is None:
            return
        address = self.address
        done = self._server.stop(grace_s)
        if not done.wait(timeout=grace_s + 5.0):
            logger.warning("[coordinator] server at %s did not shut down within %.1fs", address, grace_s + 5.0)
        self._server = None
        logger.info("[coordinator] stopped serving at %s", address)

    def __enter__(self) -> "CoordinatorServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _host_for_target(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
