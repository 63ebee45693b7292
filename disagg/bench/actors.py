"""The benchmarks' actors: the production engine actor and trainer worker with the routes only a
benchmark takes - a raw broadcast over the transport group (the rate the hardware gives), the load
and in-flight modes set between runs, profiler traces of the next sync, the trainer's buckets
re-planned or its next push forced dense or delta, and vLLM's own NCCL weight-transfer engine and
MoonshotAI's checkpoint-engine driven beside disagg's (``disagg bench vllm-sync``, ``disagg bench
pipeline``). A benchmark hands these classes to ``Job.start`` (``engine_cls``, ``trainer_cls``); a
training run's actors never carry these routes, and nothing outside ``disagg/bench/`` imports this
module."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import torch

from disagg.errors import TransportError
from disagg.logs import ray_get_logged
from disagg.rollout.engine import EngineActor
from disagg.trainer.worker import TrainerWorker

log = logging.getLogger("disagg.bench")


class BenchEngineActor(EngineActor):
    """``EngineActor`` with the benchmarks' routes into vLLM's worker."""

    async def set_load_mode(self, mode: str) -> str:
        """``disagg bench vllm-sync``: load the next versions with ``mode`` (``transport.load``)."""
        return (await self._engine.worker_call("disagg_set_load_mode", mode))[0]

    async def set_in_flight_mode(self, requested: str, timeout_s: float = 60.0) -> str:
        """``disagg bench pipeline``'s keep / resubmit runs: what a sync does with requests in flight from
        now on (``rollout.in_flight_at_sync``, resolved for this vLLM as at start). Only between runs:
        waits up to ``timeout_s`` for this actor's requests to finish (a run's leftovers being
        cancelled), then refuses. Returns the mode now in force."""
        if requested not in ("auto", "keep", "resubmit"):
            raise ValueError(f"rollout.in_flight_at_sync must be auto, keep or resubmit, got {requested!r}")
        deadline = time.monotonic() + timeout_s
        while self._active or self._live or self._paused:
            if time.monotonic() > deadline:
                raise RuntimeError(f"engine {self.engine_id}: in-flight mode not changed to {requested!r}: "
                                   f"{self._active} requests still in flight after {timeout_s:.0f}s")
            await asyncio.sleep(0.05)
        self._mode = self._resolve_in_flight_mode(requested)
        return self._mode

    async def trace_next_sync(self, path: str) -> list[str]:
        """``disagg bench vllm-sync --trace``: the next sync's part in each vLLM worker runs under
        ``torch.profiler``, written beside ``path`` (one file per worker, its rank in the name);
        those files' paths."""
        return list(await self._engine.worker_call("disagg_trace_next_sync", path))

    async def peer_init(self, init_info: dict[str, Any]) -> None:
        """``disagg bench vllm-sync --peer vllm-nccl``: vLLM's own NCCL engine joins a group with the trainer."""
        await self._engine.worker_call("disagg_peer_init", init_info)

    async def peer_use(self, name: str) -> None:
        """The weight-transfer engine vLLM's start / update / finish go to from now on: "vllm-nccl" (the
        peer's block) or "disagg"."""
        await self._engine.worker_call("disagg_peer_use", name)

    async def peer_receive(self, update_info: dict[str, Any]) -> None:
        """A weight update through vLLM's own NCCL engine (after ``peer_use("vllm-nccl")``), as its users
        make one: ``AsyncLLM``'s start, update and finish (each a call into the worker; vLLM's layerwise
        reload)."""
        await self._engine.peer_weight_update(update_info)

    async def ckpt_init(self, host: str, port: int, rank: int, world_size: int) -> None:
        """``disagg bench vllm-sync --peer checkpoint-engine``: a ParameterServer rank in this actor's process,
        on the engine's GPU (``disagg.peers.ckpt_engine``); its rendezvous runs off the event loop."""
        from disagg.peers.ckpt_engine import ParameterServerRank

        self._ckpt = await asyncio.to_thread(ParameterServerRank, host, port, rank, world_size,
                                             self.transport_cfg.timeout_s)

    async def ckpt_receive(self, name: str) -> dict[str, float]:
        """One update of checkpoint ``name``: the rank's gather and update on a thread; the update, once its
        socket is bound, has vLLM's worker take the buckets (``disagg_ckpt_receive``). The figures."""
        loop, timeout_s = asyncio.get_running_loop(), self.transport_cfg.timeout_s

        def call_worker(handles: dict[str, str]) -> dict[str, float]:
            rpc = self._engine.worker_call("disagg_ckpt_receive", handles, timeout_s)
            return asyncio.run_coroutine_threadsafe(rpc, loop).result(timeout_s)[0]

        return await asyncio.to_thread(self._ckpt.update, name, call_worker)

    async def raw_receive(self, nbytes: int, repeats: int) -> list[float]:
        """``disagg bench vllm-sync``: the worker's side of ``repeats`` raw broadcasts of ``nbytes``."""
        return (await self._engine.worker_call("disagg_raw_receive", nbytes, repeats))[0]


class BenchTrainerWorker(TrainerWorker):
    """``TrainerWorker`` with the benchmarks' raw broadcast, push controls and peer routes."""

    def raw_send(self, nbytes: int, repeats: int) -> list[float]:
        """``disagg bench vllm-sync``: ``repeats`` raw broadcasts of ``nbytes`` on this rank's transport group
        (every receiver calls ``raw_receive``); each one's seconds."""
        from disagg.transport.group import timed_raw_broadcasts

        if self.group is None:
            raise RuntimeError("raw_send: this trainer rank has no transport group (init_transport first)")
        return timed_raw_broadcasts(self.group, nbytes, repeats, self.device)

    def trace_next_push(self, path: str) -> None:
        """``disagg bench vllm-sync --trace``: the next push runs under ``torch.profiler`` (host and, on a
        GPU, device activity) and is written to ``path`` as a Chrome trace: where its time goes, step by
        step (``TrainerPush.push_weights``)."""
        self._trace_path = path

    def replan_buckets(self, first_bucket_bytes: int) -> int:
        """``disagg bench vllm-sync --first-buckets``: lay the next pushes' buckets out with
        ``transport.first_bucket_bytes`` = ``first_bucket_bytes`` (0: no ramp), side by side with another
        layout in one run; the new layout's bucket count. The engines take its manifest at its first sync
        (a new layout digest), and a delta image holds nothing of it."""
        import dataclasses

        self.transport_cfg = dataclasses.replace(self.transport_cfg, first_bucket_bytes=first_bucket_bytes)
        self._manifest_cache.forget()
        self._push_manifest_cache.forget()
        if self.delta_image is not None:
            self.delta_image.invalidate()
        return len(self._layout().buckets)

    def next_push_as(self, kind: str) -> None:
        """``disagg bench vllm-sync --delta``: the next push goes ``dense`` or as a ``delta`` (against the
        version the engines hold; dense where they hold none) whatever ``transport.delta`` would choose: a
        delta job's dense baseline, side by side with its deltas (``TrainerPush._push_kind``)."""
        if kind not in ("dense", "delta"):
            raise ValueError(f"next_push_as: kind must be 'dense' or 'delta', got {kind!r}")
        if self.delta_image is None:
            raise ValueError(f"next_push_as({kind!r}) needs transport.delta=on or auto, got "
                             f"transport.delta={self.transport_cfg.delta!r}")
        self._next_kind = kind

    def peer_init(self, host: str, port: int, world_size: int) -> None:
        """``disagg bench vllm-sync --peer vllm-nccl``: vLLM's own NCCL group with the engines (rank 0)."""
        from disagg.rollout.vllm.transfer import peer_trainer_init

        self._peer = peer_trainer_init(host, port, world_size)

    def _peer_dtype(self, p: torch.Tensor) -> torch.dtype:
        """The dtype ``p`` goes out in to a peer: ``transport.dtype``, else its own."""
        from disagg.transport.buckets import torch_dtype

        return torch_dtype(self.transport_cfg.dtype) if self.transport_cfg.dtype else p.dtype

    def peer_send(self) -> dict[str, Any]:
        """Send the parameters (in ``transport.dtype``) through vLLM's own NCCL engine; the send's seconds."""
        from disagg.rollout.vllm.transfer import peer_trainer_send

        params = [(n, p.detach()) for n, p in self.model.named_parameters()]
        t0 = time.perf_counter()
        peer_trainer_send(self._peer, params, self._peer_dtype(params[0][1]))
        return {"send_s": time.perf_counter() - t0}

    def peer_update_info(self) -> dict[str, Any]:
        """vLLM's update info for ``peer_send``'s tensors: names, dtypes, shapes (packed, its default buffers)."""
        from disagg.transport.buckets import dtype_name

        params = list(self.model.named_parameters())
        return {"names": [n for n, _ in params], "dtype_names": [dtype_name(self._peer_dtype(p)) for _, p in params],
                "shapes": [list(p.shape) for _, p in params], "packed": True}

    def ckpt_init(self, host: str, port: int, world_size: int) -> None:
        """``disagg bench vllm-sync --peer checkpoint-engine``: its ParameterServer's rank 0 in this process,
        the owner of the weights (``disagg.peers.ckpt_engine``)."""
        from disagg.peers.ckpt_engine import ParameterServerRank

        self._ckpt = ParameterServerRank(host, port, 0, world_size, self.transport_cfg.timeout_s)

    def ckpt_register(self, name: str) -> float:
        """Register the parameters (in ``transport.dtype``) as checkpoint ``name``; the seconds."""
        params = [(n, p.detach()) for n, p in self.model.named_parameters()]
        return self._ckpt.register(name, params, self._peer_dtype(params[0][1]))

    def ckpt_update(self, name: str) -> dict[str, float]:
        """Rank 0's gather and update of checkpoint ``name`` (no inference worker on this GPU); the seconds."""
        return self._ckpt.update(name)


def replan_buckets(job, first_bucket_bytes: int) -> int:
    """The trainer's next pushes go out in buckets that ramp from ``first_bucket_bytes`` (0: none;
    ``BenchTrainerWorker.replan_buckets`` on every rank): a new layout, whose manifest the next announce
    carries. Not with a sync armed. The new layout's bucket count (trainer rank 0's)."""
    if job.armed is not None:
        raise TransportError(f"replan_buckets: a receive of version {job.armed.policy_version} is armed")
    trainer = job.trainer
    counts = ray_get_logged([trainer.transport_method(w, "replan_buckets").remote(first_bucket_bytes)
                             for w in range(len(trainer.workers))], what="re-planning the buckets",
                            timeout_s=job.cfg.transport.timeout_s, log=log)
    job.weights.forget_manifest()
    return counts[0]
