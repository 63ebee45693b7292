"""Where the key the engines' OpenAI API asks off loopback comes from (``rollout.api_key``), and the
ASGI layer that asks for it, driven with hand-made ASGI scopes (the real server: test_engine_keys)."""

from __future__ import annotations

import asyncio
import os

import pytest

from disagg.control.auth import api_key, write_token
from disagg.errors import ConfigError
from disagg.rollout.openai_server import KeyCheck, is_loopback


def test_the_key_is_the_control_token_an_environment_variable_or_an_owner_only_file(tmp_path, monkeypatch):
    assert api_key(None, "the-token") == "the-token"
    monkeypatch.setenv("ENGINE_KEY", " k-env \n")
    assert api_key("env:ENGINE_KEY", "the-token") == "k-env"
    monkeypatch.delenv("ENGINE_KEY")
    with pytest.raises(ConfigError, match="rollout.api_key='env:ENGINE_KEY': the environment variable ENGINE_KEY"):
        api_key("env:ENGINE_KEY", "the-token")
    token, path = write_token(tmp_path)
    assert api_key(f"file:{path}", None) == token
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match="readable by its owner only"):
        api_key(f"file:{path}", None)
    with pytest.raises(ConfigError, match="cannot read"):
        api_key(f"file:{tmp_path}/none", None)


def _call(app, path: str, server_host: str, headers: list | None = None) -> tuple[int, bytes]:
    sent: list[dict] = []
    scope = {"type": "http", "method": "POST", "path": path, "headers": headers or [],
             "server": (server_host, 8000), "client": ("10.0.0.9", 5555)}

    async def receive():
        return {"type": "http.request", "body": b""}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


async def _ok(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"model"})


@pytest.mark.parametrize("server_host, headers, status, says", [
    ("10.0.0.5", [], 401, b"no key"),
    ("10.0.0.5", [(b"authorization", b"Bearer nope")], 401, b"wrong key"),
    ("10.0.0.5", [(b"authorization", b"Bearer s3cret")], 200, b"model"),
    ("127.0.0.1", [], 200, b"model"),  # arrived over loopback
    ("::1", [], 200, b"model"),
])
def test_off_loopback_a_request_needs_the_key(server_host, headers, status, says):
    got, body = _call(KeyCheck(_ok, "s3cret"), "/v1/completions", server_host, headers)
    assert got == status and says in body


def test_the_probes_need_no_key_and_no_key_set_asks_none():
    for path in ("/live", "/health", "/ping"):
        assert _call(KeyCheck(_ok, "s3cret"), path, "10.0.0.5")[0] == 200
    assert _call(KeyCheck(_ok, None), "/v1/completions", "10.0.0.5")[0] == 200


def test_loopback_addresses():
    assert is_loopback("127.0.0.1") and is_loopback("127.3.2.1") and is_loopback("::1") and is_loopback("localhost")
    assert not any(is_loopback(h) for h in ("10.0.0.5", "0.0.0.0", "node", "example.com", None))


def test_disagg_ctl_reads_the_version_header_the_engines_write():
    from disagg.control import ctl
    from disagg.rollout import types

    assert ctl.VERSION_MAX_HEADER == types.VERSION_MAX_HEADER


def test_an_endpoint_off_loopback_without_a_key_is_a_config_error_naming_the_host():
    from disagg.rollout.openai_server import ServerAccess

    for host in ("node", "10.0.0.5", "0.0.0.0"):
        with pytest.raises(ConfigError, match=f"rollout.api_host='{host}': .* no key to ask them for"):
            ServerAccess(host, 0, None).check()
        ServerAccess(host, 0, "k").check()
    ServerAccess("127.0.0.1", 0, None).check()
