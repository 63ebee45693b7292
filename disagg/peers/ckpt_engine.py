"""``disagg bench vllm-sync --peer checkpoint-engine``: MoonshotAI's checkpoint-engine 0.4.2 moving the
trainer's weights into the same vLLM engine, as its users drive it each RL step.

checkpoint-engine's ``ParameterServer`` runs one rank per GPU. Every step its user registers the
step's weights (a copy into its pinned host memory), gathers the ranks' metadata and calls
``update``: each bucket goes host -> GPU on the rank that owns it, is broadcast over NCCL to every
rank, and each rank hands it to the inference worker on its own GPU by CUDA IPC, stepping that
worker through a zmq REQ/REP exchange (``worker.update_weights_from_ipc``), which loads it with
vLLM's ``load_weights`` and ends with ``process_weights_after_loading``.

How this module places it, from 0.4.2's source (``ps.py``, ``worker.py``):

- **Ranks.** Rank 0 is in the trainer worker's process (GPU 0) and owns the weights: it registers
  the trainer's parameters, cast to the transport dtype. Rank ``1 + i`` is in engine actor ``i``'s
  process, on that engine's GPU: vLLM's worker lives in the actor's EngineCore child, a different
  process on the same GPU, which is what CUDA IPC needs. So one engine worker per engine
  (``tensor_parallel_size=1``) and one trainer worker (``ps_ranks``). Each process must see
  exactly one GPU: the ParameterServer takes ``rank % gpu_count`` as its device. Rank, world
  size, master address and port are explicit; 0.4.2 reads a rank of 0 (falsy) from ``RANK``
  anyway, so ``RANK`` is set only while it is constructed.
- **Rank 0's sink.** ``update`` with ``ranks=None`` (a broadcast; ``ranks=[...]`` needs Mooncake
  RDMA) binds a zmq REQ socket on every rank and waits, with no timeout of its own, for an
  inference worker on that rank's GPU to answer: the buffer's IPC handle, one reply per bucket,
  then two ``None`` (release, then the post hook). GPU 0 has no inference worker, so rank 0's
  request function answers the exchange itself (``sink``). It cannot use ``update_weights_from_ipc``:
  that opens the IPC handle, and CUDA refuses to open a handle in the process that exported it
  (torch's same-process cache misses: the exporter caches by handle, the importer looks up by
  handle and offset). The sink releases the handle's IPC reference count instead, as torch does
  for a receive in the exporting process; otherwise each update's buffer (two buckets) would stay
  in torch's IPC limbo on GPU 0.
- **Default process group.** The ParameterServer's collectives run on torch's default group. It
  is made once, at ``ParameterServerRank``'s construction (``auto_pg=False``, not timed, like
  vLLM's NCCL group for the other peer) and kept: with ``auto_pg=True`` every update would also
  create and destroy an NCCL communicator, a cost that is not its transfer. The trainer worker
  (one worker) and the engine actor hold no default group; if one exists this refuses to start.
- **GPU memory.** ``update`` sizes its buckets from ``mem_fraction`` of the smallest free GPU
  memory over the ranks (0.9 by default) and allocates three buckets on every rank. vLLM holds
  ``gpu_memory_utilization`` of the engine's GPU (0.85 in ``cluster=gpu``), so the free memory
  there is small and shared with NCCL and the caching allocators: ``MEM_FRACTION`` = 0.5 leaves
  half of it alone.
- **Every wait is bounded.** By ``transport.timeout_s``: the default group's collectives (NCCL's
  watchdog ends the process when one times out), the zmq sockets (RCVTIMEO/SNDTIMEO as the
  default options of the ParameterServer's zmq context, ``_zmq_ctx`` in 0.4.2, and of the
  worker's and the sink's) and the engine actor's wait on its worker. By 0.4.2's own constants:
  the TCPStore's rendezvous (10 minutes) and ``update``'s closing barrier (5 minutes); the
  bench's ``ray.get`` (``transport.timeout_s`` + 30 s) fails sooner. An error on one side ends
  the other's exchange with an error too, within those bounds.
- **Pinned memory.** Checkpoints go into the ParameterServer's shared pinned pool
  (``use_shared_memory_pool``): each step's register copies into the same host memory, as an RL
  loop would; the first register allocates it (a warm-up iteration).

What the bench times per iteration: ``register`` (cast and copy into the pinned pool, on the
trainer), then, from the driver's dispatch until every rank is done, ``gather_metas`` and
``update`` on every rank, vLLM's worker loading each bucket and post-processing.

checkpoint_engine is imported inside functions only: nothing imports it unless this peer is asked
for. This module must never be imported by disagg's own sync path.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

from disagg.errors import TransportError

log = logging.getLogger("disagg.bench.ckpt_engine")

VERSION = "0.4.2"
WHEEL = f"checkpoint_engine-{VERSION}-py3-none-any.whl"
MEM_FRACTION = 0.5  # of the free GPU memory, for the ParameterServer's buckets (three on every rank)


def checkpoint_engine():
    """The checkpoint_engine package, or an ImportError that says how to carry it."""
    try:
        import checkpoint_engine as ce
    except ImportError as e:
        raise ImportError(
            f"--peer checkpoint-engine needs checkpoint-engine {VERSION} in every process of the job ({e}). "
            f"It is a pure-Python wheel, {WHEEL} (`pip download checkpoint-engine=={VERSION} --no-deps`): carry "
            f"it to the GPU machine and unpack it onto the PYTHONPATH that Ray's workers inherit, e.g. "
            f"`unzip -q -o {WHEEL} -d /tmp/site` beside the vLLM bundle. It imports pyzmq, loguru, fastapi, "
            "pydantic, httpx, safetensors and numpy (the vLLM bundle and the GPU image hold them).") from e
    if ce.__version__ != VERSION:
        raise ImportError(f"--peer checkpoint-engine is written against checkpoint-engine {VERSION}'s internals "
                          f"(its zmq exchange, ParameterServer._zmq_ctx); found {ce.__version__}")
    return ce


def ps_ranks(num_engines: int, tensor_parallel_size: int, num_trainer_workers: int) -> tuple[int, list[int]]:
    """(world size, each engine's ParameterServer rank): the trainer is rank 0, engine ``i`` rank ``1 + i``.
    Pure; a ValueError names what cannot be placed."""
    if num_trainer_workers != 1:
        raise ValueError(f"--peer checkpoint-engine: trainer.num_workers={num_trainer_workers}: its rank 0 takes the "
                         "trainer process's default process group, which FSDP's ranks hold; use one trainer worker")
    if tensor_parallel_size != 1:
        raise ValueError(f"--peer checkpoint-engine: rollout.tensor_parallel_size={tensor_parallel_size}: one "
                         "ParameterServer rank per engine actor serves one GPU; use tensor_parallel_size=1")
    if num_engines < 1:
        raise ValueError("--peer checkpoint-engine: no engine to update")
    return 1 + num_engines, [1 + i for i in range(num_engines)]


def device_uuid(index: int) -> str:
    """The id the ParameterServer keys its zmq sockets by (``ps._get_physical_gpu_id`` on CUDA)."""
    import torch

    return f"GPU-{torch.cuda.get_device_properties(index).uuid}"


def _bound(ctx, timeout_s: float):
    """``ctx`` (a zmq Context) with every socket it makes from now on failing a wait after ``timeout_s``."""
    import zmq

    for opt, value in ((zmq.RCVTIMEO, int(timeout_s * 1000)), (zmq.SNDTIMEO, int(timeout_s * 1000)),
                       (zmq.LINGER, 0)):
        ctx.setsockopt(opt, value)
    return ctx


@contextlib.contextmanager
def _environ(**values: str):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class ParameterServerRank:
    """One ParameterServer rank in this process, on its one visible GPU, with the default group made."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float):
        import torch
        import torch.distributed

        ce = checkpoint_engine()
        if torch.distributed.is_initialized():
            raise RuntimeError(f"checkpoint-engine rank {rank}: this process already has a default process group, "
                               "which the ParameterServer's collectives need for themselves")
        if torch.cuda.device_count() != 1:
            raise RuntimeError(f"checkpoint-engine rank {rank}: this process sees {torch.cuda.device_count()} GPUs; "
                               "the ParameterServer picks rank % gpu_count, so it must see exactly one")
        self.rank, self.timeout_s = rank, timeout_s
        with _environ(RANK=str(rank)):  # 0.4.2: `rank or int(os.environ["RANK"])`
            self.ps = ce.ParameterServer(rank=rank, world_size=world_size, auto_pg=False, gpu_count=1,
                                         mem_fraction=MEM_FRACTION, master_addr=host, master_port=port)
        _bound(self.ps._zmq_ctx, timeout_s)
        self.ps.init_process_group(timeout=timedelta(seconds=timeout_s))
        self.device_uuid = device_uuid(torch.cuda.current_device())
        self._registered: str | None = None
        log.info("checkpoint-engine rank %d/%d on %s (store %s:%d)", rank, world_size, self.device_uuid, host, port)

    def register(self, name: str, named_tensors: Iterable[tuple[str, Any]], dtype) -> float:
        """Register ``named_tensors`` cast to ``dtype`` as checkpoint ``name`` (rank 0, the owner), in place
        of the last one, into the shared pinned pool; the seconds, cast included."""
        assert self.rank == 0, "only rank 0 owns the weights"
        t0 = time.perf_counter()
        if self._registered is not None:
            self.ps.unregister_checkpoint(self._registered)  # the shared pool keeps its pinned memory
            self._registered = None
        self.ps.register_checkpoint(name, named_tensors={n: t.to(dtype) for n, t in named_tensors},
                                    use_shared_memory_pool=True)
        self._registered = name
        return time.perf_counter() - t0

    def update(self, name: str, call_worker: Callable[[dict[str, str]], dict[str, float]] | None = None
               ) -> dict[str, float]:
        """``gather_metas`` and ``update`` of checkpoint ``name`` on this rank (every rank in lockstep).
        ``call_worker(zmq handles by GPU id)`` makes the inference worker on this GPU take the update and
        returns its figures; None: this GPU has none (rank 0), the sink answers. The seconds of each."""
        import zmq

        out: dict[str, float] = {}
        failed: list[BaseException] = []

        def req_func(socket_paths: list[tuple[str, str]]) -> None:
            # On the ParameterServer's own thread, where an exception would end with the thread.
            handles = dict(socket_paths)
            try:
                if call_worker is None:
                    sink(handles[self.device_uuid], self.timeout_s)
                else:
                    out.update(call_worker(handles))
            except BaseException as e:  # noqa: BLE001 - raised again below, on the caller's thread
                failed.append(e)

        t0 = time.perf_counter()
        self.ps.gather_metas(name)
        t1 = time.perf_counter()
        try:
            self.ps.update(name, req_func, timeout=timedelta(seconds=self.timeout_s))
        except zmq.ZMQError as e:
            if not failed:  # else the inference side's own error, below, is the cause
                raise TransportError(f"checkpoint-engine rank {self.rank}: the exchange with the inference side "
                                     f"failed ({e}; waits end after {self.timeout_s:.0f}s)") from e
        except Exception:
            if not failed:
                raise
        if failed:
            raise TransportError(f"checkpoint-engine rank {self.rank}: the inference side failed: "
                                 f"{failed[0]!r}") from failed[0]
        out.update(gather_s=t1 - t0, update_s=time.perf_counter() - t1)
        return out


def sink(handle: str, timeout_s: float) -> None:
    """Answer a ParameterServer rank's exchange on ``handle`` as ``update_weights_from_ipc`` does, loading
    nothing and never opening the buffer's CUDA IPC handle (rank 0: no inference worker on its GPU)."""
    import zmq

    ctx = _bound(zmq.Context(), timeout_s)
    sock = ctx.socket(zmq.REP)
    try:
        sock.connect(handle)
        func, args = sock.recv_pyobj()  # the buffer's IPC handle: (torch's rebuild_cuda_tensor, its arguments)
        sock.send(b"")
        released = False
        while True:
            payload = sock.recv_pyobj()  # a bucket's tensor list, None (release), None (post hook), an Exception
            if isinstance(payload, Exception):  # the ParameterServer gives up (another rank failed)
                raise payload
            if released:
                if payload is not None:
                    raise TransportError(f"checkpoint-engine sink: {type(payload).__name__} after the release")
                sock.send(b"")
                return
            if payload is None:  # the ParameterServer frees the buffer once this is answered
                _release_ipc_reference(func, args)
                released = True
            sock.send(b"")
    except zmq.ZMQError as e:
        raise TransportError(f"checkpoint-engine sink: the exchange with the ParameterServer failed ({e}; waits "
                             f"end after {timeout_s:.0f}s)") from e
    finally:
        ctx.destroy(linger=0)


def _release_ipc_reference(func, args) -> None:
    """Drop the reference torch counted for the receiver of a CUDA IPC handle, as ``rebuild_cuda_tensor``
    does for a handle whose storage is in the receiving process already."""
    assert getattr(func, "__name__", "") == "rebuild_cuda_tensor", func
    storage_cls, device, ref_counter_handle, ref_counter_offset = args[4], args[6], args[11], args[12]
    storage_cls._release_ipc_counter(ref_counter_handle, ref_counter_offset, device=device)


def worker_receive(handles: dict[str, str], device_index: int, load: Callable[[list], Any],
                   post_hook: Callable[[], Any], timeout_s: float) -> dict[str, float]:
    """vLLM's worker side of one update (called in the worker's process by ``DisaggWorkerExtension``):
    checkpoint-engine's ``update_weights_from_ipc`` on the handle of this GPU, ``load`` for each bucket's
    tensors (views of the shared buffer), ``post_hook`` at the end. Seconds: all, loads, post hook."""
    import torch
    import zmq

    ce = checkpoint_engine()
    times = {"worker_load_s": 0.0, "worker_post_s": 0.0}
    failed: list[BaseException] = []  # update_weights_from_ipc sends a load's error to the ParameterServer only

    def run(weights: list) -> None:
        t0 = time.perf_counter()
        try:
            load(weights)
        except BaseException as e:
            failed.append(e)
            raise
        torch.cuda.synchronize()  # update_weights_from_ipc synchronises next anyway: the copies counted here
        times["worker_load_s"] += time.perf_counter() - t0

    def post() -> None:
        t0 = time.perf_counter()
        post_hook()
        times["worker_post_s"] += time.perf_counter() - t0

    ctx = _bound(zmq.Context(), timeout_s)
    t0 = time.perf_counter()
    try:
        ce.update_weights_from_ipc(ctx, handles[device_uuid(device_index)], device_index, run=run, post_hook=post)
    except zmq.ZMQError as e:  # a wait past timeout_s (zmq.Again), or the exchange out of step after one
        raise TransportError(f"checkpoint-engine worker: the exchange with the ParameterServer failed ({e}; "
                             f"waits end after {timeout_s:.0f}s)") from e
    except Exception as e:
        if failed:  # the ParameterServer's "Some workers failed" names no cause: this one is it
            raise TransportError(f"checkpoint-engine worker: loading a bucket failed: {failed[0]!r}") from failed[0]
        raise
    finally:
        ctx.destroy(linger=0)  # closes what update_weights_from_ipc leaves open when it fails early
    times["worker_receive_s"] = time.perf_counter() - t0
    return times
