"""Protobuf <-> dataclass conversion of the control plane, through real serialized bytes."""

import json
import re

import pytest

from disagg.control import convert
from disagg.control.convert import pb
from disagg.control.types import ClusterStatus, EngineInfo, EngineState, EngineStatus, Event, LastSync, PoolStatus
from disagg.transport.manifest import TensorSpec, plan_buckets


def _wire(msg):
    """Serialize and parse, as gRPC does."""
    return type(msg).FromString(msg.SerializeToString())


def _manifest(bucket_bytes: int = 64, policy_version: int = 7, first_bucket_bytes: int = 0):
    specs = [
        TensorSpec("embed.weight", (10, 4), "float32"),  # 160 bytes: split over 3 buckets of 64
        TensorSpec("ln.weight", (4,), "bfloat16"),
        TensorSpec("head.bias", (3,), "float32"),
        TensorSpec("scale", (), "float32"),  # a scalar: empty shape
    ]
    return plan_buckets(specs, bucket_bytes, policy_version, first_bucket_bytes)


@pytest.mark.parametrize("first_bucket_bytes", [0, 16])
def test_manifest_round_trip_keeps_split_tensors_and_digest(first_bucket_bytes):
    m = _manifest(first_bucket_bytes=first_bucket_bytes)
    split = [e for b in m.buckets for e in b.entries if e.name == "embed.weight"]
    assert len(split) >= 3 and sum(e.numel for e in split) == 40  # the case under test is really split

    back = convert.manifest_from_proto(_wire(convert.manifest_to_proto(m)))

    assert back == m
    assert back.layout_digest() == m.layout_digest()
    assert back.spec("scale").shape == ()
    assert back.policy_version == 7 and back.total_bytes == m.total_bytes > 0
    assert back.first_bucket_bytes == first_bucket_bytes  # a receiver re-plans shards with it


def test_manifest_conversion_is_not_lossy_on_large_offsets():
    m = plan_buckets([TensorSpec("big", (3, 1 << 31), "int8")], 1 << 32, 1)
    assert convert.manifest_from_proto(_wire(convert.manifest_to_proto(m))) == m


@pytest.mark.parametrize("state", list(EngineState))
def test_engine_state_round_trip(state):
    value = convert.engine_state_to_proto(state)
    assert pb.EngineState.Name(value) == f"ENGINE_STATE_{state.value}"
    assert convert.engine_state_from_proto(value) is state


def test_unset_engine_state_is_rejected():
    with pytest.raises(ValueError, match="UNSPECIFIED"):
        convert.engine_state_from_proto(pb.ENGINE_STATE_UNSPECIFIED)
    with pytest.raises(ValueError, match="UNSPECIFIED"):
        convert.engine_info_from_proto(pb.EngineInfo(engine_id=1))


def test_engine_info_round_trip():
    info = EngineInfo(3, "10.0.0.3", 4242, "10.0.0.3:8000", EngineState.WAITING_FOR_WEIGHTS)
    assert convert.engine_info_from_proto(_wire(convert.engine_info_to_proto(info))) == info


def _status() -> ClusterStatus:
    return ClusterStatus(
        pools=(
            PoolStatus("rollout", 2, "CPU:1", "pg-r", 2, 1700000000.5),
            PoolStatus("trainer", 1, "GPU:1,CPU:4", "pg-t", 1, 1700000001.25),
        ),
        engines=(
            EngineStatus(0, EngineState.READY, "10.0.0.1", 11, "10.0.0.1:8000", 5, 1700000002.5, ""),
            EngineStatus(1, EngineState.DEAD, "10.0.0.2", 12, "", 4, 1700000003.5, "OOM while loading"),
        ),
        latest_version=6,
        committed_version=5,
        max_staleness=2,
        trainer_step=12,
        run_dir="/runs/x",
        started_unix_s=1699999999.0,
        buffer_groups=3,
        inflight_groups=5,
        training_groups=4,
        events=(Event(1700000003.0, "engine_dead", "engine 1: stuck: no answer to a health check for 60 s"),
                Event(1700000003.25, "engine_replaced", "engine 2 starts in place of engine 1")),
        last_sync=LastSync(12, 3_000_000, 41_000, True, 0.0123, 0.25),
    )


def test_status_round_trip_through_proto():
    s = _status()
    assert convert.status_from_proto(_wire(convert.status_to_proto(s))) == s


def test_status_json_round_trip():
    s = _status()
    d = json.loads(json.dumps(s.to_dict()))
    assert d["engines"][1]["state"] == "DEAD"
    assert [e["kind"] for e in d["events"]] == ["engine_dead", "engine_replaced"]
    assert ClusterStatus.from_dict(d) == s
    assert s.engine(1).message == "OOM while loading"
    with pytest.raises(KeyError, match="engine 9"):
        s.engine(9)


def test_generate_writes_flat_stubs_with_package_imports(tmp_path):
    pytest.importorskip("grpc_tools")
    from disagg.control import gen

    files = gen.generate(gen.DEFAULT_PROTO_ROOT, tmp_path / "_proto")
    names = sorted(f.name for f in files)
    assert names == ["__init__.py", "coordinator_pb2.py", "coordinator_pb2.pyi", "coordinator_pb2_grpc.py"]
    grpc_src = (tmp_path / "_proto" / "coordinator_pb2_grpc.py").read_text()
    assert "from . import coordinator_pb2" in grpc_src
    assert not re.search(r"^from disagg\.v1", grpc_src, flags=re.M)
    pb2_src = (tmp_path / "_proto" / "coordinator_pb2.py").read_text()
    assert "'disagg.control._proto.coordinator_pb2'" in pb2_src


def test_a_source_tree_without_stubs_generates_them_on_import(tmp_path):
    """What `ray job submit --working-dir .` uploads has no stubs (.gitignore): importing makes them."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    shutil.copytree(repo / "disagg", tmp_path / "disagg", ignore=shutil.ignore_patterns("_proto", "__pycache__"))
    shutil.copytree(repo / "protos", tmp_path / "protos")
    code = ("import disagg, disagg.control.convert as c; "
            "print(disagg.__file__); print(c.pb.__file__); print(c.pb.Status(target_engines=3).target_engines)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={"PYTHONPATH": str(tmp_path)},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    pkg, stub, value = out.stdout.split()
    assert pkg.startswith(str(tmp_path)) and stub == str(tmp_path / "disagg/control/_proto/coordinator_pb2.py")
    assert value == "3"


def test_the_last_sync_comes_from_the_latest_step_that_synced_and_ctl_status_shows_its_mode():
    from disagg.control.ctl import _last_sync
    from disagg.control.state import CoordinatorState

    state = CoordinatorState(max_staleness=1)
    assert state.status().last_sync is None
    delta = {"weight_sync/bytes": 3e6, "weight_sync/bytes_on_wire": 41e3, "weight_sync/delta": 1,
             "weight_sync/changed_fraction": 0.0123, "timing/weight_sync_s": 0.25, "weight_sync/skipped": 0}
    state.publish_metrics(7, {"weight_sync/bytes": 3e6, "weight_sync/delta": 0, "timing/weight_sync_s": 0.5})
    assert state.status().last_sync == LastSync(7, 3_000_000, 3_000_000, False, -1.0, 0.5)
    state.publish_metrics(8, delta)
    state.publish_metrics(9, {**delta, "weight_sync/skipped": 1, "weight_sync/bytes": 0})  # no sync at step 9
    last = state.status().last_sync
    assert last == LastSync(8, 3_000_000, 41_000, True, 0.0123, 0.25)
    assert _last_sync(last) == "step 8: delta (1.23% of the elements changed), 0.041 of 3 MB on the wire, 0.250 s"
    assert _last_sync(LastSync(7, 3_000_000, 3_000_000, False, -1.0, 0.5)).startswith("step 7: dense, 3 of 3 MB")

