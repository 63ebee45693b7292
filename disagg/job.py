"""A running disagg job: coordinator, both pools, and the transport group between them.

``Job.start`` brings everything up in order - coordinator (gRPC), Ray, the two
placement groups, trainer workers, rollout engines (dummy weights), then the
dedicated transport group - and ``sync_weights`` moves one policy version from
the trainer to every engine worker: the job's ``WeightSync`` (``disagg/weightsync.py``)
owns every sync, and the job hands its verbs on. The job keeps start-up, membership,
checkpoints and shutdown. The driver only orchestrates: no parameter byte passes
through it or through Ray's object store.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from disagg.cluster import Pools, connect, create_pools
from disagg.config import Config, resolve_backend, resolve_device, shares_gpus
from disagg.rollout.pool import RolloutPool
from disagg.trainer.pool import TrainerGroup
from disagg.weightsync import ArmedReceive, PendingSync, SyncStats, WeightSync, sync_stats

log = logging.getLogger("disagg.job")


class Job:
    def __init__(self, cfg: Config, run_dir: Path, model_path: Path | str, engine_cls: type | None = None,
                 trainer_cls: type | None = None):
        self.cfg = cfg
        # The actors' classes (None: the production ones); a benchmark's subclasses carry its routes
        # (disagg.bench.actors).
        self.engine_cls, self.trainer_cls = engine_cls, trainer_cls
        self.run_dir = run_dir
        # The model the actors load: a local directory, or the checkpoint a resumed run starts from
        # (a path or an fsspec URL, which each actor copies to its node: disagg.storage.local_copy).
        self.model_path = model_path
        self.coordinator = None
        self.token: str | None = None  # the job's control token (written to <run_dir>/control.token)
        self.api_key: str | None = None  # what the engines' OpenAI API asks off loopback (rollout.api_key)
        self.pools: Pools | None = None
        self.trainer: TrainerGroup | None = None
        self.rollout: RolloutPool | None = None
        self.engine_start_s: list[float] = []
        self.weights: WeightSync | None = None  # every sync's owner, once the pools are up

    @classmethod
    def start(cls, cfg: Config, run_dir: Path, model_path: Path | str, engine_cls: type | None = None,
              trainer_cls: type | None = None) -> "Job":
        job = cls(cfg, run_dir, model_path, engine_cls, trainer_cls)
        try:
            job._start()
        except BaseException:
            job.shutdown()
            raise
        return job

    def _start(self) -> None:
        from disagg.control.auth import api_key, write_token
        from disagg.control.server import CoordinatorServer

        cfg = self.cfg
        device = resolve_device(cfg)
        self.backend = resolve_backend(cfg, device)
        # Ray first: its node processes are forked, and forking with live gRPC threads is unsafe.
        connect(cfg, device)
        self.token, token_path = write_token(self.run_dir)
        self.api_key = api_key(cfg.rollout.api_key, self.token)  # the engines' OpenAI API asks it off loopback
        c = cfg.control
        self.coordinator = CoordinatorServer(c.host, c.port, cfg.algorithm.max_staleness, str(self.run_dir),
                                             token=self.token, tls_cert=c.tls_cert, tls_key=c.tls_key,
                                             metrics_port=c.metrics_port).start()
        (self.run_dir / "coordinator.addr").write_text(self.coordinator.address + "\n")
        log.info("coordinator listening on %s (token in %s)", self.coordinator.address, token_path)
        self.pools = create_pools(cfg, device)
        self._register_pool("trainer", self.pools.trainer_pg, self.pools.trainer_bundle, cfg.trainer.num_workers,
                            cfg.trainer.num_workers)
        self.register_rollout_pool(cfg.rollout.num_engines)
        t0 = time.perf_counter()
        # The engines start while the trainer's workers load the model (on GPUs a large model's load
        # overlaps vLLM's profiling and cache set-up), except where they share a GPU: vLLM sizes its
        # KV cache from the memory free while it profiles, which a loading trainer would change. There
        # only the workers' processes start beside the engines (imports; no GPU memory), and their
        # model loads once the engines are up.
        shared_gpu = device == "cuda" and shares_gpus(cfg)
        self.rollout = RolloutPool(cfg, self.pools.rollout_pg, device, str(self.model_path), self.control_client(),
                                   label_selector=self.pools.rollout_label_selector,
                                   api_key=self.api_key, actor_cls=self.engine_cls)
        self.trainer = TrainerGroup(cfg, self.pools.trainer_pg, device, str(self.model_path), setup=not shared_gpu,
                                    worker_cls=self.trainer_cls)
        self.rollout.wait_started()
        if shared_gpu:
            self.trainer.setup()
        self.engine_start_s = [i["start_s"] for i in self.rollout.start_info]
        log.info("pools up in %.1fs (engine start %s s)", time.perf_counter() - t0,
                 ", ".join(f"{s:.1f}" for s in self.engine_start_s))
        imports = [i["import_s"] for i in self.rollout.start_info if i.get("import_s") is not None]
        if imports:  # of the engine's start, importing it (vLLM) before it logs anything
            log.info("engine imports took %s s", ", ".join(f"{s:.1f}" for s in imports))
        self.weights = WeightSync(cfg, self.backend, self.trainer, self.rollout, self.coordinator)
        self.init_transport()

    def register_rollout_pool(self, num_engines: int) -> None:
        """Tell the coordinator the rollout pool's size (at start and after every scale step)."""
        self._register_pool("rollout", self.pools.rollout_pg, self.pools.rollout_bundle,
                            num_engines * self.cfg.rollout.tensor_parallel_size, num_engines)

    def _register_pool(self, name: str, pg, bundle: dict[str, float], num_bundles: int, num_workers: int) -> None:
        from disagg.control.types import PoolStatus

        res = ",".join(f"{k}:{v:g}" for k, v in bundle.items())
        self.coordinator.state.register_pool(PoolStatus(name, num_bundles, res, pg.id.hex(), num_workers))

    def change_engines(self, members: list[tuple[int, object]]) -> None:
        """Make ``members`` ((engine id, handle), in rank order) the engines of the transport group:
        rebuilt with a new epoch (a member that does not join fails the rendezvous within
        ``transport.timeout_s``). Call only between syncs."""
        before = list(self.rollout.engine_ids)
        self.rollout.set_members(members)
        self.init_transport()
        self.register_rollout_pool(len(members))
        log.info("rollout engines %s -> %s (transport epoch %d)", before, self.rollout.engine_ids,
                 self.transport_epoch)

    def control_client(self):
        """A coordinator client for actors (pickled to them: address, token, TLS root; no channel)."""
        from disagg.control.client import CoordinatorClient

        c = self.cfg.control
        return CoordinatorClient(self.coordinator.address, timeout_s=c.rpc_timeout_s, token=self.token,
                                 tls_ca=(c.tls_ca or c.tls_cert) if c.tls_cert else None)

    # The weight sync's verbs, handed on to its owner (disagg.weightsync.WeightSync).

    def init_transport(self) -> None:
        """(Re)build the transport groups for the pools' members (a new epoch)."""
        self.weights.build()

    def sync_weights(self, policy_version: int, trainer_step: int) -> SyncStats:
        """Announce ``policy_version`` and broadcast it to every engine; returns when all acked."""
        return self.weights.sync(policy_version, trainer_step)

    def arm_sync(self, policy_version: int, timeout_s: float) -> None:
        """``WeightSync.arm``: every party of ``policy_version``'s sync waits on the group before it exists."""
        self.weights.arm(policy_version, timeout_s)

    def disarm(self, timeout_s: float | None = None) -> None:
        self.weights.disarm(timeout_s)

    def start_sync(self, policy_version: int, trainer_step: int, from_snapshot: bool = False) -> PendingSync:
        """``WeightSync.start``: announce ``policy_version`` and start its broadcast."""
        return self.weights.start(policy_version, trainer_step, from_snapshot)

    def finish_sync(self, pending: PendingSync) -> SyncStats:
        """``WeightSync.finish``: wait for every party; one TransportError naming each failed party."""
        return self.weights.finish(pending)

    def sync_stats(self, pending: PendingSync, sent: list[dict], received: list = ()) -> SyncStats:
        return sync_stats(pending, sent, received)

    @property
    def armed(self) -> ArmedReceive | None:
        return self.weights.armed if self.weights is not None else None

    @property
    def transport_epoch(self) -> int:
        return self.weights.transport_epoch if self.weights is not None else 0

    @property
    def checkpoint_dir(self) -> str:
        """``trainer.checkpoint_dir`` (a shared path or an fsspec URL), else ``<run_dir>/checkpoints``."""
        from disagg.resume import default_checkpoint_dir

        return self.cfg.trainer.checkpoint_dir or default_checkpoint_dir(self.run_dir)

    def save_checkpoint(self, step: int, policy_version: int, extra: dict | None = None) -> str:
        """``<checkpoint_dir>/step_<N>``: the model in HF layout (safetensors; vLLM and HF load it),
        tokenizer, optimizer/scheduler/RNG state, ``state.json`` (step, version, ``extra``), and
        ``manifest.json``: every file's size and digest (``disagg.digests``), written last.

        Complete once the manifest is there. At a plain path (one filesystem for every node) the
        trainer ranks write ``step_<N>.partial`` and the driver renames it; at a URL every writer
        copies its files up and the driver writes ``state.json``, then the manifest (object stores
        cannot rename a directory atomically). A reader checks the files against the manifest."""
        import json

        from disagg import storage
        from disagg.digests import MANIFEST, digest_bytes, digest_files, manifest_text
        from disagg.resume import STATE, checkpoint_path

        path = checkpoint_path(self.checkpoint_dir, step)
        tmp = path if storage.is_url(path) else path + ".partial"
        storage.remove(tmp)
        t0 = time.perf_counter()
        files = self.trainer.save_checkpoint(tmp)
        # tokenizer files: the checkpoint is a complete model directory
        model_dir = storage.local_copy(str(self.model_path), self.cfg.model.cache_dir)
        tokenizer = [f.name for f in model_dir.iterdir() if f.is_file() and
                     f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template"))]
        files.update(digest_files(model_dir, tokenizer))
        for name in tokenizer:
            storage.put_file(model_dir / name, storage.join(tmp, name))
        state = json.dumps({"step": step, "policy_version": policy_version, "time_unix_s": time.time(),
                            "manifest": MANIFEST, **(extra or {})}, indent=2, default=str)
        files[STATE] = digest_bytes(state.encode())
        if tmp != path:
            storage.remove(path)
        storage.write_text(storage.join(tmp, STATE), state)
        storage.write_text(storage.join(tmp, MANIFEST), manifest_text(files))
        if tmp != path:
            Path(tmp).rename(path)  # a checkpoint directory without .partial is complete
        log.info("checkpoint of step %d (policy version %d) written to %s in %.1fs: %d files, %.1f MB, with their "
                 "digests", step, policy_version, path, time.perf_counter() - t0, len(files),
                 sum(f.num_bytes for f in files.values()) / 1e6)
        return path

    def shutdown(self) -> None:
        if self.weights is not None:
            self.weights.close(timeout_s=10.0)
        if self.rollout is not None:
            self.rollout.shutdown()
        if self.trainer is not None:
            self.trainer.shutdown()
        if self.pools is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.pools.trainer_pg)
            remove_placement_group(self.pools.rollout_pg)
        if self.coordinator is not None:
            self.coordinator.stop()
