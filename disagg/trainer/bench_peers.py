"""The trainer worker's side of the benchmarks' other routes into the engines: a raw broadcast over
its own transport group (the rate the hardware gives), vLLM's own NCCL weight-transfer engine and
checkpoint-engine (``disagg bench vllm-sync --peer``). A part of ``TrainerWorker``; never on a
training run's path."""

from __future__ import annotations

import time
from typing import Any

import torch


class TrainerPeers:
    """``TrainerWorker``'s raw broadcast and peer routes (benchmarks only)."""

    def raw_send(self, nbytes: int, repeats: int) -> list[float]:
        """``disagg bench vllm-sync``: ``repeats`` raw broadcasts of ``nbytes`` on this rank's transport group
        (every receiver calls ``raw_receive``); each one's seconds."""
        from disagg.transport.group import timed_raw_broadcasts

        if self.group is None:
            raise RuntimeError("raw_send: this trainer rank has no transport group (init_transport first)")
        return timed_raw_broadcasts(self.group, nbytes, repeats, self.device)

    def peer_init(self, host: str, port: int, world_size: int) -> None:
        """``disagg bench vllm-sync --peer vllm-nccl``: vLLM's own NCCL group with the engines (rank 0)."""
        from disagg.rollout.vllm.transfer import peer_trainer_init

        self._peer = peer_trainer_init(host, port, world_size)

    def _peer_dtype(self, p: torch.Tensor) -> torch.dtype:
        """The dtype ``p`` goes out in: ``transport.dtype``, else its own."""
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
