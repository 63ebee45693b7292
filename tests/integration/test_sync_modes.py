"""Model-level weight sync over real gloo groups between spawned processes.

R trainer processes (FSDP2 over a gloo default group when R > 1) send a small
model with mixed dtypes and a tensor larger than a bucket to 2 receiver
processes, in both source modes, pipelined over 2 buffers; receivers must end
bit-identical to the trainer's full weights. Checksum verification must reject
a corrupted bucket and leave the receiver's previous weights in place.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import queue

import pytest
import torch

from tests.conftest import rank_processes

HOST = "127.0.0.1"
BUCKET_BYTES = 2048
TIMEOUT_S = 20.0
START_TIMEOUT_S = 180.0  # for every spawned process to start (each imports torch) and reach its rendezvous


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # 4464 bytes: split over 3 buckets, its parts crossing the 47 | 46 row boundary of 2 shards.
        self.emb = torch.nn.Parameter(torch.zeros(93, 24, dtype=torch.bfloat16))
        self.layers = torch.nn.ModuleList(torch.nn.Linear(24, 24) for _ in range(2))
        self.head = torch.nn.Parameter(torch.zeros(5, 24))  # uneven shards: 3 + 2 rows
        self.tiny = torch.nn.Parameter(torch.zeros(1, 3, dtype=torch.float16))  # rank 1 gets an empty shard


def _fill(net: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=gen).to(p.dtype))


def _digest(net: torch.nn.Module) -> dict[str, list[float]]:
    return {n: p.detach().float().cpu().reshape(-1).tolist() for n, p in net.named_parameters()}


def _device(backend: str, index: int) -> torch.device:
    """nccl: one GPU per process; gloo-cuda: every process on GPU 0 over gloo (``cluster=one_gpu``)."""
    if backend in ("nccl", "gloo-cuda"):
        index = index if backend == "nccl" else 0
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def _wire(backend: str) -> str:
    return "gloo" if backend == "gloo-cuda" else backend


def _trainer(rank: int, world: int, receivers: int, ports: list[int], fsdp_port: int, source: str,
             corrupt: bool, backend: str, out: mp.Queue, started, overlap: bool = False, delta: bool = False,
             first_bucket_bytes: int = 0, high_priority: bool = False) -> None:
    from disagg.transport.group import create_group
    from disagg.transport.model_transfer import model_manifest, send_model, source_groups_needed

    device = _device(backend, rank)
    torch.manual_seed(0)
    net = _Net()
    _fill(net, seed=11)
    net.to(device)
    if world > 1:
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group(backend, init_method=f"tcp://{HOST}:{fsdp_port}", rank=rank, world_size=world)
        for layer in net.layers:
            fully_shard(layer)
        fully_shard(net)
    full = model_manifest(net, BUCKET_BYTES, policy_version=5, first_bucket_bytes=first_bucket_bytes)
    started.wait(timeout=START_TIMEOUT_S)  # everyone is up: the rendezvous timeout times the rendezvous alone
    group = None
    if rank < source_groups_needed(source, world):
        group = create_group(host=HOST, port=ports[rank], rank=0, world_size=1 + receivers, backend=_wire(backend),
                             timeout_s=TIMEOUT_S, group_name=f"s{rank}", device=device, high_priority=high_priority)
    from disagg.transport.sender import WeightSender

    sender = WeightSender(group, 0, num_buffers=2, verify=corrupt, device=device) if group is not None else None
    if sender is not None and corrupt:
        def flip(index: int, packed: torch.Tensor) -> None:  # after the checksum: a wire corruption
            if index == 1:
                packed.view(torch.uint8)[3] ^= 0xFF
        sender._after_pack = flip
    full_weights = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu().reshape(-1).tolist()
                    for n, p in net.named_parameters()}
    if overlap:
        stats = _send_snapshot_while_training(net, group, full, source, rank, world, sender, device)
    elif delta:
        full_weights, stats = _send_two_versions_as_deltas(net, group, full, source, rank, world, sender)
    else:
        stats = send_model(group, net, full, source=source, trainer_rank=rank, num_trainer_ranks=world,
                           num_buffers=2, verify=corrupt, sender=sender)
    staged = sorted({str(b.device) for slot in sender._slots for b in slot.values()}) if sender else []
    out.put({"role": "trainer", "rank": rank, "weights": full_weights, "staged_on": staged,
             "sent": None if stats is None else stats.bytes, "manifest_bytes": full.total_bytes,
             "changed": None if stats is None else stats.changed_fraction,
             "bucket_sizes": [b.nbytes for b in full.buckets],
             "high_priority": [_high_priority(group)] if group is not None else []})
    if group is not None:
        group.barrier()
        group.destroy()


def _send_two_versions_as_deltas(net, group, full, source, rank, world, sender):
    """transport.delta: version 5 (dense: nothing held yet), then every 37th element of every local
    shard moved and version 6 sent as a delta; the full weights of 6 and its send's figures."""
    from disagg.transport.delta import DeltaImage
    from disagg.transport.model_transfer import send_model

    image = DeltaImage(next(net.parameters()).device)
    send_model(group, net, full, source=source, trainer_rank=rank, num_trainer_ranks=world, num_buffers=2,
               sender=sender, image=image)
    with torch.no_grad():
        for p in net.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.view(-1)[::37] += 1.0
    weights = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu().reshape(-1).tolist()
               for n, p in net.named_parameters()}
    stats = send_model(group, net, full.with_version(6), source=source, trainer_rank=rank, num_trainer_ranks=world,
                       num_buffers=2, sender=sender, image=image)
    return weights, stats


def _send_snapshot_while_training(net, group, full, source, rank, world, sender, device):
    """transport.overlap_push as the trainer worker runs it: snapshot the (local) parameters, send the
    snapshot from another thread (its own CUDA stream) while this thread changes every live
    parameter and runs collectives over the trainer ranks, as the next train step would."""
    import threading

    from disagg.trainer.snapshot import Snapshots
    from disagg.transport.model_transfer import send_model, source_manifests

    local = {n: (p.detach().to_local() if hasattr(p, "to_local") else p.detach()) for n, p in net.named_parameters()}
    # laid out as this rank's push sends it (TrainerWorker._push_layout): every bucket a view of it
    wire = (source_manifests(full, world)[rank] if source == "shards" else full).buckets
    snap = Snapshots().take(5, local, None, wire)
    result: dict = {}

    def push() -> None:
        try:
            on_stream = contextlib.nullcontext()
            if device.type == "cuda":
                torch.cuda.set_device(device)
                stream = torch.cuda.Stream(device)
                stream.wait_event(snap.event)
                on_stream = torch.cuda.stream(stream)
            with on_stream:
                result["stats"] = send_model(group, net, full, source=source, trainer_rank=rank,
                                             num_trainer_ranks=world, num_buffers=2, sender=sender,
                                             params=snap.tensors)
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            result["error"] = e

    thread = threading.Thread(target=push)
    thread.start()
    with torch.no_grad():
        for t in local.values():
            t.add_(1.0)  # the next optimizer step, in place
    if world > 1:
        import torch.distributed as dist

        for _ in range(20):  # the next step's collectives, beside the push
            dist.all_reduce(torch.ones(1024, device=device))
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["stats"]


def _receiver(index: int, receivers: int, num_groups: int, ports: list[int], source: str, verify: bool,
              backend: str, first_device: int, out: mp.Queue, started, delta: bool = False,
              first_bucket_bytes: int = 0, high_priority: bool = False) -> None:
    from disagg.errors import ChecksumError
    from disagg.transport.group import create_group
    from disagg.transport.receiver import TorchModelReceiver
    from disagg.transport.model_transfer import model_manifest, receive_model

    device = _device(backend, first_device + index)
    net = _Net()
    _fill(net, seed=99)  # the "previous version"
    net.to(device)
    before = _digest(net)
    started.wait(timeout=START_TIMEOUT_S)
    groups = [create_group(host=HOST, port=ports[r], rank=1 + index, world_size=1 + receivers, backend=_wire(backend),
                           timeout_s=TIMEOUT_S, group_name=f"s{r}", device=device, high_priority=high_priority)
              for r in range(num_groups)]
    full = model_manifest(net, BUCKET_BYTES, policy_version=5, first_bucket_bytes=first_bucket_bytes)
    load = TorchModelReceiver.load_into_module(net)
    rejected = None
    try:
        if delta:  # version 5 dense, then 6 as a delta onto it (_send_two_versions_as_deltas)
            from disagg.transport.delta import DeltaImage

            images = [DeltaImage(device) for _ in groups]
            receive_model(groups, full, load, device=device, source=source, images=images)
            load.assert_complete()
            stats = receive_model(groups, full.with_version(6), load, device=device, source=source, images=images)
        else:
            stats = receive_model(groups, full, load, device=device, source=source, num_buffers=2, verify=verify)
        received = stats.bytes
        load.assert_complete()
    except ChecksumError as e:
        rejected, received = str(e), None
    out.put({"role": "receiver", "index": index, "weights": _digest(net), "before": before, "received": received,
             "rejected": rejected, "group_bytes": sum(g.bytes_received for g in groups),
             "high_priority": [_high_priority(g) for g in groups]})
    for g in groups:
        g.barrier()
        g.destroy()


def _high_priority(group) -> bool | None:
    """Whether ``group``'s NCCL process group runs on a high-priority stream (None on gloo)."""
    options = getattr(group._pg, "options", None)
    return getattr(options, "is_high_priority_stream", None)


def _run(trainers: int, source: str, corrupt: bool = False, backend: str = "gloo", receivers: int = 2,
         overlap: bool = False, delta: bool = False, first_receiver_gpu: int | None = None,
         first_bucket_bytes: int = 0, high_priority: bool = False) -> list[dict]:
    """Spawn the trainers and receivers (on NCCL: one GPU each, trainers first; ``first_receiver_gpu``
    puts the receivers from that GPU on instead, beside a trainer that shares no group with them)
    and collect their reports. ``first_bucket_bytes``: the buckets ramp from it (``plan_buckets``).
    ``high_priority``: NCCL groups on streams of the highest priority (``transport.nccl_high_priority``)."""
    from disagg.transport.group import pick_free_port
    from disagg.transport.model_transfer import source_groups_needed

    ctx = rank_processes()
    out = ctx.Queue()
    started = ctx.Barrier(trainers + receivers)
    num_groups = source_groups_needed(source, trainers)
    ports = [pick_free_port(HOST) for _ in range(num_groups)]
    fsdp_port = pick_free_port(HOST)
    procs = [ctx.Process(target=_trainer, args=(r, trainers, receivers, ports, fsdp_port, source, corrupt, backend,
                                                out, started, overlap, delta, first_bucket_bytes, high_priority))
             for r in range(trainers)]
    first = trainers if first_receiver_gpu is None else first_receiver_gpu
    procs += [ctx.Process(target=_receiver, args=(j, receivers, num_groups, ports, source, corrupt, backend, first,
                                                  out, started, delta, first_bucket_bytes, high_priority))
              for j in range(receivers)]
    for p in procs:
        p.start()
    reports = []
    try:
        for _ in procs:
            reports.append(out.get(timeout=START_TIMEOUT_S + 120))
    except queue.Empty:
        pytest.fail(f"only {len(reports)} of {len(procs)} processes reported")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return reports


def check_bit_identical(reports: list[dict], trainers: int, source: str) -> None:
    trainer0 = next(r for r in reports if r["role"] == "trainer" and r["rank"] == 0)
    recvs = [r for r in reports if r["role"] == "receiver"]
    assert recvs
    for r in recvs:
        assert r["rejected"] is None
        assert r["weights"] == trainer0["weights"]  # exact float equality, every element
        assert r["weights"] != r["before"]
        assert r["received"] == r["group_bytes"]
    sent = sum(r["sent"] or 0 for r in reports if r["role"] == "trainer")
    if source == "shards":
        # Every rank sent its own shards: together exactly one copy of the model.
        assert all(r["sent"] for r in reports if r["role"] == "trainer")
    else:
        assert [r["sent"] is not None for r in sorted(reports, key=lambda r: r.get("rank", 9))
                if r["role"] == "trainer"] == [True] + [False] * (trainers - 1)
    assert sent == trainer0["manifest_bytes"]


@pytest.mark.parametrize("trainers, source", [(1, "gather"), (1, "shards"), (2, "gather"), (2, "shards")])
def test_pipelined_sync_is_bit_identical(trainers, source):
    check_bit_identical(_run(trainers, source), trainers, source)


@pytest.mark.parametrize("trainers, source", [(1, "gather"), (2, "shards")])
def test_buckets_that_ramp_up_and_down_arrive_bit_identical(trainers, source):
    """transport.first_bucket_bytes: the buckets grow from 256 bytes to the full 2048 and shrink
    again; the tensors split at the ramps' edges (and each rank's shards, re-planned on both sides
    with the same ramp) arrive exact."""
    reports = _run(trainers, source, first_bucket_bytes=256)
    check_bit_identical(reports, trainers, source)
    sizes = next(r for r in reports if r["role"] == "trainer" and r["rank"] == 0)["bucket_sizes"]
    assert sizes[0] == 256 and sizes[1] == 768 and max(sizes) == BUCKET_BYTES and sizes[-1] <= 256, sizes


@pytest.mark.parametrize("trainers, source", [(1, "gather"), (2, "shards")])
def test_a_snapshot_sent_while_the_live_weights_change_arrives_bit_identical(trainers, source):
    # The trainer reports its weights as they were when the snapshot was taken; the live ones
    # were all changed (+1) while the snapshot was on the wire.
    reports = _run(trainers, source, overlap=True)
    check_bit_identical(reports, trainers, source)
    # sent from the snapshot's own memory: no bucket was packed into a staging buffer
    assert [r["staged_on"] for r in reports if r["role"] == "trainer"] == [[]] * trainers


@pytest.mark.parametrize("trainers, source", [(1, "gather"), (2, "gather"), (2, "shards")])
def test_a_delta_sync_from_every_source_mode_arrives_bit_identical_in_a_share_of_the_bytes(trainers, source):
    """transport.delta=on: after a dense version 5, version 6 (every 37th element of every shard moved)
    goes out as a delta, gathered from FSDP shards or from each rank's own shards over its own group."""
    check_delta(_run(trainers, source, delta=True))


@pytest.mark.parametrize("push", ["delta", "snapshot"])
def test_deltas_and_snapshots_across_ramped_buckets_arrive_bit_identical(push):
    """The buckets' ramp (transport.first_bucket_bytes: 256, 768, 2048 bytes and back down) under the
    other two ways a push goes: each rank's shards as a delta (transport.delta=on), compared bucket by
    bucket; a snapshot laid out as the ramped buckets, sent as views while the live weights change."""
    if push == "delta":
        reports = _run(2, "shards", delta=True, first_bucket_bytes=256)
        check_delta(reports)
    else:
        reports = _run(1, "gather", overlap=True, first_bucket_bytes=256)
        check_bit_identical(reports, 1, "gather")
        assert [r["staged_on"] for r in reports if r["role"] == "trainer"] == [[]]  # views of the snapshot
    assert next(r for r in reports if r["role"] == "trainer")["bucket_sizes"][:2] == [256, 768]


def check_delta(reports: list[dict]) -> None:
    """What must hold after ``_run(..., delta=True)`` (shared with the NCCL test)."""
    senders = [r for r in reports if r["role"] == "trainer" and r["sent"] is not None]
    trainer0 = next(r for r in reports if r["role"] == "trainer" and r["rank"] == 0)
    sent = sum(r["sent"] for r in senders)
    assert 0 < sent < 0.25 * trainer0["manifest_bytes"], (sent, trainer0["manifest_bytes"])
    assert all(0.02 < r["changed"] < 0.04 for r in senders), [r["changed"] for r in senders]
    for r in (x for x in reports if x["role"] == "receiver"):
        assert r["rejected"] is None
        assert r["weights"] == trainer0["weights"]  # version 6, exact, every element
        assert r["received"] == sent and r["group_bytes"] == trainer0["manifest_bytes"] + sent


def test_checksum_mismatch_rejects_the_version_and_keeps_the_previous_weights():
    reports = _run(1, "gather", corrupt=True)
    for r in (x for x in reports if x["role"] == "receiver"):
        assert r["rejected"] and "checksum mismatch" in r["rejected"]
        assert r["weights"] == r["before"]  # nothing was loaded


def test_shard_sizes_follow_torch_chunk():
    from disagg.transport.model_transfer import shard_sizes

    for dim0 in (0, 1, 2, 3, 5, 33, 64):
        for n in (1, 2, 3, 4):
            want = [c.shape[0] for c in torch.arange(dim0).chunk(n)] if dim0 else []
            got = shard_sizes(dim0, n)
            assert len(got) == n and sum(got) == dim0
            assert [g for g in got if g] == want
