"""Who can reach an engine: its OpenAI endpoint bound to this machine's own address (as
`rollout.api_host=node` binds it on a cluster), over HTTPS with a certificate of our own (real Ray,
vLLM, uvicorn; real HTTP requests). Off loopback every route asks the job's control token - no key
or a wrong one gets 401, the probes excepted - and the right key reaches what the weights gate then
decides; over loopback, at the same port, no key is asked. The agent client sends the key."""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import ssl
import urllib.parse

import pytest

from tests.conftest import small_config

OPEN = {"/live", "/health", "/ping"}  # the probes: answered without a key everywhere


def _self_signed(tmp_path, ip: str) -> tuple[str, str]:
    """A certificate for this machine's address and loopback, and its key (PEM files)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "disagg-engine")])
    now = datetime.datetime.now(datetime.timezone.utc)
    sans = [x509.IPAddress(ipaddress.ip_address(a)) for a in {ip, "127.0.0.1"}]
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False).sign(key, hashes.SHA256()))
    cert_path, key_path = tmp_path / "engine.pem", tmp_path / "engine.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


@pytest.fixture(scope="module")
def keyed(ray_session, model_cache, tmp_path_factory):
    """A job whose engine binds this machine's address over HTTPS, after its first sync:
    (job, the engine's address, its routes, the certificate)."""
    import ray

    from disagg.job import Job
    from disagg.model.warmstart import prepare_model

    ip = ray.util.get_node_ip_address()
    assert ip != "127.0.0.1", "this test needs the machine's own, non-loopback address"
    tmp = tmp_path_factory.mktemp("keys")
    cert, key = _self_signed(tmp, ip)
    cfg = small_config(model_cache, rollout={"max_model_len": 64, "max_tokens": 4, "api_host": "node",
                                             "api_tls_cert": cert, "api_tls_key": key})
    job = Job.start(cfg, tmp / "run", prepare_model(cfg))
    try:
        job.sync_weights(1, trainer_step=0)
        engine = job.rollout.engines[0]
        address = ray.get(engine.get_address.remote(), timeout=60)
        routes = ray.get(engine.get_http_routes.remote(), timeout=60)
        yield job, address, routes, cert
    finally:
        job.shutdown()


def _request(cert: str, host: str, port: int, method: str, path: str, key: str | None) -> tuple[int, str]:
    conn = http.client.HTTPSConnection(host, port, timeout=120, context=ssl.create_default_context(cafile=cert))
    try:
        body = None
        headers = {"content-type": "application/json"}
        if key is not None:
            headers["authorization"] = f"Bearer {key}"
        if method in ("POST", "PUT", "PATCH"):
            body = json.dumps({"model": "policy", "prompt": "1+1=", "max_tokens": 2, "temperature": 0,
                               "messages": [{"role": "user", "content": "1+1="}]}).encode()
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read().decode(errors="replace")[:300]
    finally:
        conn.close()


def _http_probes(routes: list[dict]) -> list[tuple[str, str]]:
    out = []
    for r in routes:
        path = re.sub(r"\{[^}]*\}", "x", r["path"]) + ("/" if r["kind"] == "Mount" else "")
        out += [(m, path) for m in r["methods"] if m != "WEBSOCKET"]
    return out


def test_off_loopback_every_route_asks_the_key_and_the_probes_do_not(keyed):
    job, address, routes, cert = keyed
    url = urllib.parse.urlparse(address)
    assert url.scheme == "https" and url.hostname == job.rollout.start_info[0]["node_ip"] != "127.0.0.1"
    probes = _http_probes(routes)
    assert ("POST", "/v1/chat/completions") in probes and ("POST", "/v1/completions") in probes
    wrong = []
    for method, path in probes:
        for key in (None, "not-the-key"):
            status, body = _request(cert, url.hostname, url.port, method, path, key)
            if path in OPEN:
                if status == 401:
                    wrong.append(f"{method} {path} is a probe but asked a key: {body}")
            elif status != 401 or ("wrong key" if key else "no key") not in body:
                wrong.append(f"{method} {path} with key {key!r}: {status} {body}")
    assert not wrong, "\n".join(wrong)


def test_the_right_key_off_loopback_and_no_key_over_loopback_reach_the_model(keyed):
    job, address, routes, cert = keyed
    url = urllib.parse.urlparse(address)
    assert job.api_key == job.token  # rollout.api_key=null: the control token
    token = (job.run_dir / "control.token").read_text().strip()
    for host, key in ((url.hostname, token), ("127.0.0.1", None)):
        for path in ("/v1/completions", "/v1/chat/completions"):
            status, body = _request(cert, host, url.port, "POST", path, key)
            assert status == 200, f"{host} {path}: {status} {body}"
            assert '"choices":[{"index":0' in body, body


def test_the_agent_client_sends_the_key_and_checks_the_certificate(keyed, tok):
    from disagg.agent.client import EngineAuth, RoutedCompletions
    from disagg.rollout.types import SamplingSpec

    job, address, _, cert = keyed
    ids = tok("1+1=")["input_ids"]

    async def once(auth):
        client = RoutedCompletions({0: address}, "policy", auth=auth)
        try:
            return await client.complete("s", ids, 3, SamplingSpec(max_tokens=3, greedy=True), [])
        finally:
            await client.close()

    out = asyncio.run(once(EngineAuth(job.api_key, cert)))
    assert out.token_ids and len(out.logprobs) == len(out.token_ids) and out.version_min == 1
    import openai

    with pytest.raises(openai.AuthenticationError):
        asyncio.run(once(EngineAuth(None, cert)))
    with pytest.raises(openai.APIConnectionError):  # a certificate it was not told to trust
        asyncio.run(once(EngineAuth(job.api_key, None)))


@pytest.fixture(scope="module")
def tok(keyed):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(keyed[0].model_path))


def test_disagg_ctl_complete_sends_the_key_and_names_what_fails(keyed, capsys, monkeypatch):
    from disagg.control.ctl import main as ctl

    job, _, _, cert = keyed
    base = ["complete", "1+1=", "--run-dir", str(job.run_dir), "--max-tokens", "3", "--json"]
    assert ctl([*base, "--api-ca", cert]) == 0
    reply = json.loads(capsys.readouterr().out)
    assert reply["engine_id"] == 0 and reply["policy_version"] == 1 and isinstance(reply["text"], str)

    monkeypatch.setenv("NOT_THE_KEY", "nope")
    assert ctl([*base, "--api-ca", cert, "--api-key-env", "NOT_THE_KEY"]) == 1
    err = capsys.readouterr().err
    assert "401" in err and "wrong key" in err, err
    assert ctl(base) == 1  # the engine's certificate is not one the system trusts
    assert "CERTIFICATE_VERIFY_FAILED" in capsys.readouterr().err
