"""vLLM's own OpenAI server (``/v1/chat/completions``, ``/v1/completions``, ...) inside an engine actor.

The app is vLLM's (``build_app`` + ``init_app_state`` over the actor's AsyncLLM),
served by uvicorn on the actor's event loop; disagg adds one ASGI layer in front
of it, ``WeightsGate``, which decides per route (the route of vLLM's router that
a request matches, and its method; ``route_access``):

- **allow**: listing models, version, metrics, tokenize/detokenize pass at once,
  weights or not (they never run the model);
- **ready**: ``/health`` and SageMaker's ``/ping`` answer 503 until real weights
  are loaded, then go to vLLM's health check, so a load balancer sends no traffic
  to an engine that cannot serve; ``/live`` (the gate's own) is 200 while the
  process runs;
- **refuse**: routes that change the engine itself (pause, sleep, weight updates,
  collective RPCs, cache resets, scaling, profiling, LoRA loading) get a 403 naming
  the route: disagg drives its engines, a client of the public server never does;
- **gate**, every other route, including any a future vLLM adds and any path no
  route matches: waits for the engine's weights-loaded event, so no client is ever
  answered by dummy weights (a request that waits longer than
  ``rollout.weights_wait_timeout_s`` gets a 503 naming the wait). Each gated
  response carries ``x-disagg-policy-version-min`` / ``-max``: the version the
  engine served when the request passed the gate and when the response started.
  Every generated token's version lies between them (a request paused across
  weight updates spans several), so staleness measured from ``-min`` is never
  under-estimated. Gated requests in flight are counted for the actor's stats.

In front of the gate, ``KeyCheck``: an endpoint bound off loopback (``rollout.api_host``) answers
401 to any request that arrived on an interface other than loopback without
``Authorization: Bearer <key>`` (the job's control token unless ``rollout.api_key`` names another),
on every route but the probes (``/live``, ``/health``, ``/ping``: a load balancer's health check
carries no key, and they say only whether the engine is up and has weights). Over loopback no key
is asked: the node's own processes, as before. Such an endpoint also listens on loopback at the same
port where that port is free there.

The gate must never let a route it has not classified through before the first
sync: a new route waits (deny by default). Only the engine actor starts this
module's server (uvicorn; the app is the engine's own); ``route_access`` is pure.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from dataclasses import dataclass
from typing import Any, Callable, Literal

from disagg.errors import ConfigError
from disagg.rollout.types import VERSION_MAX_HEADER, VERSION_MIN_HEADER

log = logging.getLogger("disagg.rollout")

Access = Literal["allow", "ready", "refuse", "gate"]

LIVENESS_PATH = "/live"
"""The gate's own route: 200 while the process runs, weights or not (vLLM has no such route)."""

ALLOWED_BEFORE_WEIGHTS = frozenset({
    ("GET", "/v1/models"), ("GET", "/version"), ("GET", "/metrics"), ("GET", "/load"),
    ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/tokenizer_info"),
})
"""(method, route path) that never run the model: served before real weights are loaded.
``/metrics`` is both a route and a mount (Prometheus' app); ``/load`` is vLLM's in-flight count."""

READINESS_PATHS = frozenset({"/health", "/ping"})
"""Readiness checks (vLLM's and SageMaker's): 503 until real weights are loaded, any method."""

ENGINE_CONTROL_PATHS = frozenset({
    # elastic expert parallelism
    "/scale_elastic_ep", "/is_scaling_elastic_ep",
    # RL weight transfer and scheduling (VLLM_SERVER_DEV_MODE)
    "/pause", "/resume", "/is_paused", "/abort_requests", "/inference/v1/abort_requests",
    "/init_weight_transfer_engine", "/shutdown_weight_transfer_engine", "/start_weight_update",
    "/start_draft_weight_update", "/update_weights", "/finish_weight_update", "/update_weight_version",
    "/weight_checker", "/weight_info", "/get_world_size",
    # development routes (VLLM_SERVER_DEV_MODE)
    "/collective_rpc", "/reset_prefix_cache", "/reset_mm_cache", "/reset_encoder_cache", "/sleep", "/wake_up",
    "/is_sleeping", "/release_kv_cache_memory", "/server_info",
    # profiler, runtime LoRA (VLLM_ALLOW_RUNTIME_LORA_UPDATING; /adapters is SageMaker's), fault tolerance
    "/start_profile", "/stop_profile", "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/adapters",
    "/adapters/{adapter_name}",
    "/fault_tolerance/apply", "/fault_tolerance/status",
})
"""Route paths that control the engine: refused (403) on the public server, any method."""


def route_access(method: str, route_path: str | None) -> Access:
    """What the gate does with ``method`` on the route whose path template is ``route_path``
    (None: no route matched the request). Anything not listed above waits for weights."""
    method = "GET" if method == "HEAD" else method
    if route_path in ENGINE_CONTROL_PATHS:
        return "refuse"
    if route_path in READINESS_PATHS:
        return "ready"
    if (method, route_path) in ALLOWED_BEFORE_WEIGHTS:
        return "allow"
    return "gate"


def matched_route(routes, scope) -> str | None:
    """The path template of the route a Starlette router dispatches ``scope`` to: the first
    route that matches fully, else the first whose path matches but not its method (a 405)."""
    from starlette.routing import Match

    partial = None
    for route in routes:
        match, _ = route.matches(scope)
        if match == Match.FULL:
            return getattr(route, "path", None)
        if match == Match.PARTIAL and partial is None:
            partial = getattr(route, "path", None)
    return partial


OPEN_WITHOUT_KEY = frozenset({LIVENESS_PATH, *READINESS_PATHS})
"""Paths answered without a key on every interface: the probes (whether the process is up, whether
it has weights); nothing else."""


def is_loopback(host: str | None) -> bool:
    """Whether ``host`` (an address, or 'localhost') is this machine's loopback."""
    import ipaddress

    if host is None:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


class KeyCheck:
    """ASGI middleware: with a ``key``, a request that arrived on an interface other than loopback
    (``scope["server"]``: the address it was sent to) must carry ``Authorization: Bearer <key>``,
    or it gets a 401 naming what is missing; the probes (``OPEN_WITHOUT_KEY``) pass."""

    def __init__(self, app, key: str | None) -> None:
        self.app = app
        self._expected = f"Bearer {key}".encode() if key else None

    async def __call__(self, scope, receive, send) -> None:
        if (self._expected is None or scope["type"] not in ("http", "websocket")
                or scope["path"] in OPEN_WITHOUT_KEY or is_loopback((scope.get("server") or (None,))[0])):
            await self.app(scope, receive, send)
            return
        import hmac

        got = dict(scope.get("headers") or ()).get(b"authorization", b"")
        if hmac.compare_digest(got, self._expected):
            await self.app(scope, receive, send)
            return
        why = ("wrong key" if got else "no key: send 'Authorization: Bearer <key>' (the job's control token, "
               "<run_dir>/control.token, unless rollout.api_key names another)")
        await _deny(scope, send, 401, "Unauthorized", f"{scope.get('method', 'WEBSOCKET')} {scope['path']}: {why}")


class WeightsGate:
    """ASGI middleware: decide per route (``route_access``), hold gated routes on real weights,
    tag their responses with policy versions, count them in flight."""

    def __init__(self, app, *, wait_weights: Callable[[str], Any], ready: Callable[[], bool],
                 version: Callable[[], int], counters: dict[str, int]) -> None:
        self.app, self.wait_weights, self.ready = app, wait_weights, ready
        self.version, self.counters = version, counters

    def routes(self) -> list[dict[str, Any]]:
        """Every route of the app as built, and what the gate does with each of its methods."""
        out = [{"path": LIVENESS_PATH, "kind": "liveness", "methods": ["GET"], "access": {"GET": "allow"}}]
        for route in self.app.routes:
            kind = type(route).__name__
            methods = (["WEBSOCKET"] if "WebSocket" in kind
                       else sorted(getattr(route, "methods", None) or ["GET"]))  # a Mount: any method
            path = getattr(route, "path", None)
            out.append({"path": path, "kind": kind, "methods": methods,
                        "access": {m: route_access(m, path) for m in methods}})
        return out

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "http" and scope["path"] == LIVENESS_PATH:
            await _send_json(send, 200, {"status": "alive"})
            return
        method = scope["method"] if scope["type"] == "http" else "WEBSOCKET"
        route = matched_route(self.app.routes, scope)
        access = route_access(method, route)
        what = f"{method} {scope['path']}"
        if access == "refuse":
            log.warning("refused %s: route %s controls the engine", what, route)
            await _deny(scope, send, 403, "Forbidden",
                        f"{what} is refused on this engine's public server: route {route} controls the engine "
                        "(weights, pausing, caches, scaling, profiling), which disagg alone drives")
            return
        if access == "ready" and not self.ready():
            await _deny(scope, send, 503, "ServiceUnavailable",
                        f"{what}: not ready, this engine has no real weights yet (it is ready after its first "
                        f"weight sync; {LIVENESS_PATH} answers whether the process is up)")
            return
        if access != "gate":
            await self.app(scope, receive, send)
            return
        await self._gated(scope, receive, send, what)

    async def _gated(self, scope, receive, send, what: str) -> None:
        self.counters["http_waiting"] += 1
        try:
            await self.wait_weights(f"first weights ({what})")
        except TimeoutError as e:
            await _deny(scope, send, 503, "ServiceUnavailable", str(e))
            return
        finally:
            self.counters["http_waiting"] -= 1
        v_min = self.version()
        self.counters["http_inflight"] += 1
        self.counters["http_requests"] += 1

        async def tagged(message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers += [(VERSION_MIN_HEADER.encode(), str(v_min).encode()),
                            (VERSION_MAX_HEADER.encode(), str(self.version()).encode())]
                message = dict(message, headers=headers)
            await send(message)

        try:
            await self.app(scope, receive, tagged)
        finally:
            self.counters["http_inflight"] -= 1


async def _send_json(send, status: int, payload: dict, headers: list | None = None) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), *(headers or [])]})
    await send({"type": "http.response.body", "body": json.dumps(payload).encode()})


async def _deny(scope, send, status: int, error_type: str, message: str) -> None:
    """An OpenAI-style error; a WebSocket is closed before it is accepted (the server answers 403)."""
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1013 if status == 503 else 1008, "reason": message[:120]})
        return
    extra = [(b"www-authenticate", b"Bearer")] if status == 401 else []
    await _send_json(send, status, {"error": {"message": message, "type": error_type, "code": status}}, extra)


@dataclass(frozen=True)
class ServerAccess:
    """Who may reach an engine's OpenAI endpoint: where it binds, the key it asks off loopback
    (None: none), and the PEM certificate and key of its TLS (None: plain HTTP)."""

    host: str
    port: int
    key: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None

    def check(self) -> None:
        """A ConfigError when the endpoint would answer other hosts without a key."""
        if not is_loopback(self.host) and not self.key:
            raise ConfigError(f"rollout.api_host={self.host!r}: the engines' OpenAI API would answer other hosts "
                              "with no key to ask them for (rollout.api_key: env:NAME or file:PATH; a training job "
                              "uses its control token)")


def _sockets(host: str, port: int) -> list[socket.socket]:
    """The listening sockets: ``host:port`` (0 = a free port), and loopback at the same port too
    where ``host`` is one other address (not loopback, not every interface) and that port is free."""
    def bind(h: str, p: int) -> socket.socket:
        sock = socket.socket(socket.AF_INET6 if ":" in h else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((h, p))
        except OSError:
            sock.close()
            raise
        return sock

    main = bind(host, port)
    if is_loopback(host) or host in ("0.0.0.0", "::"):
        return [main]
    try:
        return [main, bind("127.0.0.1", main.getsockname()[1])]
    except OSError as e:
        log.warning("OpenAI API: not on loopback too (127.0.0.1:%d: %s); clients on this node use %s",
                    main.getsockname()[1], e.strerror, host)
        return [main]


async def start_openai_server(app, *, served_model_name: str, access: ServerAccess, tool_call_parser: str | None,
                              wait_weights: Callable[[str], Any], ready: Callable[[], bool], version: Callable[[], int],
                              counters: dict[str, int]):
    """Serve ``app`` (the engine's own OpenAI app: ``EngineBackend.openai_app``) as ``access`` says,
    behind ``KeyCheck`` and ``WeightsGate``.

    Returns ``(server, serve_task, "http(s)://host:port", gate)``; stop with
    ``server.should_exit = True`` and await the task.
    """
    import uvicorn

    access.check()
    gate = WeightsGate(app, wait_weights=wait_weights, ready=ready, version=version, counters=counters)

    sockets = _sockets(access.host, access.port)
    bound_port = sockets[0].getsockname()[1]
    config = uvicorn.Config(KeyCheck(gate, access.key), log_level="warning", lifespan="off", access_log=False,
                            timeout_keep_alive=30, ssl_certfile=access.tls_cert, ssl_keyfile=access.tls_key)
    server = uvicorn.Server(config)
    server.capture_signals = contextlib.nullcontext  # the actor owns SIGINT/SIGTERM, not uvicorn
    task = asyncio.get_running_loop().create_task(server.serve(sockets=sockets))
    for _ in range(200):  # started within 10 s or the task's error surfaces
        if server.started or task.done():
            break
        await asyncio.sleep(0.05)
    if task.done():
        task.result()
    if not server.started:
        raise RuntimeError(f"OpenAI server on {access.host}:{bound_port} did not start within 10 s")
    host = f"[{access.host}]" if ":" in access.host else access.host
    address = f"{'https' if access.tls_cert else 'http'}://{host}:{bound_port}"
    log.info("OpenAI API at %s/v1 (model %r, tool parser %s%s)", address, served_model_name, tool_call_parser,
             "" if is_loopback(access.host) else ", a key asked off loopback"
             + (", also on 127.0.0.1 without one" if len(sockets) > 1 else ""))
    return server, task, address, gate
