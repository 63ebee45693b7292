"""Driver-side handle on the trainer workers in the trainer placement group.

It creates one ``TrainerWorker`` per bundle, splits each batch across them, and
fans out calls that every rank must make together (train step, weight push).
Only metadata and samples cross Ray here; parameters never do.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from disagg import faults
from disagg.cluster import bundle_order
from disagg.config import Config
from disagg.logs import ray_get_logged
from disagg.samples import TrainSample
from disagg.trainer.grpo import mismatch_summary
from disagg.trainer.worker import TrainerWorker

if TYPE_CHECKING:
    from disagg.transport.model_transfer import Arm

log = logging.getLogger("disagg.trainer")


class TrainerGroup:
    def __init__(self, cfg: Config, pg, device: str, model_path: str, setup: bool = True,
                 worker_cls: type | None = None):
        """``worker_cls``: the actor class of each rank, ``TrainerWorker`` if None (a benchmark's subclass:
        ``disagg.bench.actors``)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.cfg = cfg
        self.timeout_s = cfg.cluster.actor_timeout_s
        n = cfg.trainer.num_workers
        # transport.overlap_push: pushes (and the calls that set up and announce them) run on a
        # thread of their own, so a push from a snapshot goes on while the next step trains.
        self.overlap_push = cfg.transport.overlap_push and (n == 1 or cfg.transport.source == "shards")
        if cfg.transport.overlap_push and not self.overlap_push:
            log.info("transport.overlap_push: off with source=gather over %d trainer workers (the gather is a "
                     "collective of the trainer ranks); pushes run between train steps", n)
        worker_cls = worker_cls or TrainerWorker
        cls = ray.remote(concurrency_groups={"transport": 1})(worker_cls) if self.overlap_push else ray.remote(
            worker_cls)
        bundle = bundle_order(pg)  # rank i on bundle[i]: ranks ordered by node, then device
        env = faults.env_vars()  # fault-injection tests arm the workers' points through the driver's environment
        self.workers = [
            cls.options(
                num_cpus=cfg.trainer.cpus_per_worker,
                num_gpus=cfg.trainer.gpus_per_worker if device == "cuda" else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle[i]),
                name=None,
                **({"runtime_env": {"env_vars": env}} if env else {}),
            ).remote(i, n, model_path, cfg.trainer, cfg.algorithm, cfg.transport, cfg.rollout.temperature, device,
                     cfg.logging.level, cfg.model.cache_dir)
            for i in range(n)
        ]
        self.num_parameters = 0
        if setup:
            self.setup()

    def setup(self) -> None:
        """Every worker loads the model and optimizer (and joins the trainer group when sharded). Apart
        from the workers' start (their processes and imports, which touch no GPU) where a GPU is
        shared with engines: ``Job`` starts the workers beside the engines and sets them up once
        the engines have sized their caches."""
        master_addr = master_port = None
        if len(self.workers) > 1:
            master_addr = self._get(self.workers[0].node_ip.remote(), "trainer rank 0 address")
            master_port = self._get(self.workers[0].free_port.remote(), "trainer rank 0 port")
        info = self._get([w.setup.remote(master_addr, master_port) for w in self.workers], "trainer setup")
        self.num_parameters = info[0]["num_parameters"]

    def _get(self, refs, what: str) -> Any:
        return ray_get_logged(refs, what=what, timeout_s=self.timeout_s, log=log)

    @property
    def rank0(self):
        return self.workers[0]

    def transport_method(self, rank: int, name: str):
        """Worker ``rank``'s actor method ``name`` on the transport thread (with overlap_push): it does
        not wait for a train step that is running."""
        method = getattr(self.workers[rank], name)
        return method.options(concurrency_group="transport") if self.overlap_push else method

    def transport_endpoint(self, rank: int = 0) -> tuple[str, int]:
        """(host, port) for the TCPStore of the transport group that trainer ``rank`` sends on."""
        return (self._get(self.transport_method(rank, "node_ip").remote(), f"trainer rank {rank} address"),
                self._get(self.transport_method(rank, "free_port").remote(), f"trainer rank {rank} port"))

    def train_step(self, samples: list[TrainSample]) -> dict[str, float]:
        """One step over ``samples`` (one optimizer step per mini-batch), split evenly across workers."""
        return self.summarise(self._get(self.train_step_async(samples), "train step"))

    def train_step_async(self, samples: list[TrainSample], snapshot_version: int | None = None) -> list:
        """Start a train step on every worker (returns the refs; ``summarise`` their results).
        ``snapshot_version``: the workers then copy their parameters as that version, for a
        push from the snapshot (``push_weights_async(..., from_snapshot=True)``; overlap_push only)."""
        if snapshot_version is not None and not self.overlap_push:
            raise ValueError("a snapshot for an overlapped push needs transport.overlap_push (and source=shards "
                             "or one trainer worker)")
        n, m = len(self.workers), self.cfg.algorithm.num_minibatches
        shards = [samples[i::n] for i in range(n)]
        tokens = [sum(s.num_trained_tokens for sh in shards for s in sh[j::m]) for j in range(m)]
        return [w.train_step.remote(sh, tokens, snapshot_version) for w, sh in zip(self.workers, shards)]

    @staticmethod
    def summarise(outs: list[dict]) -> dict[str, float]:
        """One train-step record from every worker's result."""
        num_tokens = max(sum(o["num_tokens"] for o in outs), 1.0)
        return {
            "loss": sum(o["loss"] for o in outs),
            "clip_frac": sum(o["clip_frac_sum"] for o in outs) / num_tokens,
            "ratio_mean": sum(o["ratio_sum"] for o in outs) / num_tokens,
            "kl_behaviour": sum(o["kl_behaviour_sum"] for o in outs) / num_tokens,
            "kl_ref": sum(o["kl_ref_sum"] for o in outs) / num_tokens,
            "grad_norm": outs[0]["grad_norm"],
            "tokens": num_tokens,
            "snapshot_s": max(o.get("snapshot_seconds", 0.0) for o in outs),
            **mismatch_summary(outs),
        }

    def push_weights_async(self, policy_version: int, from_snapshot: bool = False, arm: Arm | None = None,
                           last_sync_s: float | None = None) -> list:
        """Start the weight push on every rank (rank 0 sends, or every rank with source=shards);
        returns the refs. ``from_snapshot``: send the copy taken by the train step that made
        ``policy_version`` while the next step may train. ``arm``: the engines' armed receive the
        push wakes; with ``arm.push_waits`` an armed push, which waits for the driver's word in the
        group's store (``TrainerWorker.push_weights``; overlap_push only: it waits on the transport
        thread). ``last_sync_s``: what the sync before took end to end, for ``transport.delta=auto``."""
        if arm is not None and arm.push_waits and not self.overlap_push:
            raise ValueError("an armed push waits on the trainer's transport thread: it needs transport.overlap_push")
        return [self.transport_method(r, "push_weights").remote(policy_version, from_snapshot, arm, last_sync_s)
                for r in range(len(self.workers))]

    def disarm_async(self, arm: Arm) -> list:
        """Call off the engines' armed receive ``arm`` (every sending rank tells its group); the refs."""
        return [self.transport_method(r, "disarm").remote(arm) for r in range(len(self.workers))]

    def announce(self, coordinator, policy_version: int, trainer_step: int) -> str:
        """Rank 0 announces the version and its manifest to the coordinator over gRPC."""
        ref = self.transport_method(0, "announce").remote(coordinator, policy_version, trainer_step,
                                                          self.cfg.control.rpc_timeout_s)
        return self._get(ref, f"announce of version {policy_version}")

    def manifest(self, policy_version: int):
        """The full-tensor ``Manifest`` rank 0 sends (its layout is fixed for the trainer's lifetime)."""
        from disagg.transport.manifest import Manifest

        return Manifest.from_dict(self._get(self.transport_method(0, "manifest").remote(policy_version),
                                            f"manifest of version {policy_version}"))

    def save_checkpoint(self, path: str) -> dict:
        """Every worker writes its part of a checkpoint under ``path`` (see TrainerWorker.save_checkpoint);
        returns the digests of every file they wrote (``{name: FileDigest}``)."""
        from disagg.digests import FileDigest

        outs = self._get([w.save_checkpoint.remote(path) for w in self.workers], f"checkpoint to {path}")
        return {n: FileDigest(f["bytes"], f["digest"]) for out in outs for n, f in out["files"].items()}

    def shutdown(self) -> None:
        import ray

        for w in self.workers:
            ray.kill(w)

    def load_checkpoint(self, path: str, reference_path: str | None = None) -> dict[str, float]:
        """Every worker loads its part of a checkpoint's optimizer, scheduler and RNG state (see
        TrainerWorker.load_checkpoint); returns rank 0's optimizer summary and parameter checksum."""
        outs = self._get([w.load_checkpoint.remote(path, reference_path) for w in self.workers],
                         f"loading checkpoint {path}")
        return outs[0]

    def optimizer_summary(self) -> dict[str, float]:
        """Adam's step count, sum of |exp_avg| and learning rate (inspection; a collective under FSDP)."""
        return self._get([w.optimizer_summary.remote() for w in self.workers], "optimizer summary")[0]

    def param_checksum(self) -> float:
        """The sum of every parameter (inspection; a collective under FSDP)."""
        return self._get([w.param_checksum.remote() for w in self.workers], "parameter checksum")[0]
