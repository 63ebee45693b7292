"""Ray connection and the two placement groups (trainer, rollout).

Trainer workers and rollout engines never share a placement group: each pool
is sized from its own config keys and placed independently, on one machine or
many. Waiting for placement logs progress and fails with an error that says
what was asked for and what the cluster has.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

from disagg.config import Config
from disagg.errors import ConfigError

log = logging.getLogger("disagg.cluster")


@dataclass
class Pools:
    trainer_pg: object  # ray.util.placement_group.PlacementGroup (None for standalone engines)
    rollout_pg: object
    device: str
    trainer_bundle: dict[str, float]
    rollout_bundle: dict[str, float]


def pin_process(cores: tuple[int, ...] | None, what: str) -> None:
    """Pin every thread of this process (and the threads it starts later) to ``cores``; None: no-op.

    ``os.sched_setaffinity(0, ...)`` moves only the calling thread; Ray workers already run
    several threads, so each task of the process is moved.
    """
    if cores is None:
        return
    wanted = set(cores)
    moved = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), wanted)
            moved += 1
        except (ProcessLookupError, PermissionError):  # a thread that just exited
            continue
        except OSError as e:
            raise ConfigError(f"{what}: cannot pin to cores {sorted(wanted)}: {e}") from e
    log.info("%s pinned to cores %s (%d threads)", what, sorted(wanted), moved)


def bundles(cfg: Config, device: str) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """Bundle lists of the trainer and rollout pools (pure)."""
    if device == "cuda":
        tb = {"GPU": 1.0, "CPU": float(cfg.trainer.cpus_per_worker)}
        rb = {"GPU": 1.0, "CPU": float(cfg.rollout.cpus_per_engine)}
    else:
        tb = {"CPU": float(cfg.trainer.cpus_per_worker)}
        rb = {"CPU": float(cfg.rollout.cpus_per_engine)}
    n_roll = cfg.rollout.num_engines * cfg.rollout.tensor_parallel_size
    return [dict(tb) for _ in range(cfg.trainer.num_workers)], [dict(rb) for _ in range(n_roll)]


def connect(cfg: Config, device: str, runtime_env: dict | None = None) -> None:
    """Connect to ``cluster.address`` / $RAY_ADDRESS, or start a local Ray cluster sized for both pools."""
    import ray

    if ray.is_initialized():
        return
    address = cfg.cluster.address or os.environ.get("RAY_ADDRESS")
    if address:
        log.info("connecting to Ray cluster at %s", address)
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)
        return
    tb, rb = bundles(cfg, device)
    need_cpu = int(sum(b["CPU"] for b in tb + rb))
    num_cpus = cfg.cluster.num_cpus or max(os.cpu_count() or 1, need_cpu)
    log.info("starting a local Ray cluster (%d logical CPUs)", num_cpus)
    ray.init(num_cpus=num_cpus, include_dashboard=False, runtime_env=runtime_env, log_to_driver=True)


def create_pools(cfg: Config, device: str, with_trainer: bool = True) -> Pools:
    """Create and wait for the trainer and rollout placement groups (rollout only for standalone engines)."""
    import ray
    from ray.util.placement_group import placement_group

    tb, rb = bundles(cfg, device)
    if not with_trainer:
        tb = []
    avail = ray.cluster_resources()
    for res in ("CPU", "GPU"):
        need = sum(b.get(res, 0.0) for b in tb + rb)
        if need > avail.get(res, 0.0):
            raise ConfigError(
                f"trainer.num_workers={cfg.trainer.num_workers} + rollout.num_engines*tensor_parallel_size="
                f"{cfg.rollout.num_engines}*{cfg.rollout.tensor_parallel_size} need {need:g} {res}, "
                f"but the Ray cluster has {avail.get(res, 0.0):g}"
            )
    strategy = "PACK"
    rollout_pg = placement_group(rb, strategy=strategy, name="disagg-rollout")
    groups = [("rollout", rollout_pg, rb)]
    trainer_pg = None
    if tb:
        trainer_pg = placement_group(tb, strategy=strategy, name="disagg-trainer")
        groups.insert(0, ("trainer", trainer_pg, tb))
    _wait_placement(groups, cfg.cluster.placement_timeout_s)
    return Pools(trainer_pg, rollout_pg, device, tb[0] if tb else {}, rb[0])


def _wait_placement(groups, timeout_s: float) -> None:
    import ray

    start = time.monotonic()
    pending = {pg.ready(): (name, b) for name, pg, b in groups}
    while pending:
        left = timeout_s - (time.monotonic() - start)
        if left <= 0:
            what = ", ".join(f"{n}: {len(b)} x {b[0]}" for n, b in pending.values())
            raise TimeoutError(
                f"placement groups not ready after {timeout_s:.0f}s (cluster.placement_timeout_s): waiting for {what}; "
                f"cluster has {ray.available_resources()} available"
            )
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=min(5.0, left))
        for ref in ready:
            name, b = pending.pop(ref)
            log.info("placement group %s ready (%d bundles)", name, len(b))
        if pending and not ready:
            log.info("waiting for placement groups %s (%.0fs of %.0fs)", sorted(n for n, _ in pending.values()),
                     time.monotonic() - start, timeout_s)
