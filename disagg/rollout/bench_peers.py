"""The engine actor's side of the benchmarks' other routes into vLLM: a raw broadcast over its
transport group, the load mode, parameter checksums, vLLM's own NCCL weight-transfer engine and
checkpoint-engine (``disagg bench vllm-sync``, the GPU tests), what a sync does with requests in
flight (``disagg bench pipeline``'s keep / resubmit runs). A part of ``EngineActor``; never on a
training run's path."""

from __future__ import annotations

import asyncio
import time
from typing import Any


class EnginePeers:
    """``EngineActor``'s benchmark and inspection routes into vLLM's worker."""

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

    async def param_checksums(self) -> dict[str, list[int]]:
        """Worker 0's bit checksum of each vLLM parameter (``disagg_param_checksums``)."""
        return (await self._engine.worker_call("disagg_param_checksums"))[0]

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
