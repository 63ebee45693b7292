"""The coordinator: one gRPC server holding the cluster's control state.

The driver starts it in-process and reads the same state directly
(``server.state``, a ``CoordinatorState`` from ``state.py``); engines and
``disagg ctl`` reach it over gRPC through the two servicers here, which only
convert messages and map a ``RejectedError`` to its status code. It never moves
weights or samples.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import grpc

from disagg.control import convert
from disagg.control.auth import TokenAuthInterceptor, server_credentials
from disagg.control.convert import pb, pb_grpc
from disagg.control.state import CoordinatorState, RejectedError
from disagg.errors import ControlError

logger = logging.getLogger("disagg.control")

# Manifests can list thousands of tensors; gRPC's default 4 MiB cap is too tight.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def _answer(context: grpc.ServicerContext, fn, *args):
    """Call the state; map ``RejectedError`` to its status code and ``ValueError`` to INVALID_ARGUMENT."""
    try:
        return fn(*args)
    except RejectedError as e:
        context.abort(e.code, str(e))
    except ValueError as e:  # a malformed request, e.g. an unset engine state
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))


class _Servicer(pb_grpc.CoordinatorServicer):
    """Wire adapter: convert, call the state, map ``RejectedError`` to a status code."""

    def __init__(self, state: CoordinatorState):
        self._state = state

    def RegisterPool(self, request, context):
        _answer(context, self._state.register_pool, convert.pool_from_proto(request))
        return pb.Ack()

    def RegisterEngine(self, request, context):
        _answer(context, lambda: self._state.register_engine(convert.engine_info_from_proto(request)))
        return pb.Ack()

    def UpdateEngineState(self, request, context):
        _answer(context, lambda: self._state.update_engine_state(
            request.engine_id, convert.engine_state_from_proto(request.state), request.message))
        return pb.Ack()

    def AnnounceVersion(self, request, context):
        manifest = convert.manifest_from_proto(request.manifest)
        if manifest.policy_version != request.policy_version:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"announcement for policy_version "
                          f"{request.policy_version} carries a manifest for {manifest.policy_version}")
        _answer(context, self._state.announce_version, manifest, request.trainer_step)
        return pb.Ack()

    def GetManifest(self, request, context):
        return convert.manifest_to_proto(_answer(context, self._state.get_manifest, request.policy_version))

    def AckVersion(self, request, context):
        committed = _answer(context, self._state.ack_version, request.engine_id, request.policy_version,
                              request.layout_digest)
        return pb.AckReply(committed_version=committed)

    def GetStatus(self, request, context):
        return convert.status_to_proto(self._state.status())

    def SetMaxStaleness(self, request, context):
        return pb.MaxStaleness(value=_answer(context, self._state.set_max_staleness, request.value))


class _OpsServicer(pb_grpc.OpsServicer):
    """The operator's API over the same state (see protos/disagg/v1/coordinator.proto)."""

    def __init__(self, state: CoordinatorState):
        self._state = state

    def Status(self, request, context):
        return convert.status_to_proto(self._state.status())

    def PauseRollout(self, request, context):
        return pb.OpsReply(message=_answer(context, self._state.pause_rollout, request.reason))

    def ResumeRollout(self, request, context):
        return pb.OpsReply(message=_answer(context, self._state.resume_rollout, request.reason))

    def SetMaxStaleness(self, request, context):
        return pb.MaxStaleness(value=_answer(context, self._state.set_max_staleness, request.value))

    def ScaleRollout(self, request, context):
        return pb.OpsReply(message=_answer(context, self._state.request_scale, request.num_engines, request.reason))

    def Checkpoint(self, request, context):
        remaining = context.time_remaining()
        timeout = 3600.0 if remaining is None else max(0.0, remaining - 0.5)
        step, version, path = _answer(context, self._state.request_checkpoint, timeout)
        return pb.CheckpointReply(step=step, policy_version=version, path=path)

    def Stop(self, request, context):
        return pb.OpsReply(message=_answer(context, self._state.request_stop, request.reason))

    def WatchMetrics(self, request, context):
        if request.from_step < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"from_step must be >= 0 (0 = from the next step), "
                          f"got {request.from_step}")
        try:
            for step, values in self._state.watch_metrics(request.from_step, context.is_active):
                yield pb.StepMetrics(step=step, values=values)
        except RejectedError as e:
            context.abort(e.code, str(e))


class CoordinatorServer:
    """The coordinator's gRPC server around one ``CoordinatorState`` (``.state``)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, max_staleness: int = 0, run_dir: str = "",
                 max_workers: int = 32, num_manifests_kept: int = 4, token: str | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None, metrics_port: int | None = None):
        if (tls_cert is None) != (tls_key is None):
            raise ControlError(f"TLS needs both control.tls_cert and control.tls_key (got cert={tls_cert!r}, "
                               f"key={tls_key!r})")
        self.host = host
        self.token, self.tls_cert, self.tls_key = token, tls_cert, tls_key
        self.state = CoordinatorState(max_staleness, run_dir, num_manifests_kept)
        self._requested_port = port
        self._max_workers = max_workers
        self._server: grpc.Server | None = None
        self._port = 0
        self._metrics_port = metrics_port  # Prometheus /metrics on host:metrics_port (0: free); None: off
        self.metrics = None  # the MetricsExporter while serving

    def start(self) -> "CoordinatorServer":
        if self._server is not None:
            raise ControlError(f"coordinator already started at {self.address}")
        interceptors = [TokenAuthInterceptor(self.token)] if self.token else []
        server = grpc.server(ThreadPoolExecutor(self._max_workers, thread_name_prefix="coordinator"),
                             options=GRPC_OPTIONS, interceptors=interceptors)
        pb_grpc.add_CoordinatorServicer_to_server(_Servicer(self.state), server)
        pb_grpc.add_OpsServicer_to_server(_OpsServicer(self.state), server)
        target = f"{_host_for_target(self.host)}:{self._requested_port}"
        try:
            if self.tls_cert:
                port = server.add_secure_port(target, server_credentials(self.tls_cert, self.tls_key))
            else:
                port = server.add_insecure_port(target)
        except RuntimeError as e:
            raise ControlError(f"coordinator could not bind {target}: {e}") from e
        if port == 0:
            raise ControlError(f"coordinator could not bind {target}")
        server.start()
        self._server, self._port = server, port
        if self._metrics_port is not None:
            from disagg.control.prometheus import MetricsExporter

            self.metrics = MetricsExporter(self.state)
            try:
                url = self.metrics.serve(self.host, self._metrics_port, self.tls_cert, self.tls_key)
            except ControlError:
                self.stop(0.0)
                raise
            self.state.set_metrics_url(url)
        logger.info("[coordinator] serving at %s (max_staleness=%d, %s, %s)", self.address,
                    self.state.max_staleness(), "TLS" if self.tls_cert else "no TLS",
                    "token required" if self.token else "no token")
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
        if self.metrics is not None:
            self.metrics.stop()
            self.metrics = None
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
