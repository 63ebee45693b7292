"""Every route of an engine's OpenAI server, before and after the first weight sync.

The routes are those of vLLM's app as the engine built it (``EngineActor.get_http_routes``
iterates the real FastAPI app), so a route a later vLLM adds is probed without a change here.
The engine runs with vLLM's development and runtime-LoRA routes on (pause, sleep, weight
updates, collective RPC, cache resets, adapters), which are the routes a client of the
public server must never reach. Each route gets one real HTTP request over loopback.

Before any weights: a route answers at once only if it is in ``SAFE`` (this test's own list
of routes that never run the model), is a readiness check answering 503, or is refused
(403 naming the route); every other route must still be waiting. After the sync, each
waiting request is served by the synced weights.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import http.client
import json
import os
import re
import time
import urllib.parse

import pytest

from disagg.rollout.types import VERSION_MIN_HEADER
from tests.conftest import small_config

# What may answer before the first sync: nothing here runs the model.
SAFE = {("GET", "/live"), ("GET", "/v1/models"), ("GET", "/version"), ("GET", "/metrics"), ("GET", "/metrics/"),
        ("GET", "/load"), ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/tokenizer_info")}
READINESS = {"/health", "/ping"}
# Routes that change the engine; each must be among the app's routes (the engine enables them) and refused.
ENGINE_CONTROL = {"/pause", "/resume", "/sleep", "/wake_up", "/collective_rpc", "/reset_prefix_cache",
                  "/init_weight_transfer_engine", "/update_weights", "/scale_elastic_ep", "/v1/load_lora_adapter",
                  "/adapters"}
# Routes that run the model; each must wait for the weights, then answer 200 from them.
GENERATION = {"/v1/completions", "/v1/chat/completions", "/invocations"}
UNROUTED = "/no/such/route"  # matches no route: waits too (deny by default), then vLLM's 404
WAIT_S = 10.0  # how long a request at the gate must then stay unanswered
PROBE_TIMEOUT_S = 300.0


@pytest.fixture(scope="module")
def job(ray_session, model_cache, tmp_path_factory):
    from disagg.job import Job
    from disagg.model.warmstart import prepare_model
    from disagg.rollout.vllm import api as vllm_api

    cfg = small_config(model_cache, rollout={"max_model_len": 64, "max_tokens": 4})
    with pytest.MonkeyPatch.context() as mp:  # vLLM registers those routes only with these set
        mp.setitem(vllm_api.ENGINE_ENV, "VLLM_SERVER_DEV_MODE", "1")
        mp.setitem(vllm_api.ENGINE_ENV, "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
        j = Job.start(cfg, tmp_path_factory.mktemp("gate-run"), prepare_model(cfg))
    yield j
    j.shutdown()


def _body(path: str) -> dict:
    if "chat" in path or "messages" in path:
        return {"model": "policy", "messages": [{"role": "user", "content": "1+1="}], "max_tokens": 2,
                "temperature": 0}
    return {"model": "policy", "prompt": "1+1=", "max_tokens": 2, "temperature": 0}


def _probes(routes: list[dict]) -> list[tuple[str, str, str]]:
    """(method, request path, route path) for every method of every route; a template's
    parameters get a value, a mount gets a path below it."""
    out = []
    for r in routes:
        path = re.sub(r"\{[^}]*\}", "x", r["path"]) + ("/" if r["kind"] == "Mount" else "")
        out += [(m, path, r["path"]) for m in r["methods"]]
    return out + [("POST", UNROUTED, UNROUTED)]


def _request(address: str, method: str, path: str) -> dict:
    url = urllib.parse.urlparse(address)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=PROBE_TIMEOUT_S)
    try:
        if method == "WEBSOCKET":  # the opening handshake: 101 accepted, 403 closed before accepting
            conn.request("GET", path, headers={"Upgrade": "websocket", "Connection": "Upgrade",
                                               "Sec-WebSocket-Key": base64.b64encode(os.urandom(16)).decode(),
                                               "Sec-WebSocket-Version": "13"})
        else:
            body = json.dumps(_body(path)).encode() if method in ("POST", "PUT", "PATCH") else None
            conn.request(method, path, body=body, headers={"content-type": "application/json"})
        resp = conn.getresponse()
        return {"status": resp.status, "version_min": resp.getheader(VERSION_MIN_HEADER),
                "body": "" if resp.status == 101 else resp.read().decode(errors="replace")[:300]}
    finally:
        conn.close()


def test_every_route_waits_is_refused_or_is_safe_until_the_first_sync(job):
    import ray

    assert job.coordinator.state.latest_version() == 0, "this test must run before the first sync"
    engine = job.rollout.engines[0]
    address = ray.get(engine.get_address.remote(), timeout=60)
    routes = ray.get(engine.get_http_routes.remote(), timeout=60)
    paths = {r["path"] for r in routes}
    assert ENGINE_CONTROL <= paths, f"the engine did not register {sorted(ENGINE_CONTROL - paths)}"
    assert GENERATION <= paths, f"the engine did not register {sorted(GENERATION - paths)}"
    probes = _probes(routes)
    pool = cf.ThreadPoolExecutor(max_workers=len(probes))  # its requests end when they are answered
    futures = {p: pool.submit(_request, address, p[0], p[1]) for p in probes}
    # Until every request is answered or waits at the gate (the engine counts those), however slowly
    # the requests are sent and answered; then the waiting ones must stay there.
    deadline = time.monotonic() + PROBE_TIMEOUT_S
    while sum(f.done() for f in futures.values()) + job.rollout.stats()[0]["http_waiting"] < len(futures):
        assert time.monotonic() < deadline, "a request neither answered nor waiting at the gate"
        time.sleep(0.2)
    time.sleep(WAIT_S)
    before = {p: f.result() if f.done() else None for p, f in futures.items()}  # None: still waiting
    waiting = [p for p, got in before.items() if got is None]
    assert job.rollout.stats()[0]["http_waiting"] == len(waiting), "a request waits somewhere else than the gate"

    wrong = []
    for (method, path, route), got in before.items():
        if got is None:
            if (method, path) in SAFE:
                wrong.append(f"{method} {path} (route {route}) is safe but did not answer before the weights")
            continue
        if (method, path) in SAFE and got["status"] not in (403, 503):
            continue
        if route in READINESS and got["status"] == 503 and "not ready" in got["body"]:
            continue
        refused = f"route {route} controls the engine" in got["body"] or method == "WEBSOCKET"  # no body there
        if got["status"] == 403 and refused:
            continue
        wrong.append(f"{method} {path} (route {route}) answered {got['status']} before any weights: {got['body']}")
    assert not wrong, "\n".join(wrong)
    for method, path, route in probes:
        got = before[(method, path, route)]
        if route in ENGINE_CONTROL:
            assert got is not None and got["status"] == 403, f"{method} {path} changes the engine, not refused: {got}"
        if route in READINESS:
            assert got is not None and got["status"] == 503, f"{method} {path} must say 'not ready' at once: {got}"
        if route in GENERATION or route == UNROUTED:
            assert got is None, f"{method} {path} did not wait for the weights"
    assert before[("GET", "/live", "/live")]["status"] == 200

    job.sync_weights(1, trainer_step=0)
    _, not_done = cf.wait([futures[p] for p in waiting], timeout=PROBE_TIMEOUT_S)
    assert not not_done, f"{len(not_done)} requests still wait after the first sync"
    for p in waiting:
        got = futures[p].result()
        assert got["version_min"] == "1", f"{p[0]} {p[1]} after the sync: {got}"  # passed the gate on version 1
        assert got["status"] != 503, f"{p[0]} {p[1]} after the sync: {got}"
        if p[2] in GENERATION:
            assert got["status"] == 200, f"{p[0]} {p[1]} after the sync: {got}"
    assert futures[("POST", UNROUTED, UNROUTED)].result()["status"] == 404

    # Synced: ready, still alive, and the engine's controls stay refused.
    for method, path, route in probes:
        if route in READINESS:
            assert _request(address, method, path)["status"] == 200, f"{method} {path} after the sync"
        if route in ENGINE_CONTROL:
            got = _request(address, method, path)
            assert got["status"] == 403 and f"route {route} controls the engine" in got["body"], \
                f"{method} {path} after the sync: {got}"
    assert _request(address, "GET", "/live")["status"] == 200
