"""Driver-side handle on the rollout engines in the rollout placement group.

Creates one ``EngineActor`` per engine (each on its own bundle(s)), starts them
concurrently, spreads prompts across them, and drives their side of a weight
sync. This module imports no inference engine: the engine actors import theirs
(``rollout.engine``, ``disagg.rollout.engines``) in their own process.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from disagg.config import Config
from disagg.logs import ray_get_logged
from disagg.rollout import engines
from disagg.rollout.types import GenRequest, GenResult

if TYPE_CHECKING:
    from disagg.transport.model_transfer import Arm

log = logging.getLogger("disagg.rollout")


class RolloutPool:
    """The engines that are members of the transport group, plus the means to add and retire engines.

    ``engines`` / ``engine_ids`` list the members in transport-rank order (engine worker k
    of member i is rank 1 + i*tp + k); ids are never reused. The first engines sit on the
    bundles of the pool's placement group; an engine added later takes a bundle an engine
    that left gave back, else its own placement group (``cluster.bundles``' rollout bundle).
    """

    def __init__(self, cfg: Config, pg, device: str, model_path: str, coordinator=None,
                 label_selector: dict[str, str] | None = None, api_key: str | None = None,
                 actor_cls: type | None = None):
        """Start the first engines; ``wait_started`` waits for them. ``actor_cls``: the actor class of each
        engine, ``EngineActor`` if None (a benchmark's subclass: ``disagg.bench.actors``)."""
        from disagg.rollout.openai_server import ServerAccess

        if cfg.rollout.openai_api:  # before any engine starts ('node': an address other than loopback)
            ServerAccess(cfg.rollout.api_host, cfg.rollout.api_port_base, api_key).check()
        self.cfg, self.device, self.model_path, self.coordinator = cfg, device, model_path, coordinator
        self.actor_cls = actor_cls  # engines added later are of it too
        self.api_key = api_key  # what the engines' OpenAI API asks off loopback
        self.label_selector = dict(label_selector or {})  # cluster.rollout_nodes, for engines added later
        self.timeout_s = cfg.cluster.actor_timeout_s
        self.tp = cfg.rollout.tensor_parallel_size
        self.engines: list = []
        self.engine_ids: list[int] = []
        self._slots: dict[int, tuple[Any, list[int], bool]] = {}  # engine id -> (pg, bundle indices, own pg)
        self._free: list[tuple[Any, list[int]]] = []  # bundles of the pool's group that an engine gave back
        self._lock = threading.Lock()  # _slots / _free: engines retire in background threads
        self._retiring: list[threading.Thread] = []
        self._next_id = 0
        for i in range(cfg.rollout.num_engines):
            eid, handle = self._create(pg, [i * self.tp + k for k in range(self.tp)], own_pg=False)
            self.engines.append(handle)
            self.engine_ids.append(eid)
        self._starting = [e.start.remote() for e in self.engines]
        self.start_info: list[dict[str, Any]] = []  # each engine's start report, once started

    def wait_started(self) -> None:
        """Wait for the first engines' start (the caller may start the trainer meanwhile: its model
        loads while the engines profile and build their caches)."""
        if self._starting:
            self.start_info = ray_get_logged(self._starting, what="engine start",
                                             timeout_s=self.cfg.rollout.start_timeout_s, log=log)
            self._starting = []

    @property
    def num_workers(self) -> int:
        """Transport ranks the members hold (tensor-parallel workers of every member engine)."""
        return len(self.engines) * self.tp

    def _create(self, pg, bundle_indices: list[int], own_pg: bool):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from disagg.rollout.engine import EngineActor

        cfg, tp, eid = self.cfg, self.tp, self._next_id
        self._next_id += 1
        env = engines.actor_env(cfg.rollout, self.device, bundle_indices)
        handle = ray.remote(self.actor_cls or EngineActor).options(
            num_cpus=cfg.rollout.cpus_per_engine if tp == 1 else 0,
            num_gpus=(cfg.rollout.gpus_per_engine if self.device == "cuda" else 0) if tp == 1 else 0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle_indices[0]),
            runtime_env={"env_vars": env},
            max_concurrency=1000,
        ).remote(eid, self.model_path, cfg.rollout, self.coordinator, cfg.control.rpc_timeout_s,
                 cfg.trainer.seed + 1000 * eid, cfg.logging.level, cfg.transport, cfg.model.cache_dir, self.api_key)
        with self._lock:
            self._slots[eid] = (pg, bundle_indices, own_pg)
        return eid, handle

    def launch(self):
        """Start one more engine (not yet a member): ``(engine id, handle, ref of its start info)``.

        It takes a bundle an engine gave back, else a placement group of its own; the ref
        resolves once vLLM is up on dummy weights (the caller bounds the wait).
        """
        from ray.util.placement_group import placement_group

        from disagg.cluster import bundles

        with self._lock:
            freed = self._free.pop(0) if self._free else None
        if freed is not None:
            pg, indices = freed
            eid, handle = self._create(pg, indices, own_pg=False)
        else:
            _, rb = bundles(self.cfg, self.device)
            sel = [dict(self.label_selector)] * self.tp if self.label_selector else None
            pg = placement_group([dict(rb[0]) for _ in range(self.tp)], strategy="PACK",
                                 name=f"disagg-rollout-engine-{self._next_id}", bundle_label_selector=sel)
            eid, handle = self._create(pg, list(range(self.tp)), own_pg=True)
        log.info("engine %d launched (%s)", eid, "own placement group" if self._slots[eid][2] else "a freed bundle")
        return eid, handle, handle.start.remote()

    def set_members(self, members: list[tuple[int, Any]]) -> None:
        """The engines of the next transport group, in rank order."""
        self.engine_ids = [eid for eid, _ in members]
        self.engines = [h for _, h in members]

    def handle(self, engine_id: int):
        return self.engines[self.engine_ids.index(engine_id)]

    def retire(self, engine_id: int, handle, background: bool = False) -> None:
        """Shut an engine down and give its bundles back (its own placement group is removed).

        ``background``: return at once (vLLM's shutdown takes seconds; a running pipeline must
        not stall on it); the bundles come back when it is done.
        """
        if background:
            t = threading.Thread(target=self._retire, args=(engine_id, handle), daemon=True,
                                 name=f"disagg-retire-{engine_id}")
            self._retiring.append(t)
            t.start()
        else:
            self._retire(engine_id, handle)

    def _retire(self, engine_id: int, handle) -> None:
        import ray

        try:
            ray.get(handle.shutdown.remote(), timeout=30)
        except Exception as exc:  # noqa: BLE001 - best-effort teardown, logged
            log.warning("engine %d shutdown failed: %s", engine_id, exc)
        ray.kill(handle)
        self._release(engine_id)
        log.info("engine %d retired", engine_id)

    def discard(self, engine_id: int, handle) -> None:
        """An engine that died (or hung and is killed now): kill its actor and give its bundles back
        at once, so a replacement can start; it stays a member until the next ``set_members``."""
        import ray

        try:
            ray.kill(handle, no_restart=True)
        except Exception as exc:  # noqa: BLE001 - already gone
            log.debug("engine %d: kill: %s", engine_id, exc)
        self._release(engine_id)
        log.info("engine %d discarded: its bundle is free for a replacement", engine_id)

    def _release(self, engine_id: int) -> None:
        """Give an engine's bundles back: to the free list, or its own placement group is removed.
        A no-op for an engine released already (discarded when it died, retired at shutdown)."""
        from ray.util.placement_group import remove_placement_group

        with self._lock:
            slot = self._slots.pop(engine_id, None)
            if slot is not None and not slot[2]:
                self._free.append((slot[0], slot[1]))
        if slot is not None and slot[2]:
            remove_placement_group(slot[0])

    def free_bundles(self) -> int:
        """Bundles of the pool's placement group no engine holds (a scale-up takes these first)."""
        with self._lock:
            return len(self._free)

    def _get(self, refs, what: str) -> Any:
        return ray_get_logged(refs, what=what, timeout_s=self.timeout_s, log=log)

    def init_transport_async(self, endpoints: list[tuple[str, int, str]], world_size: int, backend: str,
                             timeout_s: float, signals: str = "store") -> list:
        """Every engine joins every source group; worker k of engine i is rank 1 + i*tp + k in each."""
        tp = self.cfg.rollout.tensor_parallel_size
        return [e.init_transport.remote(groups=[list(x) for x in endpoints], world_size=world_size,
                                        rank_offset=1 + i * tp, backend=backend, timeout_s=timeout_s, signals=signals)
                for i, e in enumerate(self.engines)]

    def receive_weights_async(self, policy_version: int, digest: str | None = None, ack: bool = True,
                              max_staleness: int | None = None, arm: Arm | None = None) -> list:
        """Every engine's receive of ``policy_version`` (``EngineActor.receive_weights``; ``max_staleness``:
        the run's limit, past which the pipeline's requests in flight stop; ``arm``: armed, waiting for
        its word); the refs."""
        return [e.receive_weights.remote(policy_version, digest=digest, ack=ack, max_staleness=max_staleness, arm=arm)
                for e in self.engines]

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
        """Every engine shut down at once (vLLM's shutdown takes seconds each), then waited for."""
        for eid, e in list(zip(self.engine_ids, self.engines)):
            self.retire(eid, e, background=True)
        for t in self._retiring:
            t.join(timeout=60)
        self._retiring = []
        self.engines, self.engine_ids = [], []
