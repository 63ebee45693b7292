"""Protobuf <-> plain dataclasses, in one place.

The server and the client convert at the wire and nowhere else, so the rest of
disagg handles ``Manifest``, ``ClusterStatus`` and friends, never generated
message classes. The stubs are imported here (as ``pb`` and ``pb_grpc``) so a
missing generation fails with one clear message. No logic lives here beyond
field mapping: validation belongs to the coordinator's state.
"""

from __future__ import annotations

from dataclasses import asdict

from disagg.transport.manifest import BucketEntry, BucketPlan, Manifest, TensorSpec
from disagg.control.types import (RUN_FIELDS, ClusterStatus, EngineInfo, EngineState, EngineStatus, Event, LastSync,
                                  PoolStatus)



def _import_stubs():
    """The generated stubs; generated from ``protos/`` first when a source tree lacks them.

    They are build outputs that ``.gitignore`` keeps out of git - and so out of what
    ``ray job submit --working-dir .`` uploads, whose copy of the package then shadows the
    installed one in the driver and every actor. Generation writes each file atomically, so
    processes that start together may all generate without harm.
    """
    import importlib

    try:
        return (importlib.import_module("disagg.control._proto.coordinator_pb2"),
                importlib.import_module("disagg.control._proto.coordinator_pb2_grpc"))
    except ModuleNotFoundError as e:
        if not (e.name or "").startswith("disagg.control._proto"):
            raise
        missing = e
    from disagg.control import gen

    try:
        gen.generate()
    except (ImportError, FileNotFoundError, RuntimeError) as e:
        raise ImportError(
            "the coordinator's gRPC stubs (disagg/control/_proto) are missing and could not be generated "
            f"({e}): they are made at install time; regenerate them with `python -m disagg.control.gen`"
        ) from missing
    importlib.invalidate_caches()
    return (importlib.import_module("disagg.control._proto.coordinator_pb2"),
            importlib.import_module("disagg.control._proto.coordinator_pb2_grpc"))


pb, pb_grpc = _import_stubs()

__all__ = ["pb", "pb_grpc"]

_STATE_PREFIX = "ENGINE_STATE_"


def engine_state_to_proto(state: EngineState) -> int:
    return pb.EngineState.Value(_STATE_PREFIX + EngineState(state).value)


def engine_state_from_proto(value: int) -> EngineState:
    name = pb.EngineState.Name(value)
    if name == "ENGINE_STATE_UNSPECIFIED":
        raise ValueError("engine state is unset (ENGINE_STATE_UNSPECIFIED)")
    return EngineState(name.removeprefix(_STATE_PREFIX))


def manifest_to_proto(m: Manifest) -> pb.Manifest:
    return pb.Manifest(
        policy_version=m.policy_version,
        bucket_bytes=m.bucket_bytes,
        total_bytes=m.total_bytes,
        first_bucket_bytes=m.first_bucket_bytes,
        tensors=[pb.TensorSpec(name=t.name, shape=list(t.shape), dtype=t.dtype) for t in m.tensors],
        buckets=[
            pb.BucketPlan(
                index=b.index,
                dtype=b.dtype,
                numel=b.numel,
                entries=[
                    pb.BucketEntry(name=e.name, tensor_offset=e.tensor_offset, bucket_offset=e.bucket_offset, numel=e.numel)
                    for e in b.entries
                ],
            )
            for b in m.buckets
        ],
    )


def manifest_from_proto(p: pb.Manifest) -> Manifest:
    return Manifest(
        policy_version=p.policy_version,
        bucket_bytes=p.bucket_bytes,
        total_bytes=p.total_bytes,
        first_bucket_bytes=p.first_bucket_bytes,
        tensors=tuple(TensorSpec(t.name, tuple(t.shape), t.dtype) for t in p.tensors),
        buckets=tuple(
            BucketPlan(
                b.index,
                b.dtype,
                b.numel,
                tuple(BucketEntry(e.name, e.tensor_offset, e.bucket_offset, e.numel) for e in b.entries),
            )
            for b in p.buckets
        ),
    )


def pool_to_proto(p: PoolStatus) -> pb.PoolInfo:
    return pb.PoolInfo(
        name=p.name,
        num_bundles=p.num_bundles,
        bundle_resources=p.bundle_resources,
        placement_group_id=p.placement_group_id,
        num_workers=p.num_workers,
        registered_unix_s=p.registered_unix_s,
    )


def pool_from_proto(p: pb.PoolInfo) -> PoolStatus:
    return PoolStatus(p.name, p.num_bundles, p.bundle_resources, p.placement_group_id, p.num_workers, p.registered_unix_s)


def engine_info_to_proto(e: EngineInfo) -> pb.EngineInfo:
    return pb.EngineInfo(
        engine_id=e.engine_id, node_ip=e.node_ip, pid=e.pid, address=e.address, state=engine_state_to_proto(e.state),
        expected_tensors=[pb.TensorSpec(name=t.name, shape=list(t.shape), dtype=t.dtype) for t in e.expected_tensors],
    )


def engine_info_from_proto(p: pb.EngineInfo) -> EngineInfo:
    return EngineInfo(p.engine_id, p.node_ip, p.pid, p.address, engine_state_from_proto(p.state),
                      tuple(TensorSpec(t.name, tuple(t.shape), t.dtype) for t in p.expected_tensors))


def engine_status_to_proto(e: EngineStatus) -> pb.EngineStatus:
    return pb.EngineStatus(
        engine_id=e.engine_id,
        state=engine_state_to_proto(e.state),
        node_ip=e.node_ip,
        pid=e.pid,
        address=e.address,
        policy_version=e.policy_version,
        last_update_unix_s=e.last_update_unix_s,
        message=e.message,
        inflight_groups=e.inflight_groups,
        tokens_per_s=e.tokens_per_s,
    )


def engine_status_from_proto(p: pb.EngineStatus) -> EngineStatus:
    return EngineStatus(
        engine_id=p.engine_id,
        state=engine_state_from_proto(p.state),
        node_ip=p.node_ip,
        pid=p.pid,
        address=p.address,
        policy_version=p.policy_version,
        last_update_unix_s=p.last_update_unix_s,
        message=p.message,
        inflight_groups=p.inflight_groups,
        tokens_per_s=p.tokens_per_s,
    )


def status_to_proto(s: ClusterStatus) -> pb.Status:
    return pb.Status(
        pools=[pool_to_proto(p) for p in s.pools],
        engines=[engine_status_to_proto(e) for e in s.engines],
        latest_version=s.latest_version,
        committed_version=s.committed_version,
        max_staleness=s.max_staleness,
        trainer_step=s.trainer_step,
        run_dir=s.run_dir,
        started_unix_s=s.started_unix_s,
        **{k: getattr(s, k) for k in RUN_FIELDS},
        events=[pb.Event(unix_s=e.unix_s, kind=e.kind, message=e.message) for e in s.events],
        metrics_url=s.metrics_url,
        last_sync=None if s.last_sync is None else pb.LastSync(**asdict(s.last_sync)),
    )


def status_from_proto(p: pb.Status) -> ClusterStatus:
    return ClusterStatus(
        pools=tuple(pool_from_proto(x) for x in p.pools),
        engines=tuple(engine_status_from_proto(x) for x in p.engines),
        latest_version=p.latest_version,
        committed_version=p.committed_version,
        max_staleness=p.max_staleness,
        trainer_step=p.trainer_step,
        run_dir=p.run_dir,
        started_unix_s=p.started_unix_s,
        **{k: getattr(p, k) for k in RUN_FIELDS},
        events=tuple(Event(e.unix_s, e.kind, e.message) for e in p.events),
        metrics_url=p.metrics_url,
        last_sync=LastSync(p.last_sync.step, p.last_sync.bytes, p.last_sync.bytes_on_wire, p.last_sync.delta,
                           p.last_sync.changed_fraction, p.last_sync.seconds) if p.HasField("last_sync") else None,
    )
