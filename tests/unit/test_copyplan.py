"""The copy plan a direct load learns from the model's own loader (disagg/transport/copyplan.py).

The model here loads as vLLM's do (``load_weights`` with a stacked-parameter mapping: q, k and v
into one fused qkv parameter, gate and up into gate_up, each by ``narrow`` and ``copy_``; a
tensor-parallel rank narrows the source). The plan must reproduce what the loader does, bit for
bit, from a receive buffer holding the next version; a loader that computes on what it receives
must get no plan. The GPU test (tests/gpu/test_nccl_sync.py) checks the same against real vLLM.
"""

from __future__ import annotations

import pytest
import torch

from disagg.transport.copyplan import CopyPlan, learn

H, KV, FF, VOCAB = 8, 4, 12, 10  # hidden, kv width, mlp width, vocabulary (padded to 16 rows)


class StackedModel(torch.nn.Module):
    """Parameters fused as vLLM fuses them; ``tp_rank`` of ``tp`` keeps its dim-0 shard of each."""

    STACKED = (("qkv", "q", 0), ("qkv", "k", H), ("qkv", "v", H + KV), ("gate_up", "gate", 0), ("gate_up", "up", FF))

    def __init__(self, tp: int = 1, tp_rank: int = 0, dtype=torch.float32, transform=None) -> None:
        super().__init__()
        self.tp, self.tp_rank, self.transform = tp, tp_rank, transform
        self.qkv = torch.nn.Parameter(torch.zeros((H + 2 * KV) // tp, H, dtype=dtype), requires_grad=False)
        self.gate_up = torch.nn.Parameter(torch.zeros(2 * FF // tp, H, dtype=dtype), requires_grad=False)
        self.down = torch.nn.Parameter(torch.zeros(H, FF // tp, dtype=dtype), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.zeros(H, dtype=dtype), requires_grad=False)
        self.embed = torch.nn.Parameter(torch.full((16, H), 7.0, dtype=dtype), requires_grad=False)

    def load_weights(self, weights) -> None:
        with torch.no_grad():
            for name, w in weights:
                if self.transform is not None:
                    w = self.transform(w)
                for fused, shard, offset in self.STACKED:
                    if name == shard:
                        size = w.shape[0] // self.tp
                        dst = getattr(self, fused).data.narrow(0, offset // self.tp, size)
                        dst.copy_(w.narrow(0, self.tp_rank * size, size))
                        break
                else:
                    if name == "down":  # row-parallel: the shard is a slice of dim 1 (not contiguous)
                        size = w.shape[1] // self.tp
                        self.down.data.copy_(w.narrow(1, self.tp_rank * size, size))
                    elif name == "embed":  # the vocabulary, then its padding rows zeroed
                        self.embed[: w.shape[0]].data.copy_(w)
                        self.embed[w.shape[0]:].data.fill_(0)
                    else:
                        getattr(self, name).data.copy_(w)


SHAPES = {"embed": (VOCAB, H), "q": (H, H), "k": (KV, H), "v": (KV, H), "gate": (FF, H), "up": (FF, H),
          "down": (H, FF), "norm": (H,)}


def _received(seed: int, dtype=torch.bfloat16) -> list[tuple[str, torch.Tensor]]:
    """One version's tensors as a receiver holds them: views into one flat bucket buffer."""
    g = torch.Generator().manual_seed(seed)
    sizes = [torch.Size(s).numel() for s in SHAPES.values()]
    buf = torch.randn(sum(sizes) + 3, generator=g).to(dtype)  # spare elements: views start mid-buffer
    out, off = [], 3
    for (name, shape), n in zip(SHAPES.items(), sizes):
        out.append((name, buf[off : off + n].view(shape)))
        off += n
    return out


def _loaded(seed: int, **model) -> StackedModel:
    m = StackedModel(**model)
    m.load_weights(_received(seed))
    return m


def _learned(**model) -> tuple[StackedModel, CopyPlan]:
    m = StackedModel(**model)
    recorded, why = learn(m.load_weights, _received(0), [*m.parameters(), *m.buffers()])
    assert why is None, why
    return m, CopyPlan(recorded)


@pytest.mark.parametrize("tp_rank", [None, 0, 1])
def test_the_plan_replays_the_loader_bit_for_bit_with_another_version_in_the_buffer(tp_rank) -> None:
    model = {} if tp_rank is None else {"tp": 2, "tp_rank": tp_rank}
    m, plan = _learned(**model)
    assert torch.equal(m.qkv, _loaded(0, **model).qkv)  # learning loaded the version too
    assert plan.num_copies == len(SHAPES)  # one copy per tensor, each into its place
    assert [len(f) for f in plan.fills.values()] == [1]  # the embedding's padding, zeroed
    for seed in (1, 2):  # later versions, each in a buffer of its own
        plan.apply(_received(seed))
        want = _loaded(seed, **model)
        for name, p in m.named_parameters():
            assert torch.equal(p, getattr(want, name)), name
        assert not torch.equal(m.qkv, _loaded(0, **model).qkv)
    m.embed.data.fill_(3.0)  # the padding is zeroed again by the replay, as by the loader
    plan.apply(_received(3))
    assert torch.equal(m.embed, _loaded(3, **model).embed) and not m.embed[VOCAB:].any()


def test_a_bucket_at_a_time_and_the_cached_views_follow_the_buffer() -> None:
    m, plan = _learned()
    received = _received(5)
    plan.apply(received[:4])  # a bucket with the embedding, q, k, v
    plan.apply(received[4:])
    assert torch.equal(m.gate_up, _loaded(5).gate_up) and torch.equal(m.qkv, _loaded(5).qkv)
    again = _received(6)  # the same names at other addresses: the views are made again
    plan.apply(again)
    assert torch.equal(m.down, _loaded(6).down)


@pytest.mark.parametrize("tp_rank", [None, 1])
def test_a_tensor_split_over_buckets_is_copied_part_by_part_where_the_loader_put_it(tp_rank) -> None:
    """``apply_part``: the parts of a received tensor, as a receiver gets them from consecutive
    buckets (uneven, a copy's boundary inside a part), land bit for bit where the whole replay
    puts them; the embedding's padding is zeroed after its last part. A row-parallel shard (a slice
    of dim 1: not one run of elements) is no part-by-part tensor."""
    model = {} if tp_rank is None else {"tp": 2, "tp_rank": tp_rank}
    m, plan = _learned(**model)
    assert plan.part_names == set(SHAPES) - ({"down"} if tp_rank is not None else set())
    m.embed.data.fill_(3.0)
    for name, t in _received(4):
        flat = t.reshape(-1)
        if name not in plan.part_names:
            plan.apply([(name, t)])
            continue
        cuts = [0, 1, max(2, flat.numel() // 3), flat.numel()]
        for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
            last = i == len(cuts) - 2
            plan.apply_part(name, flat[a:b], a, last)
            if name == "embed" and not last:
                assert (m.embed[VOCAB:] == 3.0).all()  # the fills wait for the last part
    want = _loaded(4, **model)
    for name, p in m.named_parameters():
        assert torch.equal(p, getattr(want, name)), name


def test_the_cast_into_parameters_of_another_dtype_is_replayed() -> None:
    m, plan = _learned(dtype=torch.float32)  # bf16 on the wire, float32 parameters
    plan.apply(_received(3))
    assert torch.equal(m.gate_up, _loaded(3, dtype=torch.float32).gate_up)
    assert m.gate_up.dtype == torch.float32


@pytest.mark.parametrize("transform, why", [
    (lambda w: w.float(), "computes on received tensor"),  # a cast before the copy
    (lambda w: w * 2, "computes on received tensor"),
    (lambda w: w.t().contiguous().t(), "computes on received tensor"),  # a copy made by the loader
])
def test_a_loader_that_computes_on_what_it_received_gets_no_plan(transform, why) -> None:
    m = StackedModel(transform=transform)
    recorded, problem = learn(m.load_weights, _received(0), [*m.parameters(), *m.buffers()])
    assert recorded is None and why in problem
    assert torch.equal(m.norm, transform(_received(0)[-1][1]).float())  # it still loaded, its own way


def test_a_loader_that_writes_parameters_otherwise_or_copies_elsewhere_gets_no_plan() -> None:
    class Scaling(StackedModel):
        def load_weights(self, weights) -> None:
            super().load_weights(weights)
            with torch.no_grad():
                self.norm.data.mul_(2.0)

    m = Scaling()
    _, problem = learn(m.load_weights, _received(0), [*m.parameters(), *m.buffers()])
    assert "writes into a parameter" in problem

    class Staging(StackedModel):
        def load_weights(self, weights) -> None:
            self.staged = torch.empty(SHAPES["norm"], dtype=torch.bfloat16)
            self.staged.copy_(dict(weights)["norm"])

    m = Staging()
    _, problem = learn(m.load_weights, _received(0), [*m.parameters(), *m.buffers()])
    assert "not a parameter's" in problem


def test_a_name_the_plan_never_saw_is_an_error() -> None:
    _, plan = _learned()
    with pytest.raises(KeyError):
        plan.apply([("unknown", torch.zeros(2))])


def _layout(bucket_bytes: int, first_bucket_bytes: int = 0):
    """The received tensors' layout in buckets (bf16 on the wire), as a sender plans it."""
    from disagg.transport.manifest import TensorSpec, plan_buckets

    specs = [TensorSpec(name, shape, "bfloat16") for name, shape in SHAPES.items()]
    return plan_buckets(specs, bucket_bytes, 1, first_bucket_bytes)


def _bucket_of(manifest, received: dict[str, torch.Tensor], index: int, slot: torch.Tensor) -> torch.Tensor:
    """Bucket ``index`` of ``manifest`` packed into ``slot`` (a receive buffer), as it arrives."""
    plan = manifest.buckets[index]
    for e in plan.entries:
        slot[e.bucket_offset : e.bucket_offset + e.numel] = received[e.name].reshape(-1)[
            e.tensor_offset : e.tensor_offset + e.numel]
    return slot[: plan.numel]


@pytest.mark.parametrize("bucket_bytes, first, tp_rank", [(4096, 0, None), (128, 0, None), (120, 32, None),
                                                          (4096, 0, 0)])  # (tp 2 splitting ``down``: below)
def test_whole_buckets_are_loaded_bit_for_bit_through_two_buffers(bucket_bytes, first, tp_rank) -> None:
    """``BucketReplay``: every bucket of a layout - whole tensors, the parts of split ones, the
    embedding's padding zeroed once its last part landed - copied where the loader put it, from two
    receive buffers taking turns, version after version (the views made per buffer are reused, and
    made again for new buffers)."""
    model = {} if tp_rank is None else {"tp": 2, "tp_rank": tp_rank}
    m, plan = _learned(**model)
    manifest = _layout(bucket_bytes, first)
    split = {e.name for b in manifest.buckets for e in b.entries if e.numel != torch.Size(SHAPES[e.name]).numel()}
    assert (bucket_bytes >= 4096) == (not split) and len(manifest.buckets) >= (1 if not split else 4)
    replay = plan.bucket_replay(manifest)
    assert replay is not None and plan.bucket_replay(manifest) is replay  # made once per layout
    slots = [torch.zeros(max(b.numel for b in manifest.buckets) + 5, dtype=torch.bfloat16) for _ in range(2)]
    for seed in (7, 8, 9):
        if seed == 9:  # buffers made again (a rebuilt group): the views follow them
            slots = [torch.zeros_like(slots[0]) for _ in range(2)]
        m.embed.data.fill_(3.0)
        received = dict(_received(seed))
        completed = [replay.load(b, _bucket_of(manifest, received, b.index, slots[b.index % 2]))
                     for b in manifest.buckets]
        assert sum(completed) == len(SHAPES)
        want = _loaded(seed, **model)
        for name, p in m.named_parameters():
            assert torch.equal(p, getattr(want, name)), (seed, name)
        assert not m.embed[VOCAB:].any()


def test_a_layout_with_a_split_tensor_not_copied_in_runs_or_a_name_unseen_gets_no_bucket_replay() -> None:
    """A row-parallel shard (``down`` of tp 2: a slice of dim 1) split over buckets cannot be copied a
    part at a time, and a name the plan never saw cannot be copied at all: no bucket of the layout
    is loaded whole (the receiver reassembles them, and the loader learns again)."""
    _, plan = _learned(tp=2, tp_rank=1)
    assert "down" not in plan.part_names
    split = _layout(128)
    assert any(e.name == "down" and e.numel < H * FF for b in split.buckets for e in b.entries)
    assert plan.bucket_replay(split) is None
    assert plan.bucket_replay(_layout(4096)) is not None  # ``down`` whole in its bucket: copied as a whole

    from disagg.transport.manifest import TensorSpec, plan_buckets

    _, plan = _learned()
    specs = [TensorSpec(name, shape, "bfloat16") for name, shape in {**SHAPES, "unseen": (4,)}.items()]
    assert plan.bucket_replay(plan_buckets(specs, 4096, 1)) is None
