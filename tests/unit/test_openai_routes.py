"""The OpenAI server's route classification (``openai_server.route_access``): what each route
does before an engine has real weights. Routes it does not know wait for the weights."""

import pytest

from disagg.rollout.openai_server import route_access


@pytest.mark.parametrize("method, route, access", [
    # run the model, or unknown: wait for the weights (deny by default)
    ("POST", "/v1/completions", "gate"), ("POST", "/v1/chat/completions", "gate"), ("POST", "/invocations", "gate"),
    ("POST", "/inference/v1/generate", "gate"), ("POST", "/v2/a_route_vllm_adds_later", "gate"),
    ("POST", None, "gate"),  # no route matched the request
    ("WEBSOCKET", "/v1/realtime", "gate"),
    # never run the model: served at once; only with the method listed
    ("GET", "/v1/models", "allow"), ("HEAD", "/v1/models", "allow"), ("POST", "/v1/models", "gate"),
    ("POST", "/tokenize", "allow"), ("GET", "/tokenize", "gate"), ("GET", "/metrics", "allow"),
    # readiness: any method
    ("GET", "/health", "ready"), ("POST", "/ping", "ready"),
    # change the engine: refused, any method
    ("POST", "/pause", "refuse"), ("GET", "/is_paused", "refuse"), ("POST", "/collective_rpc", "refuse"),
    ("POST", "/update_weights", "refuse"), ("DELETE", "/adapters/{adapter_name}", "refuse"),
    ("POST", "/inference/v1/abort_requests", "refuse"),
])
def test_route_access(method, route, access):
    assert route_access(method, route) == access
