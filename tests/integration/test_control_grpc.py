"""The coordinator over real gRPC on loopback: registration, versions, acks, commit, ctl."""

import json
import pickle
import re
import socket
import time

import pytest

from disagg.control import ctl
from disagg.control.client import ControlRpcError, CoordinatorClient
from disagg.control.server import CoordinatorServer
from disagg.control.types import EngineInfo, EngineState, PoolStatus
from disagg.errors import ControlError
from disagg.transport.manifest import TensorSpec, plan_buckets

SPECS = [
    TensorSpec("embed.weight", (16, 8), "bfloat16"),
    TensorSpec("layers.0.mlp.weight", (8, 32), "bfloat16"),
    TensorSpec("lm_head.bias", (16,), "float32"),
]


def manifest(policy_version: int, bucket_bytes: int = 200):
    return plan_buckets(SPECS, bucket_bytes, policy_version)


@pytest.fixture
def server(tmp_path):
    srv = CoordinatorServer(port=0, max_staleness=1, run_dir=str(tmp_path)).start()
    yield srv
    srv.stop(grace_s=0.5)


@pytest.fixture
def client(server):
    with CoordinatorClient(server.address, timeout_s=5.0) as c:
        c.wait_ready(timeout_s=5.0)
        yield c


def register_cluster(client, num_engines=3):
    client.register_pool(PoolStatus("trainer", 1, "CPU:1", "pg-trainer", 1))
    client.register_pool(PoolStatus("rollout", num_engines, "CPU:1", "pg-rollout", num_engines))
    for i in range(num_engines):
        client.register_engine(EngineInfo(i, "127.0.0.1", 1000 + i, f"127.0.0.1:{8000 + i}", EngineState.STARTING))
        client.update_engine_state(i, EngineState.READY, "loaded")


def test_address_is_the_bound_port(server):
    host, port = server.address.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0


def test_registration_shows_in_status(client, server, tmp_path):
    register_cluster(client)
    client.update_engine_state(2, EngineState.SYNCING, "receiving v1")
    status = client.get_status()
    assert [p.name for p in status.pools] == ["rollout", "trainer"]
    assert status.pools[0].num_bundles == 3 and status.pools[0].registered_unix_s > 0
    assert [e.engine_id for e in status.engines] == [0, 1, 2]
    assert status.engine(2).state is EngineState.SYNCING and status.engine(2).message == "receiving v1"
    assert status.engine(1).address == "127.0.0.1:8001" and status.engine(1).pid == 1001
    assert status.run_dir == str(tmp_path) and status.max_staleness == 1
    assert status == server.state.status()


def test_bad_pool_name_and_unknown_engine_are_rejected(client):
    with pytest.raises(ControlRpcError, match="INVALID_ARGUMENT.*pool name") as e:
        client.register_pool(PoolStatus("critic", 1, "CPU:1", "pg", 1))
    assert e.value.rpc == "RegisterPool"
    with pytest.raises(ControlRpcError, match="NOT_FOUND.*engine 7 is not registered"):
        client.update_engine_state(7, EngineState.READY)


def test_announce_and_get_manifest(client, server):
    m = manifest(1, bucket_bytes=100)  # small buckets: embed.weight is split
    assert any(len([e for e in b.entries if e.name == "embed.weight"]) for b in m.buckets[1:])
    client.announce_version(m, trainer_step=4)
    assert client.get_manifest(1) == m
    status = client.get_status()
    assert status.latest_version == 1 and status.trainer_step == 4
    with pytest.raises(ControlRpcError, match="NOT_FOUND") as e:
        client.get_manifest(2)
    assert e.value.code == "NOT_FOUND" and server.address in str(e.value)
    with pytest.raises(ControlRpcError, match="FAILED_PRECONDITION.*go back"):
        client.announce_version(manifest(0), trainer_step=5)


def test_manifest_store_is_bounded(client):
    for v in range(1, 8):
        client.announce_version(manifest(v), trainer_step=v)
    assert client.get_manifest(7).policy_version == 7
    assert client.get_manifest(4).policy_version == 4
    with pytest.raises(ControlRpcError, match="NOT_FOUND.*older than every kept"):
        client.get_manifest(3)


def test_ack_checks_version_and_digest(client):
    register_cluster(client, num_engines=1)
    m = manifest(1)
    client.announce_version(m, trainer_step=1)
    with pytest.raises(ControlRpcError, match="FAILED_PRECONDITION.*never announced"):
        client.ack_version(0, 2, m.layout_digest())
    other = plan_buckets(SPECS, 64, 1)  # same tensors, different bucket layout
    assert other.layout_digest() != m.layout_digest()
    with pytest.raises(ControlRpcError, match="FAILED_PRECONDITION.*layout digest"):
        client.ack_version(0, 1, other.layout_digest())
    assert client.get_status().engine(0).policy_version == 0
    assert client.ack_version(0, 1, m.layout_digest()) == 1
    assert client.get_status().engine(0).policy_version == 1


def test_committed_version_waits_for_every_live_engine(client, server):
    register_cluster(client, num_engines=3)
    digests = {}
    for v in (1, 2):
        m = manifest(v)
        client.announce_version(m, trainer_step=v)
        digests[v] = m.layout_digest()

    assert client.ack_version(0, 1, digests[1]) == 0
    assert client.ack_version(1, 1, digests[1]) == 0
    assert client.ack_version(2, 1, digests[1]) == 1
    assert client.ack_version(0, 2, digests[2]) == 1
    assert client.ack_version(1, 2, digests[2]) == 1  # engine 2 still serves 1
    assert server.state.committed_version() == 1

    client.update_engine_state(2, EngineState.DEAD, "node lost")
    assert client.get_status().committed_version == 2  # the dead engine no longer holds it back
    assert server.state.committed_version() == 2

    client.register_engine(EngineInfo(3, "127.0.0.1", 1003, "", EngineState.STARTING))
    assert client.get_status().committed_version == 0  # a live engine that acked nothing
    client.update_engine_state(3, EngineState.DRAINING)
    assert client.get_status().committed_version == 2


def test_driver_accessors_are_seen_over_grpc(client, server):
    server.state.set_trainer_step(42)
    assert client.get_status().trainer_step == 42
    assert client.set_max_staleness(3) == 3
    assert server.state.max_staleness() == 3


def test_negative_staleness_is_invalid_argument(client):
    with pytest.raises(ControlError, match="INVALID_ARGUMENT.*max_staleness must be >= 0") as e:
        client.set_max_staleness(-1)
    assert "SetMaxStaleness" in str(e.value)
    assert client.get_status().max_staleness == 1


def test_client_pickles_without_its_channel(client):
    client.get_status()  # the channel exists now
    copy = pickle.loads(pickle.dumps(client))
    assert copy.address == client.address and copy.timeout_s == client.timeout_s
    assert copy.get_status().max_staleness == 1
    copy.close()


def test_ctl_status_json(client, server, capsys):
    register_cluster(client, num_engines=2)
    m = manifest(1)
    client.announce_version(m, trainer_step=3)
    client.ack_version(0, 1, m.layout_digest())
    client.ack_version(1, 1, m.layout_digest())
    capsys.readouterr()

    assert ctl.main(["status", "--address", server.address, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["committed_version"] == 1 and d["latest_version"] == 1 and d["trainer_step"] == 3
    assert [(e["engine_id"], e["state"], e["policy_version"]) for e in d["engines"]] == [(0, "READY", 1), (1, "READY", 1)]
    assert {p["name"] for p in d["pools"]} == {"trainer", "rollout"}


def test_ctl_status_table_and_set_staleness(client, server, capsys, monkeypatch):
    register_cluster(client, num_engines=2)
    client.register_engine(EngineInfo(17, "127.0.0.9", 4321, "", EngineState.STARTING))
    client.update_engine_state(17, EngineState.DEAD, "segfault")
    m = manifest(5)
    client.announce_version(m, trainer_step=9)
    for i in (0, 1):
        client.ack_version(i, 5, m.layout_digest())
    capsys.readouterr()

    monkeypatch.setenv("DISAGG_COORDINATOR", server.address)
    assert ctl.main(["status"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"committed version\s+5", out) and re.search(r"max staleness\s+1", out)
    assert "engines" in out and "pools" in out
    rows = {int(r.split()[1]): r for r in out.splitlines() if re.match(r"^\W+\d+\s+\W+\s*[A-Z_]+", r)}
    assert set(rows) == {0, 1, 17}
    assert "DEAD" in rows[17] and "segfault" in rows[17] and "READY" in rows[0]

    assert ctl.main(["set-staleness", "4"]) == 0
    assert "4" in capsys.readouterr().out and server.state.max_staleness() == 4
    assert ctl.main(["set-staleness", "-2"]) == 1
    assert "INVALID_ARGUMENT" in capsys.readouterr().err


def test_ctl_without_address_fails_clearly(capsys, monkeypatch):
    monkeypatch.delenv("DISAGG_COORDINATOR", raising=False)
    monkeypatch.delenv("DISAGG_RUN_DIR", raising=False)
    assert ctl.main(["status"]) == 2
    assert "--address" in capsys.readouterr().err


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_call_to_closed_port_fails_within_timeout():
    address = f"127.0.0.1:{_closed_port()}"
    client = CoordinatorClient(address, timeout_s=2.0)
    start = time.monotonic()
    with pytest.raises(ControlError, match=f"GetStatus to {address} failed: (UNAVAILABLE|DEADLINE_EXCEEDED)"):
        client.get_status()
    assert time.monotonic() - start < 3.0
    start = time.monotonic()
    with pytest.raises(ControlError, match="not ready after 1.0s"):
        client.wait_ready(timeout_s=1.0)
    assert time.monotonic() - start < 2.5
    client.close()


def test_engines_outside_the_transport_group_do_not_hold_the_commit(client, server):
    register_cluster(client, num_engines=2)
    m = manifest(1)
    client.announce_version(m, trainer_step=1)
    server.state.set_transport_members([0, 1])
    client.ack_version(0, 1, m.layout_digest())
    assert client.ack_version(1, 1, m.layout_digest()) == 1
    # A scale-up engine registers while it starts: not a member yet, it holds nothing back...
    client.register_engine(EngineInfo(2, "127.0.0.1", 1002, "", EngineState.WAITING_FOR_WEIGHTS))
    assert client.get_status().committed_version == 1
    # ...until it joins the group: then the commit waits for its acknowledgement.
    server.state.set_transport_members([0, 1, 2])
    assert client.get_status().committed_version == 0
    assert client.ack_version(2, 1, m.layout_digest()) == 1
