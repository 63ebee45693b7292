"""``disagg bench vllm-sync``: a weight sync into a real vLLM engine, phase by phase, against a raw
broadcast of the same bytes over the same group, in one run.

A whole job starts as ``disagg train`` would (coordinator, trainer worker, vLLM engines on dummy
weights, the transport group), at the shape and cluster its overrides pick. After a first sync
(dummy -> real weights, not timed) it measures, in one block per ``--loads`` mode (``--warmup``
untimed syncs first: a direct load learns its copy plan in the first) and then for the peer:

  raw        before each sync, one broadcast of the manifest's bytes from the trainer to every engine
             worker over the job's own transport group (no disagg code on the wire: the rate the
             hardware gives)
  <load>     a sync of the next policy version in that mode (``transport.load``: direct, layerwise),
             from the announce to every engine serving it (acknowledged) - what the loop waits
             for - with each phase's seconds as the engine actor and vLLM's worker saw them
  <load>, from a snapshot  (the first load mode; ``--no-snapshot`` skips it) the push of a
             staleness >= 1 run: the trainer sends the copy its train step took (``take_snapshot``
             here, not timed), laid out as the buckets in the wire dtype, so the push sends views
             of it with no packing or cast
  <load>, armed  the same, with every engine's receive and the trainer's push put on the group
             before the announce (``WeightSync.arm``, as the loop does when the engines are idle during a
             train step; the push's header taken by every worker then, its first buckets packed at the
             step's end): the announce only says the driver's word (``transport.signals``) to the push
             and the waiting workers, and only buckets move after it; also reported: the trainer's push
             starting -> the last engine serving, which no driver, Ray or engine-core hop is part of

and for every mode the announce -> the last engine serving (its worker out of the load, on one
host's clock; the engine core steps again from there), without the answers' way back to the driver
  <peer>     with ``--peer vllm-nccl``: the same bytes into the same engine through vLLM's own NCCL
             weight-transfer engine (packed, its default 1 GiB x 2 buffers), as its users drive it:
             the trainer's ``trainer_send_weights`` beside ``AsyncLLM``'s start / update / finish
             (vLLM's layerwise reload), from the driver's dispatch until both are done; with
             ``--peer checkpoint-engine``: through checkpoint-engine 0.4.2 as its users drive it each
             step (``disagg.peers.ckpt_engine``): register the trainer's weights (cast, copied into
             its pinned host memory; timed apart), then gather_metas and update on every rank (host ->
             GPU, NCCL broadcast, CUDA IPC into vLLM's worker), from the driver's dispatch until all are done

With ``--first-buckets 0,32M`` the blocks run once per value of ``transport.first_bucket_bytes`` (the
buckets' ramp; 0: every bucket full), the trainer re-planning its buckets between passes
(``disagg.bench.actors.replan_buckets``): each layout's syncs side by side in one run, labelled with it. With
``--signals store,socket`` they run once per ``transport.signals`` (how the words that start an armed
sync travel), the transport rebuilt between passes (``WeightSync.set_signals``); the armed blocks' words are
compared side by side: when the trainer's push and each engine's worker had theirs, and the sync.

and reports medians: each mode's seconds, raw / sync (the share of the raw rate a sync reaches), the
fixed cost (sync - raw), the phases, and the peer's seconds against disagg's fastest mode. Nothing
here is a timed test.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from disagg.bench.common import bench_device, gpu_overrides, machine, visible_gpus
from disagg.config.files import compose_train
from disagg.rollout.types import TIMELINE
from disagg.logs import setup_logging

log = logging.getLogger("disagg.bench")

PHASES = {  # engine phase key -> what it is (the order of a sync)
    "manifest_s": "manifest (held by layout digest, else from the coordinator)",
    "quiesce_s": "requests added, aborted or frozen",
    "update_s": "the call into the worker: start, wire + loads, finish (cache reset beside it)",
    "rpc_in_s": "  of which: the call reaching the worker (engine core loop)",
    "rpc_out_s": "  of which: the answer coming back",
    "reset_cache_s": "reset_prefix_cache, beside the update (from its call)",
    "resume_s": "resume (when paused)",
    "ack_s": "coordinator ack (an engine acking itself)",
    "armed_setup_s": "armed: manifest, quiesce, the call into the worker and its set-up (before the announce)",
    "armed_wait_s": "armed: the worker waiting on the group for the trainer (before the announce; not in update_s)",
    "worker_receive_s": "worker: receive loop (wire + loads)",
    "worker_load_s": "worker: loads (copy plan, or vLLM load_weights)",
    "worker_reload_init_s": "worker: initialize_layerwise_reload",
    "worker_finalize_s": "worker: finalize_layerwise_reload",
}
SEQUENTIAL = ("manifest_s", "quiesce_s", "update_s", "resume_s", "ack_s")  # the engine actor's, one after another
PEERS = {  # --peer -> the route it takes, and why it needs GPUs
    "vllm-nccl": "vLLM's own NCCL engine",
    "checkpoint-engine": "checkpoint-engine 0.4.2: NCCL broadcast, CUDA IPC",
}


@dataclasses.dataclass(frozen=True)
class VllmSyncOptions:
    device: str = "auto"  # cpu | cuda | auto
    loads: tuple[str, ...] = ("layerwise",)  # transport.load modes compared (cuda default: direct, layerwise)
    repeats: int = 5
    warmup: int = 2  # untimed syncs of each mode first (a direct load learns its copy plan in the first)
    run_dir: str = "runs/bench-vllm-sync"
    log_level: str = "WARNING"
    overrides: tuple[str, ...] = ()
    peer: str | None = None  # vllm-nccl | checkpoint-engine: another route into the same engine (GPUs)
    armed: bool = True  # each load mode also with the engines' receives armed before the announce
    snapshot: bool = True  # the first load mode also pushed from a snapshot (staleness >= 1)
    trace: str | None = None  # a Chrome trace of one more push (armed when the bench arms), written here
    delta: bool = False  # a job with transport.delta=on: the blocks dense, then dense and delta after real steps
    delta_lr: float = 1e-6  # --delta: the trainer's AdamW learning rate (its steps make the versions)
    nccl_socket: bool = False  # NCCL over its socket transport (no NVLink, no shared memory): two nodes' stand-in
    first_buckets: tuple[int, ...] = ()  # transport.first_bucket_bytes, a pass of the blocks each; (): the config's
    signals: tuple[str, ...] = ()  # transport.signals, a pass of the blocks each; (): the config's


def resolve_options(given: dict[str, Any], gpus: int) -> VllmSyncOptions:
    """Options for ``gpus`` visible GPUs: on cuda, both load modes and, unless the overrides pick them,
    ``shape=qwen2.5-0.5b`` and ``cluster=gpu`` (2+ GPUs: NCCL) or ``one_gpu`` (gloo). Pure."""
    device = bench_device(given.get("device", "auto"), gpus)
    values = dict(given, device=device)
    loads = tuple(values.get("loads") or (("direct", "layerwise") if device == "cuda" else ("layerwise",)))
    bad = [m for m in loads if m not in ("direct", "layerwise")]
    if bad:
        raise ValueError(f"--loads: unknown modes {bad} (direct, layerwise)")
    if device == "cpu" and "direct" in loads:
        raise ValueError("--loads direct needs --device cuda (CPU linear layers repack their weights)")
    if values.get("peer") is not None and values["peer"] not in PEERS:
        raise ValueError(f"--peer: unknown peer {values['peer']!r} ({', '.join(PEERS)})")
    if values.get("nccl_socket") and device != "cuda":
        raise ValueError("--nccl-socket needs --device cuda (it sets NCCL's transports)")
    from disagg.transport.signals import SIGNALS  # (here: the module imports torch.distributed)

    ways = values.get("signals", ())
    if any(s not in SIGNALS for s in ways) or len(set(ways)) != len(ways):
        raise ValueError(f"--signals: each of {', '.join(SIGNALS)} at most once, got {list(ways)}")
    if values.get("peer") is not None and device != "cuda":
        raise ValueError(f"--peer {values['peer']} needs --device cuda ({PEERS[values['peer']]})")
    values["loads"] = loads
    overrides = tuple(values.get("overrides", ()))
    values["overrides"] = gpu_overrides(overrides, gpus) if device == "cuda" else overrides
    return VllmSyncOptions(**values)


def summarise(raw_s: list[float], syncs: dict[str, list[dict[str, Any]]],
              peer_s: list[float] | None = None, peer_register_s: list[float] | None = None) -> dict[str, Any]:
    """Medians of the timed iterations: raw seconds, and per load mode its seconds, raw/sync, fixed
    cost (sync - raw) and each phase's median; the peer's seconds and how many times faster than it
    disagg's fastest mode is; where the peer registers its weights before each update (checkpoint-engine,
    ``peer_register_s`` beside ``peer_s``), the register's seconds and the speed-up against both. Pure."""
    raw = statistics.median(raw_s)
    out: dict[str, Any] = {"raw_s": raw, "modes": {}}
    if peer_s:
        peer = statistics.median(peer_s)
        # against a push from the live parameters (a snapshot's copy is made in the train step before it)
        best = min(statistics.median(r["seconds"] for r in runs) for m, runs in syncs.items()
                   if SNAPSHOT not in m and AFTER_STEP not in m)  # the peer sends every byte
        out["peer"] = {"seconds": peer, "raw_vs_peer": raw / peer, "disagg_speedup": peer / best}
        if peer_register_s:
            out["peer"].update(register_s=statistics.median(peer_register_s), disagg_speedup_with_register=(
                statistics.median(p + r for p, r in zip(peer_s, peer_register_s, strict=True)) / best))
    for mode, runs in syncs.items():
        seconds = statistics.median(r["seconds"] for r in runs)
        keys = sorted({k for r in runs for k in r["phases"]}, key=lambda k: list(PHASES).index(k) if k in PHASES else 99)
        # the driver's share: the announce, Ray's dispatch of the calls and the gathering of results
        driver = [r["seconds"] - sum(r["phases"].get(k, 0.0) for k in SEQUENTIAL) for r in runs]
        out["modes"][mode] = {
            "seconds": seconds, "raw_vs_sync": raw / seconds if seconds > 0 else None, "fixed_s": seconds - raw,
            "send_s": statistics.median(r["send_s"] for r in runs), "driver_s": statistics.median(driver),
            "phases": {k: statistics.median(r["phases"].get(k, 0.0) for r in runs) for k in keys},
            "timeline": {k: statistics.median(r["timeline"][k] for r in runs)
                         for k in TIMELINE if all(k in r.get("timeline", {}) for r in runs)},
        }
        if all({"trainer_in", "worker_out"} <= set(r.get("timeline", {})) for r in runs):
            # the parties' own clocks (one host): no driver, Ray or engine-core hop in it when armed
            out["modes"][mode]["push_to_serving_s"] = statistics.median(
                r["timeline"]["worker_out"] - r["timeline"]["trainer_in"] for r in runs)
            # the measure: the announce -> the last engine serving (its worker out of the load;
            # the engine core steps again from there), without the answers' way back to the driver
            serving = statistics.median(r["timeline"]["worker_out"] for r in runs)
            out["modes"][mode].update(announce_to_serving_s=serving, raw_vs_serving=raw / serving if serving > 0
                                      else None, fixed_to_serving_s=serving - raw)
    return out


def _config(o: VllmSyncOptions):
    from disagg.config import load_config

    data = compose_train(o.overrides)
    data.setdefault("cluster", {})["device"] = o.device
    data.setdefault("logging", {}).update(progress=False, backends=["jsonl"], plot=False)
    data.setdefault("model", {}).setdefault("warmstart", {})["steps"] = 0  # the weights' values do not matter
    if o.delta:  # the engines keep an image; the trainer's steps change a realistic share of the values
        data.setdefault("transport", {})["delta"] = "on"
        data.setdefault("trainer", {})["lr"] = o.delta_lr
    return load_config(data)


def run(o: VllmSyncOptions) -> dict[str, Any]:
    import ray

    cfg, report, job = _start(o)
    try:
        nbytes = _first_sync(job, cfg, o, report)
        passes = _Passes.of(o, cfg)
        m = _Measures(syncs={label: [] for label in passes.labels()})
        peer_info = _peer_init(job, cfg, o.peer) if o.peer else None
        raw = _raw_broadcast(job, cfg, nbytes)
        version = _run_blocks(job, o, passes, raw, m, report)
        if o.delta:
            version = _delta_block(job, o, raw, version, m.raw_s, m.syncs)
        if o.trace:
            version += 1
            report["trace"], report["engine_traces"] = _traced_sync(job, o, version)
        if peer_info is not None:
            _run_peer(job, cfg, o, peer_info, raw, m)
        _finish_report(report, o, passes, m)
    finally:
        job.shutdown()
        ray.shutdown()
    return report


def _start(o: VllmSyncOptions):
    """The job as ``disagg train`` starts it, with the bench's engine and trainer classes, and the
    report's heading: the config, the report and the job."""
    from disagg.bench.actors import BenchEngineActor, BenchTrainerWorker
    from disagg.job import Job
    from disagg.model.warmstart import prepare_model

    cfg = _config(o)
    run_dir = Path(o.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"options": dataclasses.asdict(o), "date": time.strftime("%Y-%m-%d %H:%M"),
                              "machine": machine(o.device)}
    model_path = prepare_model(cfg)
    if o.nccl_socket:  # before Ray starts: its workers, the job's trainer and engines, inherit it
        os.environ.update(NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1")
    job = Job.start(cfg, run_dir, model_path, engine_cls=BenchEngineActor, trainer_cls=BenchTrainerWorker)
    return cfg, report, job


def _first_sync(job, cfg, o: VllmSyncOptions, report: dict[str, Any]) -> int:
    """The first sync (dummy -> real weights, version 1, not timed), and what the report says of the job
    and its weights: the manifest's bytes."""
    first = job.sync_weights(1, trainer_step=0)
    report.update(bytes=first.bytes, backend=job.backend, engines=len(job.rollout.engines),
                  engine_workers=job.rollout.num_workers, first_sync_s=first.seconds,
                  trainer=f"{cfg.trainer.num_workers} worker(s), float32 weights, "
                          + (f"AdamW steps at lr {o.delta_lr:g} before the delta block's syncs" if o.delta else
                             "no optimizer state (the bench trains no step; AdamW's state is made at the first)")
                          + f"; {cfg.transport.dtype or 'float32'} on the wire")
    return first.bytes


@dataclasses.dataclass(frozen=True)
class _Passes:
    """The blocks of timed syncs, (load mode, armed, from a snapshot) each, run once per bucket layout
    (``transport.first_bucket_bytes``) and per ``transport.signals``; labelled with the layout and the
    signals only where there is more than one of them."""

    blocks: list[tuple[str, bool, bool]]
    ramps: tuple[int, ...]
    ways: tuple[str, ...]

    @classmethod
    def of(cls, o: VllmSyncOptions, cfg) -> _Passes:
        blocks = [(m, armed, False) for m in o.loads for armed in ((False, True) if o.armed else (False,))]
        blocks += [(o.loads[0], False, True)] if o.snapshot else []
        return cls(blocks, ramps=o.first_buckets or (cfg.transport.first_bucket_bytes,),
                   ways=o.signals or (cfg.transport.signals,))

    @property
    def named(self) -> bool:  # the labels say which layout
        return len(self.ramps) > 1

    def label(self, mode: str, armed: bool, from_snapshot: bool, first: int, way: str) -> str:
        return (_label(mode, armed, from_snapshot) + (f", {_ramp_label(first)}" if self.named else "")
                + (f", {_signals_label(way)}" if len(self.ways) > 1 else ""))

    def labels(self) -> list[str]:  # in the order the blocks run
        return [self.label(m, a, snap, f, w) for w, f, (m, a, snap) in itertools.product(self.ways, self.ramps,
                                                                                         self.blocks)]


@dataclasses.dataclass
class _Measures:
    """What the timed iterations gather, block after block, for the report."""

    syncs: dict[str, list[dict[str, Any]]]  # label -> each timed sync's row
    raw_s: list[float] = dataclasses.field(default_factory=list)  # every timed raw broadcast, blocks and peer
    peer_s: list[float] = dataclasses.field(default_factory=list)
    peer_runs: list[dict[str, float]] = dataclasses.field(default_factory=list)
    snapshots: list[dict[str, float]] = dataclasses.field(default_factory=list)  # the snapshots the bench took
    resolved: dict[str, Any] = dataclasses.field(default_factory=dict)  # load mode -> what the engines resolved


def _raw_broadcast(job, cfg, nbytes: int):
    """A raw broadcast of ``nbytes`` from the trainer to every engine worker over the job's transport
    group, as a call returning its seconds (the slowest side's)."""
    import ray

    engines = job.rollout.engines

    def raw() -> float:
        sides = ray.get([job.trainer.transport_method(0, "raw_send").remote(nbytes, 1)]
                        + [e.raw_receive.remote(nbytes, 1) for e in engines], timeout=cfg.transport.timeout_s + 30)
        return max(s[0] for s in sides)

    return raw


def _run_blocks(job, o: VllmSyncOptions, passes: _Passes, raw, m: _Measures, report: dict[str, Any]) -> int:
    """Every pass's blocks, into ``m``; a layout's bucket count into the report. Returns the last version.

    Each mode in a block of its own (a direct load replays its copy plan from the second sync of
    a block on: the first learns it), each timed sync beside a raw broadcast of the same bytes."""
    import ray

    from disagg.bench.actors import replan_buckets

    engines = job.rollout.engines
    version = 1
    for way, first, block in itertools.product(passes.ways, passes.ramps, passes.blocks):
        mode, armed, from_snapshot = block
        label = passes.label(mode, armed, from_snapshot, first, way)
        job.weights.set_signals(way)  # (a pass's first block rebuilds the transport for it; later ones keep it)
        if passes.named and block == passes.blocks[0]:  # a layout's first block: the trainer re-plans its buckets
            report.setdefault("layouts", {})[_ramp_label(first)] = replan_buckets(job, first)  # its bucket count
        m.resolved[mode] = ray.get([e.set_load_mode.remote(mode) for e in engines], timeout=60)[0]
        for i in range(o.warmup + o.repeats):
            if o.delta:  # the weights did not change: these blocks time dense syncs
                _next_push_as(job, "dense")
            version += 1
            r, row = _timed_sync(job, raw, version, armed, from_snapshot, m.snapshots)
            if i >= o.warmup:
                m.raw_s.append(r)
                m.syncs[label].append(row)
            log.warning("%s %d/%d: raw %.4f s, sync %.4f s (%s)", label, i + 1, o.warmup + o.repeats, r,
                        row["seconds"], row["copy_plan"] or "loader")
    return version


def _run_peer(job, cfg, o: VllmSyncOptions, peer_info: dict[str, Any], raw, m: _Measures) -> None:
    """The peer's block, into ``m``: each of its syncs beside a raw broadcast of the same bytes."""
    import ray

    if o.peer == "vllm-nccl":  # vLLM's calls go to its own engine for the peer's block (not timed)
        ray.get([e.peer_use.remote("vllm-nccl") for e in job.rollout.engines], timeout=60)
    for i in range(o.warmup + o.repeats):
        r = raw()
        p = _peer_sync(job, cfg, o.peer, peer_info, i)
        if i >= o.warmup:
            m.raw_s.append(r)
            m.peer_s.append(p["seconds"])
            m.peer_runs.append(p)
        log.warning("%s %d/%d: raw %.4f s, sync %.4f s%s", o.peer, i + 1, o.warmup + o.repeats, r, p["seconds"],
                    "".join(f", {k} {v:.4f} s" for k, v in p.items() if k != "seconds"))


def _finish_report(report: dict[str, Any], o: VllmSyncOptions, passes: _Passes, m: _Measures) -> None:
    """The medians and every timed iteration into the report; the words compared where the passes
    differ in ``transport.signals``, the delta syncs against the dense ones with ``--delta``."""
    register_s = [p["register_s"] for p in m.peer_runs if "register_s" in p]
    if m.snapshots:
        report["snapshot"] = {"seconds": statistics.median(x["seconds"] for x in m.snapshots),
                              "bytes": m.snapshots[0]["bytes"]}
    report.update(summarise(m.raw_s, m.syncs, m.peer_s, register_s), raw_all_s=m.raw_s, syncs=m.syncs,
                  resolved_loads=m.resolved, peer_all_s=m.peer_s, peer_all=m.peer_runs)
    if len(passes.ways) > 1:
        report["words"] = compare_words(report["modes"], [_signals_label(w) for w in passes.ways])
    if o.delta:
        report["delta"] = delta_summary(m.syncs, o.loads[0])


def _timed_sync(job, raw, version: int, armed: bool, from_snapshot: bool,
                snapshots: list) -> tuple[float, dict[str, Any]]:
    """A raw broadcast, then the sync of ``version`` (armed first, or from a snapshot the bench takes,
    neither timed): the raw seconds and the sync's row."""
    import ray

    cfg = job.cfg
    r = raw()
    if armed:  # the engines get on the group while the trainer "trains" (not timed)
        _arm_and_end_step(job, version)
    if from_snapshot:  # what a train step with a snapshot ends with (not timed)
        snapshots += ray.get([job.trainer.transport_method(w, "take_snapshot").remote(version)
                              for w in range(len(job.trainer.workers))], timeout=cfg.transport.timeout_s)
    s = job.finish_sync(job.start_sync(version, trainer_step=version - 1, from_snapshot=from_snapshot))
    worker = ray.get(job.rollout.engines[0].get_transfer_stats.remote(), timeout=60)
    return r, {"seconds": s.seconds, "send_s": s.send_s, "phases": s.engine_phases, "timeline": s.timeline,
               "copy_plan": worker.get("copy_plan", ""), "signals": worker.get("signals", ""),
               "num_buckets": s.num_buckets,
               "wire_bytes": s.wire_bytes if s.wire_bytes is not None else s.bytes,
               "bytes": s.bytes, "changed_fraction": s.changed_fraction}


def _next_push_as(job, kind: str) -> None:
    import ray

    ray.get([job.trainer.transport_method(w, "next_push_as").remote(kind) for w in range(len(job.trainer.workers))],
            timeout=60)


AFTER_STEP = "after a step"
DELTA_LABELS = {"dense": "{mode}, dense " + AFTER_STEP, "delta": "{mode}, delta " + AFTER_STEP}


def _delta_block(job, o: VllmSyncOptions, raw, version: int, raw_s: list[float],
                 syncs: dict[str, list[dict[str, Any]]]) -> int:
    """``--delta``: each version made by one AdamW step at ``--delta-lr`` on random samples (not
    timed), sent dense and as a delta by turns (each delta against the dense version before it, a
    step's change), in the first load mode, armed where the bench arms; the timed syncs into
    ``syncs`` and their raw broadcasts into ``raw_s``. Returns the last version."""
    import random

    import ray

    mode = o.loads[0]
    ray.get([e.set_load_mode.remote(mode) for e in job.rollout.engines], timeout=60)
    vocab = json.loads((Path(job.model_path) / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    for kind in DELTA_LABELS:
        syncs[DELTA_LABELS[kind].format(mode=mode)] = []
    for i in range(2 * (o.warmup + o.repeats)):
        kind = ("dense", "delta")[i % 2]
        job.trainer.train_step(_random_samples(rng, vocab, version))
        _next_push_as(job, kind)
        version += 1
        r, row = _timed_sync(job, raw, version, o.armed, False, [])
        if i >= 2 * o.warmup:
            raw_s.append(r)
            syncs[DELTA_LABELS[kind].format(mode=mode)].append(row)
        log.warning("%s after a step %d/%d: raw %.4f s, sync %.4f s, %.1f%% of the bytes", kind, i // 2 + 1,
                    o.warmup + o.repeats, r, row["seconds"], 100 * row["wire_bytes"] / max(1, row["bytes"]))
    return version


def _random_samples(rng, vocab: int, version: int, n: int = 8, length: int = 16) -> list:
    """``n`` samples of random tokens with advantages of +-1: a real step's gradients for AdamW."""
    from disagg.samples import TrainSample

    return [TrainSample([rng.randrange(vocab) for _ in range(length)], [rng.randrange(vocab) for _ in range(length)],
                        [-2.0] * length, 1.0 if k % 2 else -1.0, 0.0, version) for k in range(n)]


def delta_summary(syncs: dict[str, list[dict[str, Any]]], mode: str) -> dict[str, Any]:
    """``--delta``: the delta syncs against the dense ones, both after a train step: medians of the
    seconds (the driver's, and the announce -> the last engine serving where stamped), the speed-up,
    the changed fraction and the share of the bytes on the wire. Pure."""
    dense, delta = (syncs[DELTA_LABELS[k].format(mode=mode)] for k in ("dense", "delta"))
    med = statistics.median
    out = {"dense_s": med(r["seconds"] for r in dense), "delta_s": med(r["seconds"] for r in delta),
           "changed_fraction": med(r["changed_fraction"] for r in delta),
           "wire_share": med(r["wire_bytes"] / r["bytes"] for r in delta)}
    out["delta_speedup"] = out["dense_s"] / out["delta_s"]
    if all("worker_out" in r.get("timeline", {}) for r in dense + delta):
        serving = [med(r["timeline"]["worker_out"] for r in runs) for runs in (dense, delta)]
        out.update(dense_serving_s=serving[0], delta_serving_s=serving[1],
                   delta_serving_speedup=serving[0] / serving[1])
    return out


def _traced_sync(job, o: VllmSyncOptions, version: int) -> tuple[str, list[str]]:
    """One more sync of the first mode, its trainer push and each engine worker's receive under the
    profiler (not timed): the push's trace and the workers' (``<trace>.engine<i>.w<rank>.json``)."""
    import ray

    path = Path(o.trace).resolve()
    ray.get(job.trainer.transport_method(0, "trace_next_push").remote(str(path)), timeout=60)
    workers = ray.get([e.trace_next_sync.remote(str(path.with_name(f"{path.stem}.engine{i}{path.suffix}")))
                       for i, e in enumerate(job.rollout.engines)], timeout=60)
    if o.delta:
        _next_push_as(job, "dense")
    ray.get([e.set_load_mode.remote(o.loads[0]) for e in job.rollout.engines], timeout=60)
    if o.armed:
        _arm_and_end_step(job, version)
    job.finish_sync(job.start_sync(version, trainer_step=version - 1))
    return str(path), [w for each in workers for w in each]


_ARM_SETTLE_S = 0.3  # an armed receive's way onto the group (milliseconds; a train step is longer)


def _arm_and_end_step(job, version: int) -> None:
    """An armed sync's run-up, not timed: the engines' receives and the trainer's push on the group while
    the trainer "trains", then that step's end, where each rank's push packs its first buckets
    (``TrainerPush.params_final``, what ``train_step`` ends with) before the driver announces."""
    import ray

    job.arm_sync(version, timeout_s=job.cfg.transport.timeout_s)
    time.sleep(_ARM_SETTLE_S)
    wait_s = job.cfg.transport.timeout_s / 2  # (for each push to be set up: milliseconds, unless it failed)
    ray.get([w.params_final.remote(wait_s) for w in job.trainer.workers], timeout=job.cfg.transport.timeout_s)


SNAPSHOT = "from a snapshot"
WORD_EVENTS = ("trainer_in", "worker_word", "trainer_first", "worker_posted", "worker_out")  # compare_words' columns


def _signals_label(way: str) -> str:
    return f"words via {way}"


def compare_words(modes: dict[str, dict[str, Any]], ways: list[str]) -> dict[str, dict[str, Any]]:
    """``--signals``: for each armed block, its armed sync's word events (``WORD_EVENTS``: seconds after
    the announce, medians) under each way the words went, and the serving time of each against the
    first way's; keyed by the block's label without the way. Pure."""
    out: dict[str, dict[str, Any]] = {}
    for label, m in modes.items():
        if ", armed" not in label or not label.endswith(ways[0]):
            continue
        block = label[: -len(ways[0])].rstrip(", ")
        rows = {}
        for way in ways:
            other = modes.get(f"{block}, {way}")
            if other is None or "announce_to_serving_s" not in other:
                break
            rows[way] = {k: other["timeline"][k] for k in WORD_EVENTS if k in other["timeline"]}
            rows[way]["serving_s"] = other["announce_to_serving_s"]
        else:
            base = rows[ways[0]]["serving_s"]
            for way in ways:
                rows[way]["serving_vs_first"] = base / rows[way]["serving_s"] if rows[way]["serving_s"] > 0 else None
            out[block] = rows
    return out


def _label(mode: str, armed: bool, from_snapshot: bool = False) -> str:
    return f"{mode}, armed" if armed else f"{mode}, {SNAPSHOT}" if from_snapshot else mode


def _ramp_label(first_bucket_bytes: int) -> str:
    """How a block's buckets were laid out (``--first-buckets``)."""
    return f"buckets ramp from {_size_text(first_bucket_bytes)}" if first_bucket_bytes else "buckets all full"


def _size_text(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def parse_sizes(text: str) -> tuple[int, ...]:
    """``--first-buckets``: comma-separated byte counts, each with an optional K, M or G (binary):
    ``0,32M`` -> (0, 33554432). ``ValueError`` naming the bad item."""
    out = []
    for item in text.split(","):
        item = item.strip()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(item[-1:].upper(), 1)
        digits = item[:-1] if scale > 1 else item
        if not digits.isdigit():
            raise ValueError(f"--first-buckets: {item!r} is not a byte count (e.g. 0, 32M, 512K)")
        out.append(int(digits) * scale)
    if len(set(out)) != len(out):
        raise ValueError(f"--first-buckets: {text!r} names a size twice")
    return tuple(out)


def _peer_init(job, cfg, peer: str) -> dict[str, Any]:
    """vllm-nccl: vLLM's own NCCL group between trainer rank 0 and every engine worker; its update info.
    checkpoint-engine: its ParameterServer, rank 0 in the trainer worker, rank 1 + i in engine actor i."""
    import ray

    host, port = job.trainer.transport_endpoint(0)
    if peer == "checkpoint-engine":
        from disagg.peers.ckpt_engine import ps_ranks

        world, ranks = ps_ranks(len(job.rollout.engines), cfg.rollout.tensor_parallel_size, cfg.trainer.num_workers)
        ray.get([job.trainer.transport_method(0, "ckpt_init").remote(host, port, world)]
                + [e.ckpt_init.remote(host, port, rank, world) for e, rank in zip(job.rollout.engines, ranks)],
                timeout=cfg.transport.timeout_s + 30)
        return {}
    world, tp = 1 + job.rollout.num_workers, cfg.rollout.tensor_parallel_size
    ray.get([job.trainer.transport_method(0, "peer_init").remote(host, port, world)]
            + [e.peer_init.remote({"master_address": host, "master_port": port, "rank_offset": 1 + i * tp,
                                   "world_size": world}) for i, e in enumerate(job.rollout.engines)],
            timeout=cfg.transport.timeout_s + 30)
    return ray.get(job.trainer.transport_method(0, "peer_update_info").remote(), timeout=60)


def _peer_sync(job, cfg, peer: str, info: dict[str, Any], i: int) -> dict[str, float]:
    """Iteration ``i`` of the peer: its seconds from the driver's dispatch until every party is done, and
    the parties' own figures (checkpoint-engine: ``register_s`` before that, the trainer's gather and
    update, engine 0's worker)."""
    import ray

    trainer, engines, timeout_s = job.trainer, job.rollout.engines, cfg.transport.timeout_s + 30
    out: dict[str, float] = {}
    if peer == "checkpoint-engine":
        name = f"disagg-bench-{i}"
        out["register_s"] = ray.get(trainer.transport_method(0, "ckpt_register").remote(name), timeout=timeout_s)
        t0 = time.perf_counter()
        sides = ray.get([trainer.transport_method(0, "ckpt_update").remote(name)]
                        + [e.ckpt_receive.remote(name) for e in engines], timeout=timeout_s)
        out["seconds"] = time.perf_counter() - t0
        out.update(sides[0], **{k: v for k, v in sides[1].items() if k.startswith("worker_")})
        return out
    t0 = time.perf_counter()
    sides = ray.get([trainer.transport_method(0, "peer_send").remote()]
                    + [e.peer_receive.remote(info) for e in engines], timeout=timeout_s)
    out["seconds"] = time.perf_counter() - t0
    out.update(sides[0])
    return out


def render(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    gb = report["bytes"] / 1e9
    socket = " over sockets" if report["options"].get("nccl_socket") else ""
    title = (f"disagg bench vllm-sync ({report['machine']}, {report['backend']}{socket}, {gb:.3f} GB, "
             f"{report['engine_workers']} engine worker(s)"
             + "".join(", " + o for o in report["options"]["overrides"]) + ")")
    table = Table(title=title)
    for col in ("measured", "seconds", "GB/s", "raw / this"):
        table.add_column(col, justify="left" if col == "measured" else "right")
    table.add_row("raw broadcast, same group", f"{report['raw_s']:.4f}", f"{gb / report['raw_s']:.2f}", "1.00")
    for layout, n in report.get("layouts", {}).items():  # --first-buckets: the layouts side by side
        table.add_row(f"layout: {layout} ({n} buckets)", "", "", "")
    for mode, m in report["modes"].items():
        table.add_row(f"sync, load={mode}: announce -> serving", f"{m['seconds']:.4f}", f"{gb / m['seconds']:.2f}",
                      f"{m['raw_vs_sync']:.2f}")
        table.add_row("  fixed cost (sync - raw)", f"{m['fixed_s']:.4f}", "", "")
        if "announce_to_serving_s" in m:
            table.add_row("  announce -> the last engine serving (its worker out of the load; clocks of one host)",
                          f"{m['announce_to_serving_s']:.4f}", f"{gb / m['announce_to_serving_s']:.2f}",
                          f"{m['raw_vs_serving']:.2f}")
            table.add_row("    fixed cost (that - raw)", f"{m['fixed_to_serving_s']:.4f}", "", "")
        if "push_to_serving_s" in m:
            table.add_row("  the trainer's push starting -> the last engine serving (their clocks)",
                          f"{m['push_to_serving_s']:.4f}", f"{gb / m['push_to_serving_s']:.2f}",
                          f"{report['raw_s'] / m['push_to_serving_s']:.2f}")
        table.add_row("  trainer send", f"{m['send_s']:.4f}", "", "")
        table.add_row("  driver: announce, Ray dispatch and results", f"{m['driver_s']:.4f}", "", "")
        for k, v in m["phases"].items():
            table.add_row(f"  {PHASES.get(k, k)}", f"{v:.4f}", "", "")
        if SNAPSHOT in mode and "snapshot" in report:
            table.add_row("  the snapshot, made by the train step before (not in the sync): copy + cast",
                          f"{report['snapshot']['seconds']:.4f}", "", "")
        plans = sorted({r.get("copy_plan") or "-" for r in report["syncs"][mode]})
        table.add_row(f"  worker loads by: {', '.join(plans)}", "", "", "")
        if m.get("timeline"):
            table.add_row("  timeline, seconds after the announce (medians):", "", "", "")
            for k, v in m["timeline"].items():
                table.add_row(f"    {k}: {TIMELINE[k]}", f"{v:.4f}", "", "")
    for block, rows in report.get("words", {}).items():  # --signals: the armed words side by side
        first = next(iter(rows))
        table.add_row(f"{block}: the words, seconds after the announce (medians)", "", "", "")
        for way, r in rows.items():
            events = ", ".join(f"{k} {1e3 * r[k]:.2f} ms" for k in WORD_EVENTS if k in r)
            table.add_row(f"  {way}: {events}", f"{r['serving_s']:.4f}", "",
                          f"{r['serving_vs_first']:.2f} ({first} / this)" if r["serving_vs_first"] else "")
    if "delta" in report:
        d = report["delta"]
        table.add_row(f"delta after a step vs dense after a step (changed {100 * d['changed_fraction']:.2f} %, "
                      f"{100 * d['wire_share']:.1f} % of the bytes on the wire)", f"{d['delta_s']:.4f}", "",
                      f"{d['delta_speedup']:.2f}x faster")
        if "delta_serving_speedup" in d:
            table.add_row("  announce -> the last engine serving, delta vs dense", f"{d['delta_serving_s']:.4f}", "",
                          f"{d['delta_serving_speedup']:.2f}x faster")
    if "peer" in report:
        p = report["peer"]
        peer = report["options"]["peer"]
        table.add_row(f"{peer} ({PEERS.get(peer, '')}): same bytes, same engine", f"{p['seconds']:.4f}",
                      f"{gb / p['seconds']:.2f}", f"{p['raw_vs_peer']:.2f}")
        table.add_row("  disagg's fastest sync is this many times faster", f"{p['disagg_speedup']:.2f}x", "", "")
        if "register_s" in p:
            table.add_row("  before each: register (cast, copy into its pinned host memory)", f"{p['register_s']:.4f}",
                          "", "")
            table.add_row("  disagg's fastest sync against register + update",
                          f"{p['disagg_speedup_with_register']:.2f}x", "", "")
    table.caption = f"trainer: {report.get('trainer', '')}"
    # into a file or a pipe (a GPU queue's log, a test) at a width that keeps each row on one line
    Console(width=None if sys.stdout.isatty() else 220).print(table)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="disagg bench vllm-sync", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", choices=("cpu", "cuda", "auto"))
    p.add_argument("--loads", default=None, help="transport.load modes to compare, comma-separated "
                   "(default: direct,layerwise on cuda, layerwise on cpu)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--run-dir", default="runs/bench-vllm-sync")
    p.add_argument("--log-level", default="WARNING")
    p.add_argument("--peer", default=None, choices=tuple(PEERS),
                   help="also sync the same bytes into the same engine through this peer (GPUs)")
    p.add_argument("--no-snapshot", dest="snapshot", action="store_false",
                   help="skip the block pushed from a snapshot (the push of a staleness >= 1 run)")
    p.add_argument("--no-armed", dest="armed", action="store_false",
                   help="skip the blocks with the engines' receives armed before the announce")
    p.add_argument("--trace", default=None, metavar="PATH",
                   help="one more sync at the end, the trainer's push written here as a Chrome trace (torch.profiler), "
                        "each engine worker's receive beside it (PATH's name + .engine<i>.w<rank>)")
    p.add_argument("--delta", action="store_true",
                   help="transport.delta=on: the blocks send dense, then one more block of versions made by real "
                        "AdamW steps, sent dense and as deltas by turns")
    p.add_argument("--delta-lr", type=float, default=VllmSyncOptions.delta_lr,
                   help="--delta: the trainer's learning rate (default %(default)g)")
    p.add_argument("--nccl-socket", action="store_true",
                   help="NCCL over its socket transport (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1): two nodes' stand-in")
    p.add_argument("--first-buckets", default=None, metavar="SIZES",
                   help="run the blocks once per transport.first_bucket_bytes in this list (e.g. 0,32M: "
                        "without and with the buckets' ramp), side by side")
    p.add_argument("--signals", default=None, metavar="WAYS",
                   help="run the blocks once per transport.signals in this list (store,socket: the words that "
                        "start an armed sync through the groups' stores, then over sockets), side by side")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the report as JSON")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="`disagg train` overrides (e.g. shape=qwen2.5-1.5b cluster=gpu)")
    a = vars(p.parse_args(argv))
    json_path = a.pop("json")
    a["loads"] = tuple(a["loads"].split(",")) if a["loads"] else ()
    try:
        a["first_buckets"] = parse_sizes(a["first_buckets"]) if a["first_buckets"] else ()
    except ValueError as e:
        p.error(str(e))
    a["signals"] = tuple(a["signals"].split(",")) if a["signals"] else ()
    a["overrides"] = tuple(a["overrides"])
    bad = [x for x in a["overrides"] if "=" not in x]
    if bad:
        p.error(f"overrides must be key=value, got {bad}")
    if a["repeats"] < 1 or a["warmup"] < 0:
        p.error(f"--repeats must be >= 1 and --warmup >= 0, got {a['repeats']} and {a['warmup']}")
    try:
        opts = resolve_options(a, visible_gpus() if a["device"] != "cpu" else 0)
    except ValueError as e:
        p.error(str(e))
    setup_logging("bench", opts.log_level)
    report = run(opts)
    render(report)
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2))
        print(f"wrote {json_path}", file=sys.stderr)
    return 0

