"""Weight sync over real gloo groups between real (spawned) processes.

Rank 0 sends, ranks 1.. receive. Each scenario's process body is a module-level
function (spawn pickles targets by name) that reports a small dict to the parent
through a queue; the parent asserts on those reports.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import re
import time

import pytest
import torch

from disagg.errors import TransportError
from disagg.transport.group import create_group, pick_free_port
from disagg.transport.receiver import TorchModelReceiver, receive_weights
from disagg.transport.sender import WeightSender, build_manifest
from tests.conftest import rank_processes

HOST = "127.0.0.1"
BUCKET_BYTES = 4096
TIMEOUT_S = 3.0
SPAWN_LIMIT_S = 180.0  # for the rank processes to start and report


class _Net(torch.nn.Module):
    """Mixed dtypes, an odd shape, a tensor 3.5 buckets long and an empty buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16, dtype=torch.bfloat16)
        self.proj = torch.nn.Linear(16, 7)
        self.big = torch.nn.Parameter(torch.zeros(64, 56))  # 14336 bytes = 3.5 x BUCKET_BYTES
        self.odd = torch.nn.Parameter(torch.zeros(7, 13, dtype=torch.float16))
        self.register_buffer("steps", torch.zeros(5, dtype=torch.int64))
        self.register_buffer("empty", torch.zeros(0, 4))


def _weights(seed: int) -> dict[str, torch.Tensor]:
    """The sender's tensors for ``seed``; receivers regenerate them to compare."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in _Net().state_dict().items():
        if t.dtype.is_floating_point:
            out[name] = torch.randn(t.shape, generator=gen).to(t.dtype)
        else:
            out[name] = torch.randint(-(2**40), 2**40, t.shape, generator=gen, dtype=t.dtype)
    return out


def _zeroed_net() -> _Net:
    net = _Net()
    with torch.no_grad():
        for t in net.state_dict().values():
            t.zero_()
    return net


def _group(rank: int, world: int, port: int, timeout_s: float = TIMEOUT_S, signals: str = "store"):
    return create_group(host=HOST, port=port, rank=rank, world_size=world, backend="gloo",
                        timeout_s=timeout_s, group_name="weights", device=None, signals=signals)


def _sync(rank: int, world: int, port: int) -> dict:
    group = _group(rank, world, port)
    try:
        if rank == 0:
            sender = WeightSender(group)
            w7 = _weights(7)
            m7 = build_manifest(w7.items(), BUCKET_BYTES, policy_version=7)
            s7 = sender.send(m7, lambda: iter(w7.items()))  # lazy source
            s8 = sender.send(m7.with_version(8), _weights(8))  # mapping source
            return {"bytes_sent": group.bytes_sent, "total_bytes": m7.total_bytes,
                    "stats_bytes": [s7.bytes, s8.bytes], "num_buckets": [s7.num_buckets, len(m7.buckets)]}
        equal, num_tensors = [], []
        for version in (7, 8):
            net = _zeroed_net()
            load_fn = TorchModelReceiver.load_into_module(net)
            manifest = build_manifest(net.state_dict().items(), BUCKET_BYTES, policy_version=version)
            load_fn.check_manifest(manifest)
            stats = receive_weights(group, manifest, load_fn)
            load_fn.assert_complete()
            got = net.state_dict()
            equal.append({k: torch.equal(got[k], v) for k, v in _weights(version).items()})
            num_tensors.append(stats.num_tensors)
        return {"equal": equal, "num_tensors": num_tensors, "bytes_received": group.bytes_received,
                "num_entries": len(_Net().state_dict())}
    finally:
        group.destroy()


def _mismatch(rank: int, world: int, port: int) -> dict:
    group = _group(rank, world, port)
    try:
        if rank == 0:
            w = _weights(1)
            WeightSender(group).send(build_manifest(w.items(), BUCKET_BYTES, policy_version=1), w)
            return {}
        # Rank 2 planned with another bucket size: same tensors, different layout.
        net = _zeroed_net()
        bucket_bytes = BUCKET_BYTES if rank == 1 else BUCKET_BYTES // 2
        manifest = build_manifest(net.state_dict().items(), bucket_bytes, policy_version=1)
        receive_weights(group, manifest, TorchModelReceiver.load_into_module(net))
        return {"loaded_nonzero": any(bool(t.any()) for t in net.state_dict().values())}
    finally:
        group.destroy()


def _absent_peer(rank: int, world: int, port: int) -> dict:
    _group(rank, world, port).destroy()
    return {}


KILL_TENSORS = {"head": torch.arange(10.0), "big": torch.ones(1 << 22)}  # 16 MiB in 256 buckets
KILL_BUCKET_BYTES = 64 << 10
KILL_TIMEOUT_S = 10.0


def _kill_receiver(rank: int, world: int, port: int) -> dict:
    group = _group(rank, world, port, timeout_s=KILL_TIMEOUT_S)
    manifest = build_manifest(KILL_TENSORS.items(), KILL_BUCKET_BYTES, policy_version=3)
    try:
        if rank == 0:
            t0 = time.monotonic()
            try:
                WeightSender(group).send(manifest, KILL_TENSORS)
            except TransportError as e:
                return {"raised": "TransportError", "error": str(e), "send_s": time.monotonic() - t0}
            return {"raised": None, "send_s": time.monotonic() - t0}

        def load_fn(done: list[tuple[str, torch.Tensor]]) -> None:
            if rank == 2:  # "head" completes with the first bucket: die mid-sync
                os._exit(17)

        receive_weights(group, manifest, load_fn)
        return {}
    finally:
        group.destroy()


def _armed(rank: int, world: int, port: int, signals: str = "store") -> dict:
    """Armed receives (the engines' wait in transport.arm): woken by the sender's word; by an armed
    push's (``send(go=...)``: the send set up before its go, the wire right after it; called off in
    its go with nothing on the wire); by the driver's words to every party at once
    (``driver_signals``: a client of the store, or of every member's doorbell, that is no member of
    the group), called off by it, and ended by its death (it hosts the store, and its connections to
    the doorbells end with it) well before their timeout. The words go by ``signals``."""
    import json

    from disagg.errors import SyncCancelled
    from disagg.transport.signals import driver_signals
    from disagg.transport.model_transfer import ARM_CANCEL, ARM_SEND, arm_key, armed_go, go_key

    group = _group(rank, world, port, signals=signals)
    assert group.signals == signals
    w = _weights(5)
    w6 = _weights(6)
    m = build_manifest(w.items(), BUCKET_BYTES, policy_version=5)
    if rank == 0:
        time.sleep(1.0)  # the receivers wait on the group meanwhile
        group.signal(arm_key(1), ARM_SEND)
        sender = WeightSender(group)
        sender.send(m, w)
        went: dict = {}

        def go() -> None:  # an armed push's go: the driver's word, a second after the push set up
            time.sleep(1.0)
            went["unix_s"] = time.time()
            group.signal(arm_key(11), ARM_SEND)

        def off() -> None:
            raise SyncCancelled("the driver called it off")

        stats = sender.send(m.with_version(6), w6, go=go)
        facts = {"set_up_before_go": [stats.stamps["planned"] < went["unix_s"],
                                      stats.stamps["header_copied"] < went["unix_s"]],
                 "header_after_go": stats.header_unix_s >= went["unix_s"], "send_s": stats.seconds}
        try:
            sender.send(m.with_version(7), w, go=off)
        except SyncCancelled as e:
            facts["off"] = str(e)
        group.signal(arm_key(12), ARM_CANCEL)
        group.signal("facts", json.dumps(facts))  # this rank ends by dying: its receiver reports them
        driver = driver_signals([(HOST, port, "weights")], world, TIMEOUT_S, signals)
        time.sleep(0.5)
        assert not driver.signal({go_key(2): ARM_CANCEL, arm_key(2): ARM_CANCEL})
        assert group.await_signal(go_key(2), 5.0, "the driver's go") == ARM_CANCEL  # one word each: both keys
        time.sleep(1.0)
        os._exit(0)  # armed receive 3 waits on a store that is gone
    net = _zeroed_net()
    load_fn = TorchModelReceiver.load_into_module(net)
    manifest = build_manifest(net.state_dict().items(), BUCKET_BYTES, policy_version=5)
    t0 = time.monotonic()
    receive_weights(group, manifest, load_fn, go=armed_go(1, 30.0, "armed receive 1"))
    out: dict = {"waited_s": time.monotonic() - t0,
                 "equal": all(torch.equal(net.state_dict()[k], v) for k, v in w.items())}
    t0 = time.monotonic()
    receive_weights(group, manifest.with_version(6), load_fn, go=armed_go(11, 30.0, "armed receive 11"))
    out.update(push_waited_s=time.monotonic() - t0,
               push_equal=all(torch.equal(net.state_dict()[k], v) for k, v in w6.items()))
    try:
        receive_weights(group, manifest.with_version(7), load_fn, go=armed_go(12, 30.0, "armed receive 12"))
    except SyncCancelled as e:
        out["push_off"] = str(e)
    out["push_off_unchanged"] = all(torch.equal(net.state_dict()[k], v) for k, v in w6.items())
    out["facts"] = json.loads(group.await_signal("facts", 30.0, "the sender's facts"))
    before = {k: v.clone() for k, v in net.state_dict().items()}
    try:
        receive_weights(group, manifest.with_version(6), load_fn, go=armed_go(2, 30.0, "armed receive 2"))
    except SyncCancelled as e:
        out["cancelled"] = str(e)
    out["unchanged"] = all(torch.equal(net.state_dict()[k], v) for k, v in before.items())
    t1 = time.monotonic()
    try:
        receive_weights(group, manifest.with_version(7), load_fn, go=armed_go(3, 30.0, "armed receive 3"))
    except TransportError as e:
        out["orphaned"], out["orphaned_s"] = str(e), time.monotonic() - t1
    return out


def _early(rank: int, world: int, port: int) -> dict:
    """An armed push whose first buckets are packed as the train step ends (``EarlyPack``), bf16 on the
    wire from float32 (packed, not sent as views): the step ending while the push waits for its word;
    the word first; the step ending before the push was set up; the push called off."""
    import threading

    from disagg.errors import SyncCancelled
    from disagg.transport.sender import EarlyPack

    group = _group(rank, world, port)
    if rank == 0:
        w5, w6 = _weights(5), _weights(6)
        m = build_manifest(w5.items(), BUCKET_BYTES, policy_version=5, dtype_override="bfloat16")
        sender = WeightSender(group)
        params = {k: v.clone() for k, v in w5.items()}  # the trainer's parameters, updated in place
        facts: dict = {"num_buckets": len(m.buckets)}
        # 1: the step that makes version 6 ends while the push waits for the driver's word
        early, word, out = EarlyPack(), threading.Event(), {}
        push = threading.Thread(target=lambda: out.update(
            stats=sender.send(m.with_version(6), params, go=lambda: word.wait(30), early=early)))
        push.start()
        deadline = time.monotonic() + 30
        while early._make is None and time.monotonic() < deadline:  # set up (its offer made), waiting for its word
            time.sleep(0.01)
        for k, v in params.items():  # the step's optimizer
            v.copy_(w6[k])
        facts["packed"], facts["packed_again"] = early.params_final(), early.params_final()
        word.set()
        push.join(30)
        stats = out["stats"]
        facts["early_buckets"] = stats.early_buckets
        facts["early_before_header"] = stats.stamps["early_packed"] < stats.header_unix_s
        # 2: the word before the step's end: packed at the word; the step that ends after packs nothing
        for k, v in params.items():
            v.copy_(w5[k])
        early = EarlyPack()
        facts["word_first"] = sender.send(m.with_version(7), params, go=lambda: None, early=early).early_buckets
        facts["packed_after_word"] = early.params_final()
        # 3: the step ended before the push was set up
        for k, v in params.items():
            v.copy_(w6[k])
        early = EarlyPack()
        facts["packed_before_offer"] = early.params_final()
        facts["step_first"] = sender.send(m.with_version(8), params, go=lambda: None, early=early).early_buckets
        # 4: called off at its word: nothing on the wire, and a step ending after packs nothing

        def off() -> None:
            raise SyncCancelled("called off")

        early = EarlyPack()
        try:
            sender.send(m.with_version(9), params, go=off, early=early)
        except SyncCancelled:
            facts["packed_after_off"] = early.params_final()
        return facts
    net = _zeroed_net()
    load_fn = TorchModelReceiver.load_into_module(net)
    manifest = build_manifest(net.state_dict().items(), BUCKET_BYTES, policy_version=5, dtype_override="bfloat16")
    equal = {}
    for version, seed in ((6, 6), (7, 5), (8, 6)):
        receive_weights(group, manifest.with_version(version), load_fn)
        want = {k: v.to(torch.bfloat16).to(v.dtype) if v.dtype.is_floating_point else v
                for k, v in _weights(seed).items()}  # bf16 on the wire
        equal[version] = all(torch.equal(net.state_dict()[k], v) for k, v in want.items())
    return {"equal": equal}


def _header_first(rank: int, world: int, port: int) -> dict:
    """An armed sync whose header goes out before the word (``header_first``, both ends): the push's
    header before its go and its first bucket after; the receiver's header taken before its own word
    and the wait not counted in its receive; called off after the header went: the send waits for it
    to be taken, the receiver keeps its weights, and a plain sync after both is exact (in step); a
    receiver whose manifest differs refuses at the header, before any word."""
    from disagg.errors import SyncCancelled
    from disagg.transport.model_transfer import ARM_CANCEL, ARM_SEND, arm_key, armed_go

    group = _group(rank, world, port, signals="socket")
    m = build_manifest(_weights(5).items(), BUCKET_BYTES, policy_version=5)
    if rank == 0:
        sender, facts = WeightSender(group), {}
        went: dict = {}

        def go() -> None:  # the driver's word, a second after the push set up
            time.sleep(1.0)
            went["unix_s"] = time.time()
            group.signal(arm_key(21), ARM_SEND)

        stats = sender.send(m.with_version(6), _weights(6), go=go, header_first=True)
        facts["header_before_go"] = stats.header_unix_s < went["unix_s"] < stats.stamps["first"]

        def off() -> None:
            time.sleep(0.5)
            group.signal(arm_key(22), ARM_CANCEL)
            raise SyncCancelled("called off after the header")

        t0 = time.monotonic()
        try:
            sender.send(m.with_version(7), _weights(7), go=off, header_first=True)
        except SyncCancelled as e:
            facts["off"], facts["off_s"] = str(e), time.monotonic() - t0
        sender.send(m.with_version(8), _weights(8))
        group.signal("facts", json.dumps(facts))
        try:  # the receiver refuses this header: its buckets find no one taking them
            sender.send(m.with_version(9), _weights(9), go=lambda: group.signal(arm_key(23), ARM_SEND),
                        header_first=True)
        except TransportError as e:
            facts["refused"] = str(e)
        return facts
    net = _zeroed_net()
    load_fn = TorchModelReceiver.load_into_module(net)
    manifest = build_manifest(net.state_dict().items(), BUCKET_BYTES, policy_version=5)
    t0 = time.monotonic()
    stats = receive_weights(group, manifest.with_version(6), load_fn, go=armed_go(21, 30.0, "armed receive 21"),
                            header_first=True)
    out: dict = {"waited_s": time.monotonic() - t0, "seconds": stats.seconds, "header_s": stats.header_s,
                 "posted_after_word": stats.posted_unix_s >= stats.header_unix_s,
                 "equal6": all(torch.equal(net.state_dict()[k], v) for k, v in _weights(6).items())}
    try:
        receive_weights(group, manifest.with_version(7), load_fn, go=armed_go(22, 30.0, "armed receive 22"),
                        header_first=True)
    except SyncCancelled as e:
        out["cancelled"] = str(e)
    out["unchanged"] = all(torch.equal(net.state_dict()[k], v) for k, v in _weights(6).items())
    receive_weights(group, manifest.with_version(8), load_fn)
    out["equal8"] = all(torch.equal(net.state_dict()[k], v) for k, v in _weights(8).items())
    try:  # another receiver's layout: refused at the header, before its word
        receive_weights(group, manifest.with_version(10), load_fn, go=armed_go(23, 30.0, "armed receive 23"),
                        header_first=True)
    except TransportError as e:
        out["mismatch"] = str(e)
    out["facts"] = json.loads(group.await_signal("facts", 30.0, "the sender's facts"))
    return out


def _parts(rank: int, world: int, port: int) -> dict:
    """A receive (``receive_model``, gather) that takes the tensor split over buckets part by part."""
    from disagg.transport.buckets import PartLoader
    from disagg.transport.model_transfer import receive_model

    group = _group(rank, world, port)
    w = _weights(9)
    manifest = build_manifest(w.items(), BUCKET_BYTES, policy_version=9)
    if rank == 0:
        WeightSender(group).send(manifest, w)
        return {}
    net = _zeroed_net()
    whole = TorchModelReceiver.load_into_module(net)
    loaded, parts = [], []

    def load(items):
        loaded.extend(name for name, _ in items)
        whole(items)

    def part(name: str, piece: torch.Tensor, offset: int, last: bool) -> None:
        parts.append((offset, piece.numel(), last))
        net.big.data.view(-1)[offset : offset + piece.numel()].copy_(piece)

    receive_model([group], manifest, load, device=torch.device("cpu"), source="gather",
                  parts=PartLoader(frozenset({"big"}), part))
    return {"parts": parts, "loaded": loaded, "numel": net.big.numel(),
            "equal": {k: torch.equal(net.state_dict()[k], v) for k, v in w.items()}}


def _whole_buckets(rank: int, world: int, port: int) -> dict:
    """Three versions over one layout: the first through the module's loader, its copies recorded
    (``learn``); the next two loaded a whole bucket at a time by the plan laid over the layout
    (``BucketReplay``), the receive buffers and their views reused from one version to the next."""
    from disagg.transport.buckets import PartLoader
    from disagg.transport.copyplan import CopyPlan, Recorded, learn
    from disagg.transport.model_transfer import receive_model

    group = _group(rank, world, port)
    versions = (11, 12, 13)
    manifest = build_manifest(_weights(versions[0]).items(), BUCKET_BYTES, policy_version=versions[0])
    if rank == 0:
        sender = WeightSender(group)
        for v in versions:
            sender.send(manifest.with_version(v), _weights(v))
        return {}
    net = _zeroed_net()
    loader = TorchModelReceiver.load_into_module(net)
    recorded = Recorded({}, {})

    def learning(items):
        got, why = learn(loader, items, [*net.parameters(), *net.buffers()])
        assert why is None, why
        recorded.update(got)

    receive_model([group], manifest, learning, device=torch.device("cpu"), source="gather")
    plan = CopyPlan(recorded)
    replay = plan.bucket_replay(manifest)
    out = {"equal": [], "loaded": [], "whole": [], "num_tensors": [], "num_buckets": len(manifest.buckets),
           "split": sorted({e.name for b in manifest.buckets for e in b.entries if e.numel != manifest.spec(e.name).numel})}
    for v in versions[1:]:
        loaded, whole = [], []

        def bucket(b, buf):
            whole.append(b.index)
            return replay.load(b, buf)

        stats = receive_model([group], manifest.with_version(v), lambda items: loaded.extend(n for n, _ in items),
                              device=torch.device("cpu"), source="gather",
                              parts=PartLoader(plan.part_names, plan.apply_part, bucket=bucket))
        out["equal"].append({k: torch.equal(net.state_dict()[k], t) for k, t in _weights(v).items()})
        out["loaded"].append(loaded)
        out["whole"].append(whole)
        out["num_tensors"].append(stats.num_tensors)
    return out


def _child(target, rank: int, world: int, port: int, results, started) -> None:
    # Every process has started before any joins: spawned processes import torch seconds apart on a
    # busy machine, and the short timeouts here time the rendezvous, not the start-up.
    started.wait(timeout=SPAWN_LIMIT_S)
    t0 = time.monotonic()
    try:
        out = {"ok": True, **target(rank, world, port)}
    except Exception as e:  # reported to the parent, which asserts on it
        out = {"ok": False, "error_type": type(e).__name__, "error": str(e)}
    out["elapsed_s"] = time.monotonic() - t0
    results.put((rank, out))


def _spawn(target, world: int, ranks: list[int],
           limit_s: float = SPAWN_LIMIT_S) -> tuple[dict[int, dict], dict[int, int]]:
    """Run ``target`` on ``ranks`` of a world of ``world``; return reports and exit codes."""
    ctx = rank_processes()
    results = ctx.Queue()
    started = ctx.Barrier(len(ranks))
    port = pick_free_port(HOST)
    procs = {r: ctx.Process(target=_child, args=(target, r, world, port, results, started), daemon=True)
             for r in ranks}
    for p in procs.values():
        p.start()
    reports: dict[int, dict] = {}
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and (any(p.is_alive() for p in procs.values()) or not results.empty()):
        try:
            rank, out = results.get(timeout=0.2)
            reports[rank] = out
        except queue.Empty:
            pass
    for p in procs.values():
        if p.is_alive():
            p.kill()
        p.join(5)
    return reports, {r: p.exitcode for r, p in procs.items()}


def test_sync_mixed_dtypes_to_two_receivers() -> None:
    reports, codes = _spawn(_sync, world=3, ranks=[0, 1, 2])
    assert codes == {0: 0, 1: 0, 2: 0}, reports
    assert all(reports[r]["ok"] for r in (0, 1, 2)), reports
    sender = reports[0]
    assert sender["stats_bytes"] == [sender["total_bytes"]] * 2
    assert sender["bytes_sent"] == 2 * sender["total_bytes"]
    assert sender["num_buckets"][0] == sender["num_buckets"][1] > 4
    for r in (1, 2):
        rx = reports[r]
        assert rx["bytes_received"] == sender["bytes_sent"]
        assert rx["num_tensors"] == [rx["num_entries"]] * 2
        for per_version in rx["equal"]:
            assert per_version and all(per_version.values()), per_version


def test_a_tensor_split_over_buckets_can_be_received_part_by_part() -> None:
    reports, _ = _spawn(_parts, world=2, ranks=[0, 1])
    rx = reports[1]
    assert rx["ok"], rx
    assert all(rx["equal"].values()), rx["equal"]
    assert "big" not in rx["loaded"] and len(rx["loaded"]) == len(rx["equal"]) - 1  # never assembled
    parts = rx["parts"]
    assert len(parts) >= 4 and sum(n for _, n, _ in parts) == rx["numel"]  # 3.5 buckets
    assert [last for *_, last in parts] == [False] * (len(parts) - 1) + [True]


def test_whole_buckets_are_loaded_by_the_learned_plan_bit_for_bit_version_after_version() -> None:
    reports, _ = _spawn(_whole_buckets, world=2, ranks=[0, 1])
    rx = reports[1]
    assert rx["ok"], rx
    assert rx["split"] == ["big"]  # 3.5 buckets: its parts go with the buckets' other tensors
    for equal, loaded, whole, num_tensors in zip(rx["equal"], rx["loaded"], rx["whole"], rx["num_tensors"]):
        assert equal and all(equal.values()), equal  # mixed dtypes, casts into float32 included
        assert whole == list(range(rx["num_buckets"]))  # every bucket at once, none reassembled
        assert loaded == ["empty"]  # only the zero-element buffer, which no bucket holds, went to load_fn
        assert num_tensors == len(equal)


def test_receiver_with_mismatching_manifest_refuses() -> None:
    reports, _ = _spawn(_mismatch, world=3, ranks=[0, 1, 2])
    bad = reports[2]
    assert bad["error_type"] == "TransportError" and "layout crc" in bad["error"], bad
    # The sender sees the mismatch only as rank 2 leaving: its send fails, never succeeds.
    assert reports[0]["error_type"] == "TransportError", reports[0]
    assert reports[0]["elapsed_s"] < TIMEOUT_S * 2 + 2.0


@pytest.mark.parametrize("absent", [0, 2])
def test_rendezvous_with_absent_rank_times_out(absent: int) -> None:
    present = [r for r in range(3) if r != absent]
    reports, _ = _spawn(_absent_peer, world=3, ranks=present)
    for r in present:
        assert reports[r]["error_type"] == "TransportError", reports[r]
        assert re.search(rf"missing ranks[^\[]*: \[{absent}\]", reports[r]["error"]), reports[r]
        assert "'weights'" in reports[r]["error"]
        assert reports[r]["elapsed_s"] < TIMEOUT_S + 2.0, reports[r]


def test_receiver_dying_mid_sync_fails_the_sender_fast() -> None:
    reports, codes = _spawn(_kill_receiver, world=3, ranks=[0, 1, 2])
    assert codes[2] == 17
    sender = reports[0]
    assert sender["raised"] == "TransportError", sender
    assert sender["send_s"] < KILL_TIMEOUT_S, sender
    assert "broadcast" in sender["error"] and "'weights'" in sender["error"]
    # The error names the receiver that died, and only that one.
    assert "dead peer(s): rank 2 (" in sender["error"] and "rank 1 (" not in sender["error"], sender
    assert reports[1]["error_type"] == "TransportError", reports[1]


def test_an_armed_push_packs_its_first_buckets_as_the_step_ends_and_they_arrive_bit_for_bit() -> None:
    reports, _ = _spawn(_early, world=2, ranks=[0, 1])
    tx, rx = reports[0], reports[1]
    assert tx["ok"] and rx["ok"], reports
    assert tx["num_buckets"] > 2  # more buckets than buffers: the rest packed at the wire as usual
    # the step ending while the push waits: one bucket per buffer packed then, sent as they were
    assert tx["packed"] and not tx["packed_again"] and tx["early_buckets"] == 2 and tx["early_before_header"], tx
    # the word first, or the step ended before the push was set up: packed at the word
    assert tx["word_first"] == 0 and not tx["packed_after_word"], tx
    assert not tx["packed_before_offer"] and tx["step_first"] == 0, tx
    assert tx["packed_after_off"] is False, tx  # called off: a step ending later packs nothing
    assert rx["equal"] == {6: True, 7: True, 8: True}, rx  # the version the step made, bit for bit


@pytest.mark.parametrize("signals", ["store", "socket"])
def test_an_armed_receive_waits_for_the_senders_word_is_called_off_by_it_and_ends_when_it_dies(signals) -> None:
    import functools

    reports, codes = _spawn(functools.partial(_armed, signals=signals), world=2, ranks=[0, 1])
    rx = reports[1]
    assert rx["ok"], rx
    assert rx["equal"] and rx["waited_s"] >= 0.9  # woken by the word, not before it
    # an armed push: set up before its go, the header right after it, the wait not in its seconds
    facts = rx["facts"]
    assert rx["push_equal"] and rx["push_waited_s"] >= 0.9, rx
    assert facts["set_up_before_go"] == [True, True] and facts["header_after_go"], facts
    assert facts["send_s"] < 0.9, facts
    # called off in its go: nothing on the wire, the receiver called off with its weights unchanged
    assert facts["off"] == "the driver called it off" and "called off by the sender" in rx["push_off"]
    assert rx["push_off_unchanged"]
    assert "called off by the sender" in rx["cancelled"] and rx["unchanged"]
    # rank 0 gone: its store unreachable, or its connection to this doorbell ended; not the 30 s timeout
    assert ("unreachable" if signals == "store" else "hung up") in rx["orphaned"], rx["orphaned"]
    assert "rank 0 is likely dead" in rx["orphaned"] and rx["orphaned_s"] < 15


def test_an_armed_sync_with_its_header_first_takes_it_before_the_word_and_stays_in_step_when_called_off() -> None:
    reports, _ = _spawn(_header_first, world=2, ranks=[0, 1])
    tx, rx = reports[0], reports[1]
    assert tx["ok"] and rx["ok"], reports
    facts = rx["facts"]
    assert facts["header_before_go"], facts  # the header went before the word, the first bucket after it
    assert rx["equal6"] and rx["waited_s"] >= 0.9 and rx["seconds"] < 0.9, rx  # the wait is not the receive's
    assert rx["header_s"] == 0.0 and rx["posted_after_word"], rx  # matched before the word; buckets after it
    # called off after its header went: taken on both ends, nothing loaded, the next sync exact
    assert facts["off"] == "called off after the header" and "called off by the sender" in rx["cancelled"], rx
    assert rx["unchanged"] and rx["equal8"], rx
    assert "policy_version sender=9 receiver=10" in rx["mismatch"], rx
    assert "broadcast" in tx["refused"], tx
