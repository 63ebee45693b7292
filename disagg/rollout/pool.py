"""Driver-side handle on the rollout engines in the rollout placement group.

Creates one ``EngineActor`` per engine (each on its own bundle(s)), starts them
concurrently, spreads prompts across them, and drives their side of a weight
sync. This module does not import vLLM: engines import it in their own process.
"""

from __future__ import annotations

import logging
from typing import Any

from disagg.config import Config
from disagg.logs import ray_get_logged
from disagg.rollout.types import GenRequest, GenResult

log = logging.getLogger("disagg.rollout")

# vLLM's engine core runs its model in-process instead of a further child:
# one process less per engine on a small machine (REFERENCE.md).
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


class RolloutPool:
    def __init__(self, cfg: Config, pg, device: str, model_path: str, coordinator=None):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from disagg.rollout.engine import EngineActor

        self.cfg = cfg
        self.timeout_s = cfg.cluster.actor_timeout_s
        tp = cfg.rollout.tensor_parallel_size
        env = dict(ENGINE_ENV, VLLM_LOGGING_LEVEL=cfg.rollout.vllm_log_level)
        if tp > 1:  # vLLM's Ray executor places the TP workers on this engine's bundles
            env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")
        cls = ray.remote(EngineActor)
        self.engines = []
        for i in range(cfg.rollout.num_engines):
            e_env = dict(env)
            if tp > 1:
                e_env["VLLM_RAY_BUNDLE_INDICES"] = ",".join(str(i * tp + k) for k in range(tp))
            self.engines.append(
                cls.options(
                    num_cpus=cfg.rollout.cpus_per_engine if tp == 1 else 0,
                    num_gpus=(1 if device == "cuda" else 0) if tp == 1 else 0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i * tp),
                    runtime_env={"env_vars": e_env},
                    max_concurrency=1000,
                ).remote(i, model_path, cfg.rollout, coordinator, cfg.control.rpc_timeout_s,
                         cfg.trainer.seed + 1000 * i, cfg.logging.level, cfg.transport)
            )
        self.start_info = ray_get_logged([e.start.remote() for e in self.engines], what="engine start",
                                         timeout_s=cfg.rollout.start_timeout_s, log=log)
        self.num_workers = cfg.rollout.num_engines * tp

    def _get(self, refs, what: str) -> Any:
        return ray_get_logged(refs, what=what, timeout_s=self.timeout_s, log=log)

    def init_transport_async(self, endpoints: list[tuple[str, int, str]], world_size: int, backend: str,
                             timeout_s: float) -> list:
        """Every engine joins every source group; worker k of engine i is rank 1 + i*tp + k in each."""
        tp = self.cfg.rollout.tensor_parallel_size
        return [e.init_transport.remote(groups=[list(x) for x in endpoints], world_size=world_size,
                                        rank_offset=1 + i * tp, backend=backend, timeout_s=timeout_s)
                for i, e in enumerate(self.engines)]

    def receive_weights_async(self, policy_version: int) -> list:
        return [e.receive_weights.remote(policy_version) for e in self.engines]

    def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        """Spread requests over engines round-robin; results come back in request order."""
        n = len(self.engines)
        shards = [requests[i::n] for i in range(n)]
        outs = self._get([e.generate.remote(sh) for e, sh in zip(self.engines, shards) if sh], "generation")
        by_id = {r.request_id: r for out in outs for r in out}
        return [by_id[r.request_id] for r in requests]

    def stats(self) -> list[dict[str, Any]]:
        return self._get([e.get_stats.remote() for e in self.engines], "engine stats")

    def shutdown(self) -> None:
        import ray

        for e in self.engines:
            try:
                ray.get(e.shutdown.remote(), timeout=30)
            except Exception as exc:  # noqa: BLE001 - best-effort teardown, logged
                log.warning("engine shutdown failed: %s", exc)
            ray.kill(e)
