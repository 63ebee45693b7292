"""The Ray actors of ``disagg bench transport``: trainer ranks and receivers.

A trainer rank holds a random-weight Qwen2 model (FSDP2-sharded over the trainer
ranks when there are several) and sends it; a receiver holds the same
architecture and receives into it. Both sides also hold one flat byte buffer of
the model's size, whose per-parameter views serve the baselines (one raw
broadcast, one broadcast per parameter, the object store), so every baseline
moves exactly the manifest's bytes and shapes without touching the model.

Transport groups follow ``disagg.transport.model_transfer``: source group r has trainer
rank r as its rank 0 and receiver j as rank 1 + j; gather mode uses group 0
only, shards mode one group per trainer rank. The baselines run on group 0.
Each timed loop starts every iteration with a barrier of the groups it uses
and, on CUDA, synchronises the device before reading the clock: an iteration's
time on a rank is the wall time of its own part, and the driver takes the
slowest rank. Under FSDP every trainer rank must enter the full-tensor gathers
in the same order, so a rank that sends nothing still walks the manifest.

Only the benchmark driver uses this module (it wraps the classes with
``ray.remote``); it must never import vLLM or grpc, which the GPU machines lack.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from disagg.logs import setup_logging
from disagg.transport.buckets import bucket_checksum, torch_dtype
from disagg.transport.group import TransportGroup, create_group, pick_free_port
from disagg.transport.manifest import Manifest

log = logging.getLogger("disagg.bench")

# Views into the flat buffer start on this many bytes, so any dtype can view them.
_ALIGN_BYTES = 8


def build_model(shape: str, dtype: torch.dtype, device: torch.device, seed: int) -> torch.nn.Module:
    """A ``Qwen2ForCausalLM`` of ``shape`` on ``device``, every parameter drawn from N(0, 0.02).

    Built on the meta device and materialised in place, so no time goes into
    HF's initialisers. ``to_empty`` unties a tied ``lm_head`` (it makes a new
    tensor per module) and leaves the rotary tables (non-persistent buffers)
    uninitialised, so both are redone on the device.
    """
    from transformers import Qwen2ForCausalLM

    from disagg.bench.shapes import qwen2_config

    cfg = qwen2_config(shape)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg).to(dtype)
    model.to_empty(device=device)
    model.tie_weights()
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=gen)
    with torch.device(device):
        model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg)
    return model


def checksum(t: torch.Tensor) -> tuple[int, int]:
    """(sum, position-weighted sum) of the tensor's bits as integers: equal for bit-identical tensors.

    Integer sums do not depend on reduction order, so a CPU and a GPU copy agree.
    """
    total, weighted = bucket_checksum(t.detach().contiguous()).tolist()
    return total, weighted


def flat_views(manifest: Manifest, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """A view of each manifest tensor's shape and dtype in the uint8 buffer ``flat``, laid out in order."""
    out, offset = {}, 0
    for spec in manifest.tensors:
        out[spec.name] = flat[offset : offset + spec.nbytes].view(torch_dtype(spec.dtype)).view(spec.shape)
        offset += -(-spec.nbytes // _ALIGN_BYTES) * _ALIGN_BYTES
    return out


def flat_bytes(manifest: Manifest) -> int:
    """Size of the buffer ``flat_views`` needs (the manifest's bytes plus alignment)."""
    return sum(-(-t.nbytes // _ALIGN_BYTES) * _ALIGN_BYTES for t in manifest.tensors)


class _Member:
    """What trainer ranks and receivers share: device, manifest, flat buffer, timed loops."""

    def __init__(self, role: str, device: str, dtype: str, num_buffers: int, verify: bool, log_level: str) -> None:
        setup_logging(role, log_level, actor=True)
        self.device = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
        self.dtype = torch_dtype(dtype)
        self.num_buffers, self.verify = num_buffers, verify
        self.manifest: Manifest | None = None
        self.flat: torch.Tensor | None = None
        self.views: dict[str, torch.Tensor] = {}
        self.model: torch.nn.Module | None = None

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def free_port(self) -> int:
        return pick_free_port(self.node_ip())

    def _join(self, source_rank: int, rank: int, *, host: str, port: int, world_size: int, backend: str,
              timeout_s: float) -> TransportGroup:
        return create_group(host=host, port=port, rank=rank, world_size=world_size, backend=backend,
                            timeout_s=timeout_s, group_name=f"bench-s{source_rank}", device=self.device)

    def set_manifest(self, manifest: dict) -> None:
        self.manifest = Manifest.from_dict(manifest)

    def prepare_baselines(self, fill: bool) -> None:
        """Allocate the flat buffer (random bytes when ``fill``: the sender never sends zeros) and its views."""
        assert self.manifest is not None
        self.flat = torch.empty(flat_bytes(self.manifest), dtype=torch.uint8, device=self.device)
        if fill:
            self.flat.random_(0, 256)
        self.views = flat_views(self.manifest, self.flat)

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _timed(self, groups: list[TransportGroup], op: Callable[[], None], iterations: int) -> list[float]:
        """Run ``op`` ``iterations`` times, each after a barrier of each of ``groups``; the seconds of each."""
        from disagg.transport.group import timed_ops

        return timed_ops(groups, op, iterations, self.device)

    def _raw(self, group: TransportGroup) -> None:
        assert self.manifest is not None and self.flat is not None
        group.broadcast(self.flat[: self.manifest.total_bytes], src=0)

    def _per_param(self, group: TransportGroup) -> None:
        for view in self.views.values():
            group.broadcast(view, src=0)


class BenchTrainer(_Member):
    """Trainer rank ``rank`` of ``num_ranks``: the model's owner and a sender.

    It is rank 0 of its own source group when the source mode uses one group per
    trainer rank (shards), or when it is trainer rank 0; else it has no group.
    """

    def __init__(self, rank: int, num_ranks: int, *, shape: str, device: str, dtype: str, source: str,
                 num_buffers: int, verify: bool, timeout_s: float, log_level: str) -> None:
        super().__init__(f"trainer:{rank}", device, dtype, num_buffers, verify, log_level)
        self.rank, self.num_ranks = rank, num_ranks
        self.shape, self.source, self.timeout_s = shape, source, timeout_s
        self.group: TransportGroup | None = None
        self.sender = None
        self.params: dict[str, torch.Tensor] | None = None

    def setup(self, master_addr: str | None, master_port: int | None) -> dict[str, Any]:
        """Build the model (the same seed on every rank) and shard it when there are several ranks."""
        if self.num_ranks > 1:
            import torch.distributed as dist

            backend = "nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=self.rank,
                                    world_size=self.num_ranks, timeout=timedelta(seconds=self.timeout_s))
        t0 = time.perf_counter()
        model = build_model(self.shape, self.dtype, self.device, seed=1)
        if self.num_ranks > 1:
            from torch.distributed.fsdp import fully_shard

            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
        else:
            # As the trainer does: parameters in one flat buffer, so buckets go out without packing.
            from disagg.transport.buckets import flatten_parameters

            flatten_parameters(model)
        self.model = model
        return {"build_s": time.perf_counter() - t0, **self._environment()}

    def _environment(self) -> dict[str, Any]:
        import transformers

        env = {"torch": torch.__version__, "transformers": transformers.__version__,
               "torch_threads": torch.get_num_threads(), "nccl": None, "gpu": None}
        if self.device.type == "cuda":
            version = torch.cuda.nccl.version()  # a tuple on recent torch, an int on old ones
            env["nccl"] = ".".join(str(x) for x in version) if isinstance(version, tuple) else str(version)
            env["gpu"] = torch.cuda.get_device_name(self.device)
        return env

    def build_manifest(self, bucket_bytes: int) -> dict:
        """The full-tensor manifest of the model (global shapes under FSDP; no data is read)."""
        from disagg.transport.model_transfer import model_manifest

        return model_manifest(self.model, bucket_bytes, policy_version=1, dtype=None).to_dict()

    def join(self, **kw: Any) -> None:
        """Join this rank's source group as its rank 0, hosting its store."""
        from disagg.transport.sender import WeightSender

        self.group = self._join(self.rank, 0, **kw)
        # One sender for every sync, as the trainer keeps one: its bucket buffers persist.
        self.sender = WeightSender(self.group, 0, self.num_buffers, self.verify, device=self.device)

    def _send(self) -> None:
        from disagg.transport.model_transfer import send_model

        if self.params is None:  # as the trainer does: made once, parameters updated in place
            self.params = dict(self.model.named_parameters())
        send_model(self.group, self.model, self.manifest, source=self.source, trainer_rank=self.rank,
                   num_trainer_ranks=self.num_ranks, num_buffers=self.num_buffers, verify=self.verify,
                   sender=self.sender, params=self.params)

    def measure(self, kind: str, iterations: int) -> dict[str, Any]:
        """Time ``kind`` (raw, per_param, send, send_load) ``iterations`` times from this rank's side.

        ``seconds`` is None on a rank without a group (a gather-mode rank > 0,
        which only takes part in the gathers). ``peak_extra_bytes`` (CUDA only)
        is, per iteration, the most device memory the send allocated beyond what
        was held before it; the sender's bucket buffers count in the first sync only.
        """
        if kind == "raw":
            return {"seconds": self._timed([self.group], lambda: self._raw(self.group), iterations)}
        if kind == "per_param":
            return {"seconds": self._timed([self.group], lambda: self._per_param(self.group), iterations)}
        assert kind in ("send", "send_load"), kind
        peaks: list[int] = []

        def send() -> None:
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
                before = torch.cuda.memory_allocated(self.device)
                self._send()
                peaks.append(torch.cuda.max_memory_allocated(self.device) - before)
            else:
                self._send()

        groups = [self.group] if self.group is not None else []
        seconds = self._timed(groups, send, iterations)
        return {"seconds": seconds if groups else None, "peak_extra_bytes": peaks or None}

    def put_params(self, names: list[str]) -> list:
        """Rank 0: copy the named tensors to host memory and ``ray.put`` them; the ref inside a list.

        The list keeps Ray from resolving the ref when it is handed on: the driver
        passes it to the receivers, which ``ray.get`` it themselves.
        """
        import ray

        # copy=True: a CPU view would otherwise be pickled with its whole underlying buffer.
        return [ray.put({n: self.views[n].to("cpu", copy=True) for n in names})]

    def checksums(self) -> dict[str, tuple[int, int]] | None:
        """Rank 0: the checksum of every full tensor. Under FSDP every rank must call this (gathers)."""
        assert self.manifest is not None and self.model is not None
        params = dict(self.model.named_parameters())
        sums = {}
        with torch.no_grad():
            for spec in self.manifest.tensors:  # the same order on every rank: full_tensor() is a collective
                t = params[spec.name].detach()
                full = t.full_tensor() if hasattr(t, "full_tensor") else t
                if self.rank == 0:
                    sums[spec.name] = checksum(full)
        return sums if self.rank == 0 else None

    def close(self) -> None:
        if self.group is not None:
            self.group.destroy()
        if self.num_ranks > 1:
            import torch.distributed as dist

            dist.destroy_process_group()


def _discard(tensors: list[tuple[str, torch.Tensor]]) -> None:
    """A load function that loads nothing (measures the wire and the reassembly alone)."""


class BenchReceiver(_Member):
    """Receiver ``index``: the same architecture, loaded through ``TorchModelReceiver``.

    It is rank ``1 + index`` of every source group (one per sending trainer rank).
    """

    def __init__(self, index: int, *, shape: str, device: str, dtype: str, source: str, num_buffers: int,
                 verify: bool, log_level: str) -> None:
        super().__init__(f"receiver:{index}", device, dtype, num_buffers, verify, log_level)
        self.index, self.shape, self.source = index, shape, source
        self.groups: list[TransportGroup] = []

    def setup(self) -> dict[str, Any]:
        """Build the model with other random values than the trainer's, so a check proves the load."""
        t0 = time.perf_counter()
        self.model = build_model(self.shape, self.dtype, self.device, seed=1000 + self.index).requires_grad_(False)
        return {"build_s": time.perf_counter() - t0}

    def join(self, source_rank: int, **kw: Any) -> None:
        """Join source group ``source_rank`` (groups must be joined in order 0, 1, ...)."""
        assert source_rank == len(self.groups), (source_rank, len(self.groups))
        self.groups.append(self._join(source_rank, 1 + self.index, **kw))

    def _receive(self, load: bool) -> None:
        from disagg.transport.receiver import TorchModelReceiver
        from disagg.transport.model_transfer import receive_model

        load_fn = TorchModelReceiver.load_into_module(self.model) if load else _discard
        receive_model(self.groups, self.manifest, load_fn, device=self.device, source=self.source,
                      num_buffers=self.num_buffers, verify=self.verify)

    def measure(self, kind: str, iterations: int) -> dict[str, Any]:
        """Time ``kind`` ``iterations`` times from this receiver's side (see ``BenchTrainer.measure``)."""
        base = self.groups[0]
        ops: dict[str, tuple[list[TransportGroup], Callable[[], None]]] = {
            "raw": ([base], lambda: self._raw(base)),
            "per_param": ([base], lambda: self._per_param(base)),
            "send": (self.groups, lambda: self._receive(load=False)),
            "send_load": (self.groups, lambda: self._receive(load=True)),
        }
        groups, op = ops[kind]
        return {"seconds": self._timed(groups, op, iterations)}

    def fetch(self, refs: list, names: list[str], timeout_s: float) -> None:
        """Take the object-store copy of ``names`` and copy it onto this receiver's device."""
        import ray

        tensors = ray.get(refs[0], timeout=timeout_s)
        for n in names:
            self.views[n].copy_(tensors[n])
        self._synchronize()

    def checksums(self) -> dict[str, tuple[int, int]]:
        """The checksum of every model entry the manifest names, read from the model's state dict."""
        assert self.manifest is not None and self.model is not None
        state = self.model.state_dict()
        return {t.name: checksum(state[t.name]) for t in self.manifest.tensors if t.name in state}

    def unloaded_entries(self) -> list[str]:
        """State-dict entries the manifest does not carry and that share no storage with one it does."""
        assert self.manifest is not None and self.model is not None
        state = self.model.state_dict()
        carried = {state[t.name].data_ptr() for t in self.manifest.tensors if t.name in state}
        names = {t.name for t in self.manifest.tensors}
        return sorted(n for n, t in state.items() if n not in names and t.data_ptr() not in carried)

    def close(self) -> None:
        for g in self.groups:
            g.destroy()
