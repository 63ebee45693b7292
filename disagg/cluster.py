"""Ray connection and the two placement groups (trainer, rollout).

Trainer workers and rollout engines never share a placement group: each pool
is sized from its own config keys and placed independently, on one machine or
many. A pool is pinned to nodes by custom resources in its bundles
(``cluster.*_resources``) or by a node list (``cluster.*_nodes``, a label
selector on Ray's node id). Waiting for placement logs progress and fails with
an error that says what was asked for and what the cluster has.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

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
    rollout_label_selector: dict[str, str] = field(default_factory=dict)
    """Label selector of every rollout bundle (cluster.rollout_nodes; {} = any node): a placement
    group made later for more engines passes it too."""


def freeze_heap(what: str) -> None:
    """Take every object alive now (the model, vLLM, Ray, torch, transformers) out of the garbage
    collector's full scans (``gc.freeze``), once a long-lived process has started.

    Python's oldest-generation collection walks every tracked object; with those libraries loaded
    it stalled an engine's actor for 0.48 s and the driver for 0.14-0.27 s, a few times a minute,
    each time holding back a step. Objects made later are collected as usual.
    """
    import gc

    gc.collect()
    gc.freeze()
    log.debug("%s: %d objects frozen out of the garbage collector's scans", what, gc.get_freeze_count())


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
    """Bundle lists of the trainer and rollout pools, custom resources included (pure)."""
    if device == "cuda":
        tb = {"GPU": cfg.trainer.gpus_per_worker, "CPU": float(cfg.trainer.cpus_per_worker)}
        rb = {"GPU": cfg.rollout.gpus_per_engine, "CPU": float(cfg.rollout.cpus_per_engine)}
    else:
        tb = {"CPU": float(cfg.trainer.cpus_per_worker)}
        rb = {"CPU": float(cfg.rollout.cpus_per_engine)}
    tb.update(cfg.cluster.trainer_resources)
    rb.update(cfg.cluster.rollout_resources)
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
    # address="local": a cluster of its own even where `ray start` runs one on this machine (Ray would
    # join that one, and refuse num_cpus there). No prestarted workers: Ray starts one idle Python
    # worker per CPU for tasks of the job's environment, which disagg's actors (each with its own
    # environment) never use; on the 2-core machine they took the CPUs from the engine's and the
    # trainer's start, 3-4 s of a 30 s run (pools up 15.4/16.0 s -> 13.0/11.8 s, 2026-11-29).
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, runtime_env=runtime_env,
             log_to_driver=True,
             _system_config={"enable_worker_prestart": False, "prestart_worker_first_driver": False})


def create_pools(cfg: Config, device: str, with_trainer: bool = True) -> Pools:
    """Create and wait for the trainer and rollout placement groups (rollout only for standalone engines)."""
    import ray
    from ray.util.placement_group import placement_group

    tb, rb = bundles(cfg, device)
    if not with_trainer:
        tb = []
    nodes = [n for n in ray.nodes() if n["Alive"]]
    trainer_ids = resolve_nodes("cluster.trainer_nodes", cfg.cluster.trainer_nodes, nodes) if tb else []
    rollout_ids = resolve_nodes("cluster.rollout_nodes", cfg.cluster.rollout_nodes, nodes)
    check_capacity(cfg, tb, rb, nodes, trainer_ids, rollout_ids)
    strategy = "PACK"  # with a node list or custom resources PACK still fills the allowed nodes first
    rollout_sel = label_selector(rollout_ids)
    rollout_pg = placement_group(rb, strategy=strategy, name="disagg-rollout",
                                 bundle_label_selector=[rollout_sel] * len(rb) if rollout_sel else None)
    groups = [("rollout", rollout_pg, rb)]
    trainer_pg = None
    if tb:
        trainer_sel = label_selector(trainer_ids)
        trainer_pg = placement_group(tb, strategy=strategy, name="disagg-trainer",
                                     bundle_label_selector=[trainer_sel] * len(tb) if trainer_sel else None)
        groups.insert(0, ("trainer", trainer_pg, tb))
    _wait_placement(groups, cfg.cluster.placement_timeout_s)
    return Pools(trainer_pg, rollout_pg, device, tb[0] if tb else {}, rb[0], rollout_sel)


NODE_ID_LABEL = "ray.io/node-id"  # the label Ray gives every node: its node id


def resolve_nodes(key: str, wanted: tuple[str, ...], nodes: list[dict]) -> list[str]:
    """Node ids of the nodes ``wanted`` names (node IPs or node ids; an IP names every node on it).

    ``nodes`` is ``ray.nodes()`` (alive ones); a name that matches none raises a ConfigError
    naming ``key`` and listing the cluster's nodes. Pure.
    """
    ids: list[str] = []
    for name in wanted:
        found = [n["NodeID"] for n in nodes if name in (n["NodeID"], n["NodeManagerAddress"])]
        if not found:
            listing = ", ".join(f"{n['NodeID']} ({n['NodeManagerAddress']})" for n in nodes)
            raise ConfigError(f"{key}={list(wanted)}: {name!r} is not a node of the Ray cluster; "
                              f"its nodes: {listing}")
        ids += [i for i in found if i not in ids]
    return ids


def label_selector(node_ids: list[str]) -> dict[str, str]:
    """The bundle label selector that keeps a bundle on one of ``node_ids`` ({}: anywhere). Pure."""
    if not node_ids:
        return {}
    return {NODE_ID_LABEL: node_ids[0] if len(node_ids) == 1 else f"in({','.join(node_ids)})"}


def check_capacity(cfg: Config, tb: list[dict[str, float]], rb: list[dict[str, float]], nodes: list[dict],
                   trainer_ids: list[str], rollout_ids: list[str]) -> None:
    """Fail fast, naming the config key, when the cluster (or a pool's nodes) cannot hold the pools.

    ``nodes`` is ``ray.nodes()`` (alive ones); ``*_ids`` are the pools' allowed nodes ([] = any).
    Pure: placement itself may still wait on resources other jobs hold.
    """
    def total(res: str, ids: list[str]) -> float:
        return sum(n["Resources"].get(res, 0.0) for n in nodes if not ids or n["NodeID"] in ids)

    def need(res: str, pool: list[dict[str, float]]) -> float:
        return sum(b.get(res, 0.0) for b in pool)

    for res in ("CPU", "GPU"):
        if need(res, tb + rb) > total(res, []):
            hint = ""
            if res == "GPU":
                hint = (f" (trainer.gpus_per_worker={cfg.trainer.gpus_per_worker:g}, rollout.gpus_per_engine="
                        f"{cfg.rollout.gpus_per_engine:g}; on one GPU, cluster=one_gpu shares it)")
            raise ConfigError(
                f"trainer.num_workers={cfg.trainer.num_workers} + rollout.num_engines*tensor_parallel_size="
                f"{cfg.rollout.num_engines}*{cfg.rollout.tensor_parallel_size} need {need(res, tb + rb):g} {res}, "
                f"but the Ray cluster has {total(res, []):g}{hint}"
            )
    custom = [("trainer", cfg.cluster.trainer_resources, tb), ("rollout", cfg.cluster.rollout_resources, rb)]
    for res in sorted({r for _, asked, pool in custom if pool for r in asked}):
        keys = [f"cluster.{name}_resources.{res}={asked[res]:g}" for name, asked, pool in custom
                if pool and res in asked]
        if need(res, tb + rb) > total(res, []):
            raise ConfigError(
                f"{' + '.join(keys)} per bundle: the pools need {need(res, tb + rb):g} {res!r} in all, but the Ray "
                f"cluster has {total(res, []):g} (a node offers it with `ray start --resources='{{\"{res}\": N}}'`)"
            )
    for name, pool, ids in (("trainer", tb, trainer_ids), ("rollout", rb, rollout_ids)):
        if not ids or not pool:
            continue
        for res in pool[0]:
            if need(res, pool) > total(res, ids):
                nodes_key = f"cluster.{name}_nodes={list(getattr(cfg.cluster, f'{name}_nodes'))}"
                raise ConfigError(f"{nodes_key}: the {name} pool needs {need(res, pool):g} {res} "
                                  f"({len(pool)} bundles of {pool[0]}), but those nodes have {total(res, ids):g}")


def order_bundles(bundle_nodes: dict[int, str]) -> list[int]:
    """The bundle of each rank: ranks grouped by node, then by bundle (device) index within a node.

    Nodes come in the order of their lowest bundle, so rank 0 keeps bundle 0. ``bundle_nodes`` maps
    bundle index -> node id (``placement_group_table(pg)["bundles_to_node_id"]``). Pure.
    """
    first: dict[str, int] = {}
    for i in sorted(bundle_nodes):
        first.setdefault(bundle_nodes[i], i)
    return sorted(bundle_nodes, key=lambda i: (first[bundle_nodes[i]], i))


def bundle_order(pg) -> list[int]:
    """``order_bundles`` of a ready placement group."""
    from ray.util.placement_group import placement_group_table

    return order_bundles({int(i): node for i, node in placement_group_table(pg)["bundles_to_node_id"].items()})


def write_placement(job) -> Path:
    """Write ``<run_dir>/placement.json``: the node of every trainer rank and every engine."""
    from disagg.logs import ray_get_logged

    workers = job.trainer.workers
    where = ray_get_logged([w.node_id.remote() for w in workers] + [w.node_ip.remote() for w in workers],
                           what="trainer placement", timeout_s=job.cfg.cluster.actor_timeout_s, log=log)
    record = {
        "trainer": [{"rank": r, "node_id": where[r], "node_ip": where[len(workers) + r]} for r in range(len(workers))],
        "rollout": [{"engine_id": i["engine_id"], "node_id": i["node_id"], "node_ip": i["node_ip"]}
                    for i in job.rollout.start_info],
    }
    path = Path(job.run_dir) / "placement.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    for pool, entries in record.items():
        by_node: dict[str, list[int]] = {}
        for e in entries:
            by_node.setdefault(f"{e['node_id'][:8]} ({e['node_ip']})", []).append(e.get("rank", e.get("engine_id")))
        log.info("%s placement: %s", pool, "; ".join(f"{ids} on node {node}" for node, ids in by_node.items()))
    return path


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
