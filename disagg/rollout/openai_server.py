"""vLLM's own OpenAI server (``/v1/chat/completions``, ``/v1/completions``, ...) inside an engine actor.

The app is vLLM's (``build_app`` + ``init_app_state`` over the actor's AsyncLLM),
served by uvicorn on the actor's event loop; disagg adds one ASGI layer in front
of it, ``WeightsGate``:

- every POST under ``/v1/`` waits for the engine's weights-loaded event first, so
  no client is ever answered by dummy weights (a request that waits longer than
  ``rollout.weights_wait_timeout_s`` gets a 503 naming the wait);
- each response carries ``x-disagg-policy-version-min`` / ``-max``: the version
  the engine served when the request passed the gate and when the response
  started. Every generated token's version lies between them (a request paused
  across weight updates spans several), so staleness measured from ``-min`` is
  never under-estimated;
- requests in flight are counted for the actor's stats.

Only the engine actor imports this module (it imports vLLM, FastAPI, uvicorn).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from typing import Any, Callable

from disagg.rollout.types import VERSION_MAX_HEADER, VERSION_MIN_HEADER

log = logging.getLogger("disagg.rollout")



class WeightsGate:
    """ASGI middleware: gate on real weights, tag responses with policy versions, count in-flight."""

    def __init__(self, app, *, wait_weights: Callable[[str], Any], version: Callable[[], int],
                 counters: dict[str, int]) -> None:
        self.app, self.wait_weights, self.version, self.counters = app, wait_weights, version, counters

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        self.counters["http_waiting"] += 1
        try:
            await self.wait_weights(f"first weights (HTTP {scope['path']})")
        except TimeoutError as e:
            body = json.dumps({"error": {"message": str(e), "type": "ServiceUnavailable", "code": 503}}).encode()
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": body})
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


async def start_openai_server(engine, *, model_path: str, served_model_name: str, host: str, port: int,
                              tool_call_parser: str | None, wait_weights: Callable[[str], Any],
                              version: Callable[[], int], counters: dict[str, int]):
    """Serve vLLM's OpenAI app for ``engine`` on ``host:port`` (0 = a free port).

    Returns ``(server, serve_task, "http://host:port")``; stop with
    ``server.should_exit = True`` and await the task.
    """
    import uvicorn

    from disagg.rollout.vllm_api import openai_app_builders

    build_app, init_app_state, make_arg_parser, FlexibleArgumentParser = openai_app_builders()

    argv = ["--model", model_path, "--served-model-name", served_model_name, "--disable-log-stats",
            "--disable-fastapi-docs"]
    if tool_call_parser:
        argv += ["--enable-auto-tool-choice", "--tool-call-parser", tool_call_parser]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    tasks = await engine.get_supported_tasks()
    app = build_app(args, tasks, engine.model_config)
    await init_app_state(engine, app.state, args, tasks)
    gated = WeightsGate(app, wait_weights=wait_weights, version=version, counters=counters)

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    bound_port = sock.getsockname()[1]
    config = uvicorn.Config(gated, log_level="warning", lifespan="off", access_log=False,
                            timeout_keep_alive=30)
    server = uvicorn.Server(config)
    server.capture_signals = contextlib.nullcontext  # the actor owns SIGINT/SIGTERM, not uvicorn
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    for _ in range(200):  # started within 10 s or the task's error surfaces
        if server.started or task.done():
            break
        await asyncio.sleep(0.05)
    if task.done():
        task.result()
    if not server.started:
        raise RuntimeError(f"OpenAI server on {host}:{bound_port} did not start within 10 s")
    address = f"http://{host}:{bound_port}"
    log.info("OpenAI API at %s/v1 (model %r, tool parser %s)", address, served_model_name, tool_call_parser)
    return server, task, address
