"""The coordinator's client: one method per RPC, plain dataclasses in and out.

Engines (Ray actors), the driver and ``disagg ctl`` use it. Every call carries
the client's timeout, and every gRPC failure becomes a ``ControlRpcError`` (a
``ControlError``) naming the RPC, the address and the status code, so a dead
coordinator is an error with a cause, never a hang.

The channel is made lazily and is never pickled: a client built in the driver
can be passed to a Ray actor, which opens its own channel on first use.
"""

from __future__ import annotations

import logging
import threading
import time

import grpc

from disagg.control import convert
from disagg.control.auth import bearer, channel_credentials
from disagg.control.convert import pb, pb_grpc
from disagg.control.server import GRPC_OPTIONS
from disagg.control.types import ClusterStatus, EngineInfo, EngineState, PoolStatus
from disagg.errors import ControlError
from disagg.transport.manifest import Manifest

logger = logging.getLogger("disagg.control")


class ControlRpcError(ControlError):
    """A coordinator RPC failed; ``code`` is the gRPC status code name, e.g. "NOT_FOUND"."""

    def __init__(self, rpc: str, address: str, code: str, details: str):
        super().__init__(f"coordinator RPC {rpc} to {address} failed: {code}: {details}")
        self.rpc, self.address, self.code, self.details = rpc, address, code, details


class CoordinatorClient:
    """Talks to one coordinator at ``address`` ("host:port")."""

    def __init__(self, address: str, timeout_s: float = 30.0, token: str | None = None, tls_ca: str | None = None):
        if not address or ":" not in address:
            raise ValueError(f"coordinator address must be 'host:port', got {address!r}")
        if timeout_s <= 0:
            raise ValueError(f"coordinator timeout_s must be > 0, got {timeout_s}")
        self.address = address
        self.timeout_s = timeout_s
        self.token, self.tls_ca = token, tls_ca
        self._metadata = bearer(token) if token else None
        self._lock = threading.Lock()  # guards the lazy channel; a client is shared by an actor's threads
        self._channel: grpc.Channel | None = None
        self._stub: pb_grpc.CoordinatorStub | None = None
        self._ops: pb_grpc.OpsStub | None = None

    def __getstate__(self) -> dict:
        return {"address": self.address, "timeout_s": self.timeout_s, "token": self.token, "tls_ca": self.tls_ca}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["address"], state["timeout_s"], state.get("token"), state.get("tls_ca"))

    def __repr__(self) -> str:  # never the token
        return (f"CoordinatorClient({self.address!r}, timeout_s={self.timeout_s}, "
                f"token={'set' if self.token else None}, tls={'on' if self.tls_ca else 'off'})")

    def close(self) -> None:
        with self._lock:
            if self._channel is not None:
                self._channel.close()
            self._channel = self._stub = self._ops = None

    def __enter__(self) -> "CoordinatorClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def register_pool(self, pool: PoolStatus) -> None:
        self._call("RegisterPool", convert.pool_to_proto(pool))

    def register_engine(self, info: EngineInfo) -> None:
        self._call("RegisterEngine", convert.engine_info_to_proto(info))

    def update_engine_state(self, engine_id: int, state: EngineState, message: str = "") -> None:
        request = pb.EngineStateUpdate(engine_id=engine_id, state=convert.engine_state_to_proto(state), message=message)
        self._call("UpdateEngineState", request)

    def announce_version(self, manifest: Manifest, trainer_step: int) -> None:
        request = pb.VersionAnnouncement(
            policy_version=manifest.policy_version, trainer_step=trainer_step, manifest=convert.manifest_to_proto(manifest)
        )
        self._call("AnnounceVersion", request)

    def get_manifest(self, policy_version: int) -> Manifest:
        reply = self._call("GetManifest", pb.ManifestRequest(policy_version=policy_version))
        return convert.manifest_from_proto(reply)

    def ack_version(self, engine_id: int, policy_version: int, layout_digest: str) -> int:
        """Report that the engine serves ``policy_version``; return the committed version."""
        request = pb.VersionAck(engine_id=engine_id, policy_version=policy_version, layout_digest=layout_digest)
        return self._call("AckVersion", request).committed_version

    def get_status(self) -> ClusterStatus:
        return convert.status_from_proto(self._call("GetStatus", pb.StatusRequest()))

    def set_max_staleness(self, value: int) -> int:
        return self._call("SetMaxStaleness", pb.MaxStaleness(value=value)).value

    # ---- the Ops service (operators, `disagg ctl`) -----------------------------------------
    def status(self) -> ClusterStatus:
        """Ops.Status: the coordinator's view plus the run (phase, buffer, per-engine load)."""
        return convert.status_from_proto(self._call("Status", pb.StatusRequest(), service="ops"))

    def pause_rollout(self, reason: str = "") -> str:
        return self._call("PauseRollout", pb.OpsRequest(reason=reason), service="ops").message

    def resume_rollout(self, reason: str = "") -> str:
        return self._call("ResumeRollout", pb.OpsRequest(reason=reason), service="ops").message

    def scale_rollout(self, num_engines: int, reason: str = "") -> str:
        """Ops.ScaleRollout: returns at once; ``status()`` shows engines joining or draining."""
        return self._call("ScaleRollout", pb.ScaleRequest(num_engines=num_engines, reason=reason), service="ops").message

    def checkpoint(self, timeout_s: float = 600.0) -> tuple[int, int, str]:
        """Ask for a checkpoint after the step in progress; returns (step, policy version, path) once written."""
        r = self._call("Checkpoint", pb.OpsRequest(), timeout_s=timeout_s, service="ops")
        return r.step, r.policy_version, r.path

    def stop(self, reason: str = "") -> str:
        return self._call("Stop", pb.OpsRequest(reason=reason), service="ops").message

    def watch_metrics(self, from_step: int = 0):
        """Yield (step, {metric: value}) as steps finish; ends when the job stops. No deadline: a live stream."""
        _, ops = self._stubs()
        try:
            for m in ops.WatchMetrics(pb.WatchRequest(from_step=from_step), metadata=self._metadata):
                yield m.step, dict(m.values)
        except grpc.RpcError as e:
            raise ControlRpcError("WatchMetrics", self.address, e.code().name, e.details() or "") from None

    def wait_ready(self, timeout_s: float, log_every_s: float = 5.0) -> ClusterStatus:
        """Poll ``GetStatus`` until the coordinator answers; raise ``ControlError`` after ``timeout_s``."""
        start = time.monotonic()
        deadline = start + timeout_s
        next_log = start + log_every_s
        while True:
            remaining = deadline - time.monotonic()
            try:
                return convert.status_from_proto(
                    self._call("GetStatus", pb.StatusRequest(), timeout_s=max(0.01, min(1.0, remaining)))
                )
            except ControlRpcError as e:
                if e.code not in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
                    raise
                last = e
            now = time.monotonic()
            if now >= deadline:
                raise ControlError(f"coordinator at {self.address} not ready after {timeout_s:.1f}s; last error: {last}")
            if now >= next_log:
                logger.info("waiting for coordinator at %s (%.0fs of %.0fs): %s", self.address, now - start,
                            timeout_s, last.code)
                next_log = now + log_every_s
            time.sleep(min(0.2, max(0.0, deadline - now)))

    def _stubs(self) -> tuple[pb_grpc.CoordinatorStub, pb_grpc.OpsStub]:
        with self._lock:
            if self._stub is None:
                if self.tls_ca:
                    self._channel = grpc.secure_channel(self.address, channel_credentials(self.tls_ca),
                                                        options=GRPC_OPTIONS)
                else:
                    self._channel = grpc.insecure_channel(self.address, options=GRPC_OPTIONS)
                self._stub = pb_grpc.CoordinatorStub(self._channel)
                self._ops = pb_grpc.OpsStub(self._channel)
            return self._stub, self._ops

    def _call(self, rpc: str, request, timeout_s: float | None = None, service: str = "coordinator"):
        coord, ops = self._stubs()
        stub = ops if service == "ops" else coord
        try:
            return getattr(stub, rpc)(request, timeout=timeout_s or self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as e:
            raise ControlRpcError(rpc, self.address, e.code().name, e.details() or "") from None
