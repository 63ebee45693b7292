"""The Ops service and the control plane's security over real gRPC on loopback.

The coordinator state here is the real one the driver uses; the test plays the
driver's side by calling it directly (publishing metrics, honouring a checkpoint
request). The same calls against a live `disagg train` run are in test_cli.py.
"""

from __future__ import annotations

import datetime
import os
import ssl
import stat
import threading
import time
import urllib.request

import grpc
import pytest

from disagg.control import ctl
from disagg.control.auth import TOKEN_FILE, read_token, write_token
from disagg.control.client import ControlRpcError, CoordinatorClient
from disagg.control.convert import pb, pb_grpc
from disagg.control.server import CoordinatorServer
from disagg.errors import ControlError


@pytest.fixture
def secured(tmp_path):
    token, path = write_token(tmp_path)
    srv = CoordinatorServer(port=0, max_staleness=1, run_dir=str(tmp_path), token=token).start()
    srv.state.set_phase("running")
    yield srv, token, path
    srv.stop(grace_s=0.5)


def _until(cond, what: str, timeout_s: float = 60.0) -> None:
    """Wait for ``cond()`` (another thread's progress), at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f} s waiting for {what}"
        time.sleep(0.01)


def test_token_file_is_owner_only_and_fresh(tmp_path):
    token, path = write_token(tmp_path)
    assert path == tmp_path / TOKEN_FILE
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert read_token(path) == token and len(token) >= 32
    token2, _ = write_token(tmp_path)
    assert token2 != token and read_token(path) == token2
    os.chmod(path, 0o644)
    with pytest.raises(ControlError, match="mode 644.*chmod 600"):
        read_token(path)
    with pytest.raises(ControlError, match="cannot read"):
        read_token(tmp_path / "missing")


def test_every_call_needs_the_token(secured):
    srv, token, _ = secured
    for bad in (None, "not-the-token"):
        with CoordinatorClient(srv.address, timeout_s=5, token=bad) as c:
            for call in (c.get_status, c.status, lambda: c.set_max_staleness(3), lambda: c.pause_rollout(),
                         lambda: c.scale_rollout(2), lambda: list(c.watch_metrics(1))):
                with pytest.raises(ControlRpcError) as e:
                    call()
                assert e.value.code == "UNAUTHENTICATED"
                assert ("no control token" if bad is None else "wrong control token") in e.value.details
    assert srv.state.max_staleness() == 1 and not srv.state.rollout_paused()  # nothing got through
    # Raw gRPC with the token as metadata: what a user's own tooling does.
    with grpc.insecure_channel(srv.address) as ch:
        reply = pb_grpc.OpsStub(ch).SetMaxStaleness(pb.MaxStaleness(value=2), timeout=5,
                                                    metadata=(("authorization", f"Bearer {token}"),))
    assert reply.value == 2 and srv.state.max_staleness() == 2


def test_ops_calls_and_their_status_codes(secured):
    srv, token, _ = secured
    state = srv.state
    with CoordinatorClient(srv.address, timeout_s=5, token=token) as c:
        st = c.status()
        assert st.phase == "running" and not st.rollout_paused and st.max_staleness == 1

        with pytest.raises(ControlRpcError) as e:
            c.set_max_staleness(-1)
        assert e.value.code == "INVALID_ARGUMENT" and "-1" in e.value.details
        with pytest.raises(ControlRpcError) as e:
            c.resume_rollout()
        assert e.value.code == "FAILED_PRECONDITION" and "not paused" in e.value.details

        assert "paused" in c.pause_rollout("maintenance")
        assert state.rollout_paused() and c.status().phase == "paused"
        with pytest.raises(ControlRpcError) as e:
            c.pause_rollout()
        assert e.value.code == "FAILED_PRECONDITION" and "already paused" in e.value.details
        assert c.resume_rollout() == "rollout resumed" and not state.rollout_paused()

        # ScaleRollout: the driver's check decides what the cluster can hold.
        with pytest.raises(ControlRpcError) as e:
            c.scale_rollout(2)
        assert e.value.code == "FAILED_PRECONDITION" and "no training pipeline" in e.value.details
        state.set_run_stats(target_engines=1)
        state.set_scale_check(lambda n: f"room for 2 more engine(s), {n} engines need {n - 1} more" if n > 3 else None)
        with pytest.raises(ControlRpcError) as e:
            c.scale_rollout(0)
        assert e.value.code == "INVALID_ARGUMENT" and "got 0" in e.value.details
        with pytest.raises(ControlRpcError) as e:
            c.scale_rollout(5)
        assert e.value.code == "FAILED_PRECONDITION" and "5 engines need 4 more" in e.value.details
        assert state.scale_target() is None
        assert "from 1 to 3 engines" in c.scale_rollout(3, "more rollout")
        assert state.scale_target() == 3 and c.status().target_engines == 3

        with pytest.raises(ControlRpcError) as e:
            list(c.watch_metrics(from_step=-3))
        assert e.value.code == "INVALID_ARGUMENT" and "from_step" in e.value.details

        # Checkpoint blocks until the driver writes one after its step.
        def driver():
            deadline = time.monotonic() + 60
            while not state.checkpoint_wanted() and time.monotonic() < deadline:
                time.sleep(0.01)
            state.checkpoint_written(7, 8, "/runs/x/checkpoints/step_000007")

        t = threading.Thread(target=driver)
        t.start()
        assert c.checkpoint(timeout_s=60) == (7, 8, "/runs/x/checkpoints/step_000007")
        t.join()
        with pytest.raises(ControlRpcError) as e:  # nobody writes one: the deadline, named
            c.checkpoint(timeout_s=1.5)
        assert e.value.code in ("DEADLINE_EXCEEDED",)

        assert "stopping" in c.stop("end of test")
        assert state.stop_requested() == "end of test" and c.status().phase == "stopping"
        for call in (c.stop, c.pause_rollout, lambda: c.checkpoint(timeout_s=2), lambda: c.scale_rollout(2)):
            with pytest.raises(ControlRpcError) as e:
                call()
            assert e.value.code == "FAILED_PRECONDITION" and "stopping" in e.value.details


def test_watch_replays_then_streams_and_ends_with_the_run(secured):
    srv, token, _ = secured
    state = srv.state
    state.publish_metrics(1, {"reward/mean": 0.25, "policy_version": 2, "note": "not a number"})
    state.publish_metrics(2, {"reward/mean": 0.5, "policy_version": 3})
    got = []

    def watch():
        with CoordinatorClient(srv.address, timeout_s=5, token=token) as c:
            for step_values in c.watch_metrics(from_step=2):
                got.append(step_values)

    t = threading.Thread(target=watch)
    t.start()
    _until(lambda: len(got) == 1, "the replay of step 2")  # the stream is open: step 3 can only come streamed
    state.publish_metrics(3, {"reward/mean": 0.75, "policy_version": 4})
    _until(lambda: len(got) == 2, "step 3 on the open stream")
    state.set_phase("stopped")
    t.join(timeout=10)
    assert not t.is_alive(), "the metrics stream did not end with the run"
    assert [s for s, _ in got] == [2, 3]
    assert got[1][1] == {"reward/mean": 0.75, "policy_version": 4.0}


def test_waiting_calls_are_capped_so_engines_always_find_a_server_thread(secured):
    srv, token, _ = secured
    srv.state.max_blocking_calls = 1
    first: list = []
    with CoordinatorClient(srv.address, timeout_s=5, token=token) as c1, \
            CoordinatorClient(srv.address, timeout_s=5, token=token) as c2:
        t = threading.Thread(target=lambda: first.extend(c1.watch_metrics(from_step=1)), daemon=True)
        t.start()
        _until(lambda: srv.state._blocking == 1, "the first stream to hold its thread")
        with pytest.raises(ControlRpcError) as e:
            list(c2.watch_metrics(from_step=1))
        assert e.value.code == "RESOURCE_EXHAUSTED" and "close one" in e.value.details
        with pytest.raises(ControlRpcError) as e:
            c2.checkpoint(timeout_s=5)
        assert e.value.code == "RESOURCE_EXHAUSTED"
        assert c2.get_status().run_dir  # ordinary calls still served
        srv.state.publish_metrics(1, {"reward/mean": 1.0})
        srv.state.set_phase("stopped")
        t.join(timeout=10)
    assert [s for s, _ in first] == [1]
    assert srv.state._blocking == 0  # released when the stream ended


def test_ctl_subcommands_with_run_dir(secured, capsys):
    srv, token, path = secured
    run_dir = path.parent
    (run_dir / "coordinator.addr").write_text(srv.address + "\n")
    assert ctl.main(["pause", "--run-dir", str(run_dir), "--reason", "ctl test"]) == 0
    assert srv.state.rollout_paused()
    assert ctl.main(["status", "--run-dir", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "paused" in out and "in flight" in out
    assert ctl.main(["resume", "--run-dir", str(run_dir), "--json"]) == 0
    assert '"rollout resumed"' in capsys.readouterr().out
    assert ctl.main(["resume", "--run-dir", str(run_dir)]) == 1
    assert "FAILED_PRECONDITION" in capsys.readouterr().err
    srv.state.set_run_stats(target_engines=1)
    srv.state.set_scale_check(lambda n: None)
    assert ctl.main(["scale", "2", "--run-dir", str(run_dir)]) == 0
    assert "from 1 to 2 engines" in capsys.readouterr().out and srv.state.scale_target() == 2
    assert ctl.main(["status", "--run-dir", str(run_dir)]) == 0
    assert "scaling to 2 engines" in capsys.readouterr().out
    # The address alone is not enough.
    assert ctl.main(["status", "--address", srv.address]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err


def _self_signed(tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    import ipaddress

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


def test_tls_with_token(tmp_path):
    cert, key = _self_signed(tmp_path)
    token, _ = write_token(tmp_path)
    srv = CoordinatorServer(port=0, run_dir=str(tmp_path), token=token, tls_cert=cert, tls_key=key,
                            metrics_port=0).start()
    try:
        with CoordinatorClient(srv.address, timeout_s=5, token=token, tls_ca=cert) as c:
            status = c.status()
            assert status.run_dir == str(tmp_path)
        # /metrics speaks TLS with the same certificate.
        url = status.metrics_url
        assert url.startswith("https://127.0.0.1:")
        context = ssl.create_default_context(cafile=cert)
        with urllib.request.urlopen(url, timeout=5, context=context) as r:
            assert f'disagg_run_info{{run_dir="{tmp_path}"}} 1.0' in r.read().decode()
        with pytest.raises(OSError):  # plain HTTP: refused (the connection is reset)
            urllib.request.urlopen(url.replace("https", "http"), timeout=5)
        with CoordinatorClient(srv.address, timeout_s=3, token=token) as plain:  # no TLS: no connection
            with pytest.raises(ControlRpcError) as e:
                plain.status()
            assert e.value.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED")
        with CoordinatorClient(srv.address, timeout_s=5, tls_ca=cert) as no_token:
            with pytest.raises(ControlRpcError) as e:
                no_token.status()
            assert e.value.code == "UNAUTHENTICATED"
    finally:
        srv.stop(grace_s=0.5)
    with pytest.raises(ControlError, match="tls_key"):
        CoordinatorServer(port=0, tls_cert=cert)
