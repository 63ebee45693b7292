"""The engine-neutral receiver (``disagg.transport.model_receiver.ModelReceiver``) without any engine:
a plain torch module whose own ``load_weights`` fuses q, k and v into one qkv parameter (as vLLM's
and SGLang's models do), joined to a real two-member gloo group whose rank 0 - the trainer - sends
from a thread of this process. Every update must leave the module's parameters equal to the
trainer's tensors bit for bit, whichever way it loaded them: the model's loader while a copy plan is
learned, the plan replayed a bucket at a time (or a tensor at a time, verified), a delta onto the
worker's image, or an engine's layerwise reload."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
import torch

from disagg.transport.buckets import bucket_checksum
from disagg.transport.delta import DeltaImage
from disagg.transport.group import create_group, pick_free_port, timed_raw_broadcasts
from disagg.transport.model_receiver import DisaggInitInfo, DisaggUpdateInfo, LayerwiseReload, ModelReceiver
from disagg.transport.model_transfer import ARM_CANCEL, ARM_SEND, Arm, arm_key
from disagg.transport.sender import WeightSender, build_manifest

HOST = "127.0.0.1"
BUCKET_BYTES = 4096
TIMEOUT_S = 30.0
HEADS, DIM, VOCAB = 8, 16, 80
FUSED = {"q_proj.weight": 0, "k_proj.weight": 1, "v_proj.weight": 2}


class _FusedAttention(torch.nn.Module):
    """Parameters named unlike the trainer's tensors: q, k and v land in row blocks of ``qkv``; the
    embedding (5 KiB of fp32) is split over buckets; ``o`` is bf16."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(3 * HEADS, DIM))
        self.o_proj = torch.nn.Parameter(torch.zeros(DIM, HEADS, dtype=torch.bfloat16))
        self.embed = torch.nn.Parameter(torch.zeros(VOCAB, DIM))
        self.norm = torch.nn.Parameter(torch.zeros(DIM))
        self.num_loader_calls = 0

    @torch.no_grad()
    def load_weights(self, weights) -> None:
        self.num_loader_calls += 1
        for name, t in weights:
            if name in FUSED:
                self.qkv[FUSED[name] * HEADS : (FUSED[name] + 1) * HEADS].copy_(t)
            else:
                getattr(self, name.removesuffix(".weight")).copy_(t)


def _trainer_tensors(version: int) -> dict[str, torch.Tensor]:
    """The trainer's tensors of ``version``: versions 1 and 2 drawn afresh; 3 is 2 with a few
    elements of the embedding moved (a delta's share)."""
    gen = torch.Generator().manual_seed(min(version, 2))
    w = {name: torch.randn(HEADS, DIM, generator=gen) for name in FUSED}
    w["o_proj.weight"] = torch.randn(DIM, HEADS, generator=gen).to(torch.bfloat16)
    w["embed.weight"] = torch.randn(VOCAB, DIM, generator=gen)
    w["norm.weight"] = torch.randn(DIM, generator=gen)
    if version == 3:
        w["embed.weight"][::17, 3] += 1.0
    return w


def _as_loaded(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The module's parameters after loading ``w``."""
    return {"qkv": torch.cat([w[n] for n in FUSED]), "o_proj": w["o_proj.weight"], "embed": w["embed.weight"],
            "norm": w["norm.weight"]}


def _equal_bits(model: torch.nn.Module, w: dict[str, torch.Tensor]) -> bool:
    got = dict(model.named_parameters())
    return all(torch.equal(got[n].detach().view(torch.uint8), t.view(torch.uint8)) for n, t in _as_loaded(w).items())


@contextmanager
def _joined(receiver: ModelReceiver, **init):
    """``receiver`` joined, as worker 0 of an engine whose ranks start at 1, to a two-member gloo group
    whose rank 0 (the trainer) joins from a thread; yields (the trainer's group, that thread's pool)."""
    port = pick_free_port(HOST)
    with ThreadPoolExecutor(1) as pool:
        trainer = pool.submit(create_group, host=HOST, port=port, rank=0, world_size=2, backend="gloo",
                              timeout_s=TIMEOUT_S, group_name="weights")
        receiver.join(DisaggInitInfo(groups=[[HOST, port, "weights"]], world_size=2, rank_offset=1, backend="gloo",
                                     timeout_s=TIMEOUT_S, **init), worker_index=0)
        group = trainer.result(timeout=TIMEOUT_S)
        try:
            yield group, pool
        finally:
            receiver.shutdown()
            group.destroy()


def _sync(receiver: ModelReceiver, pool: ThreadPoolExecutor, send, **update) -> dict:
    """One update: the trainer's ``send()`` on its thread while the receiver syncs; the receiver's figures."""
    sent = pool.submit(send)
    stats = receiver.sync(DisaggUpdateInfo(**update))
    sent.result(timeout=TIMEOUT_S)
    return stats


@pytest.mark.parametrize("verify", [False, True], ids=["plain", "verified"])
def test_a_direct_sync_learns_the_loaders_copies_and_the_next_replays_them_bit_for_bit(verify):
    model = _FusedAttention()
    receiver = ModelReceiver(model, torch.device("cpu"), engine="test")
    with _joined(receiver, load="direct", verify=verify) as (group, pool):
        sender = WeightSender(group, verify=verify)
        w1, w2 = _trainer_tensors(1), _trainer_tensors(2)
        m = build_manifest(w1.items(), BUCKET_BYTES, policy_version=1)
        first = _sync(receiver, pool, lambda: sender.send(m, w1), manifest=m.to_dict(), policy_version=1)
        assert first["copy_plan"] == "learned" and first["load_mode"] == "direct"
        assert _equal_bits(model, w1) and model.num_loader_calls > 0
        calls = model.num_loader_calls
        # the layout held by digest: the update names it and its version, no manifest
        second = _sync(receiver, pool, lambda: sender.send(m.with_version(2), w2), digest=m.layout_digest(),
                       policy_version=2)
        raw = pool.submit(timed_raw_broadcasts, group, 1024, 3, torch.device("cpu"))
        assert len(receiver.raw_receive(1024, 3)) == len(raw.result(timeout=TIMEOUT_S)) == 3
    assert second["policy_version"] == 2 and second["num_buckets"] == len(m.buckets) > 2
    assert second["copy_plan"] == ("replayed" if verify else "replayed by bucket")
    if not verify:
        assert second["whole_buckets"] == len(m.buckets)
    assert model.num_loader_calls == calls  # the plan did the loading, not the model's loader
    assert _equal_bits(model, w2)
    assert receiver.param_checksums()["qkv"] == bucket_checksum(_as_loaded(w2)["qkv"].reshape(-1)).tolist()
    assert second["worker_in_unix_s"] <= second["loaded_unix_s"] <= second["worker_out_unix_s"]


def test_a_delta_lands_on_the_workers_image_bit_for_bit_and_replays_only_what_changed():
    model = _FusedAttention()
    receiver = ModelReceiver(model, torch.device("cpu"), engine="test")
    with _joined(receiver, load="direct", delta=True) as (group, pool):
        sender, image = WeightSender(group), DeltaImage()
        w2, w3 = _trainer_tensors(2), _trainer_tensors(3)
        m = build_manifest(w2.items(), BUCKET_BYTES, policy_version=2)
        dense = _sync(receiver, pool, lambda: sender.send_delta(m, image, w2), manifest=m.to_dict(), policy_version=2)
        assert dense["copy_plan"] == "learned" and _equal_bits(model, w2)
        calls = model.num_loader_calls
        delta = _sync(receiver, pool, lambda: sender.send_delta(m.with_version(3), image, w3),
                      digest=m.layout_digest(), policy_version=3)
    assert receiver.images[0].version == 3
    assert 0 < delta["bytes"] < dense["bytes"] / 4, (delta["bytes"], dense["bytes"])  # the changes, not the tensors
    assert delta["copy_plan"] == "replayed" and model.num_loader_calls == calls
    assert _equal_bits(model, w3)


def test_an_engines_layerwise_reload_wraps_the_loads_of_an_update():
    model, events = _FusedAttention(), []
    reload = LayerwiseReload(lambda: events.append(("begin", model.num_loader_calls)),
                             lambda: events.append(("end", model.num_loader_calls)))
    receiver = ModelReceiver(model, torch.device("cpu"), engine="test", repacks=True, reload=reload)
    with _joined(receiver, load="auto") as (group, pool):  # auto on a worker that repacks: layerwise
        w1 = _trainer_tensors(1)
        m = build_manifest(w1.items(), BUCKET_BYTES, policy_version=1)
        stats = _sync(receiver, pool, lambda: WeightSender(group).send(m, w1), manifest=m.to_dict(), policy_version=1)
    assert stats["load_mode"] == "layerwise" and stats["copy_plan"] == ""
    assert events == [("begin", 0), ("end", model.num_loader_calls)] and model.num_loader_calls > 0
    assert _equal_bits(model, w1)


def test_an_engine_without_a_layerwise_reload_refuses_it_naming_the_option_before_joining():
    receiver = ModelReceiver(_FusedAttention(), torch.device("cpu"), engine="SGLang")
    info = DisaggInitInfo(groups=[[HOST, pick_free_port(HOST), "weights"]], world_size=2, rank_offset=1,
                          backend="gloo", timeout_s=1.0, load="layerwise")
    with pytest.raises(ValueError, match="transport.load='layerwise' needs a layerwise reload, which SGLang does not"):
        receiver.join(info, worker_index=0)
    assert receiver.groups == []
    assert receiver.set_load_mode("auto") == "direct"
    with pytest.raises(ValueError, match="transport.load='layerwise'"):
        receiver.set_load_mode("layerwise")
    assert receiver.load_mode == "direct"
    with pytest.raises(RuntimeError, match="SGLang's worker never joined the transport groups"):
        receiver.sync(DisaggUpdateInfo(policy_version=1))


def test_an_armed_receive_called_off_leaves_the_model_alone_and_the_next_sync_lands():
    model = _FusedAttention()
    receiver = ModelReceiver(model, torch.device("cpu"), engine="test")
    with _joined(receiver, load="direct") as (group, pool):
        w1 = _trainer_tensors(1)
        m = build_manifest(w1.items(), BUCKET_BYTES, policy_version=1)
        off = _sync(receiver, pool, lambda: group.signal(arm_key(4), ARM_CANCEL), manifest=m.to_dict(),
                    policy_version=1, arm=Arm(4, TIMEOUT_S).as_dict())
        assert "called off by the sender" in off["cancelled"] and "bytes" not in off
        assert model.num_loader_calls == 0 and not model.qkv.detach().any()
        landed = _sync(receiver, pool, lambda: WeightSender(group).send(m, w1), digest=m.layout_digest(),
                       policy_version=1)
    assert landed["copy_plan"] == "learned" and "cancelled" not in landed
    assert _equal_bits(model, w1)


@pytest.mark.parametrize("push_waits", [False, True], ids=["push-wakes", "push-waits"])
def test_an_armed_receive_lands_bit_for_bit_and_times_its_wait_apart_from_the_sync(push_waits):
    """The word comes 0.3 s after the receive is on the group: the wait is reported apart
    (``armed_wait_s``, ``armed_go_unix_s``), before the wire. With ``push_waits`` the trainer's header
    goes out before its word and the worker takes it before its own (``Arm.push_waits``)."""
    import json
    import time

    model = _FusedAttention()
    receiver = ModelReceiver(model, torch.device("cpu"), engine="test")
    arm = Arm(7, TIMEOUT_S, push_waits=push_waits)
    assert Arm.from_dict(json.loads(json.dumps(arm.as_dict()))) == arm  # crosses into a worker as JSON
    with _joined(receiver, load="direct") as (group, pool):
        w1 = _trainer_tensors(1)
        m = build_manifest(w1.items(), BUCKET_BYTES, policy_version=1)

        def word() -> None:
            time.sleep(0.3)
            group.signal(arm_key(7), ARM_SEND)

        def send():
            if push_waits:  # the armed push: its header out before the word
                return WeightSender(group).send(m, w1, go=word, header_first=True)
            word()  # the push wakes the receive, then sends
            return WeightSender(group).send(m, w1)

        landed = _sync(receiver, pool, send, manifest=m.to_dict(), policy_version=1, arm=arm.as_dict())
    assert "cancelled" not in landed and _equal_bits(model, w1)
    assert landed["armed_wait_s"] >= 0.25 > landed["seconds"], landed  # the wait is not in the sync
    assert landed["worker_in_unix_s"] < landed["armed_go_unix_s"] <= landed["wire_end_unix_s"], landed
