"""``disagg bench vllm-sync``: a weight sync into a real vLLM engine, phase by phase, against a raw
broadcast of the same bytes over the same group, in one run.

A whole job starts as ``disagg train`` would (coordinator, trainer worker, vLLM engines on dummy
weights, the transport group), at the shape and cluster its overrides pick. After a first sync
(dummy -> real weights, not timed), each iteration measures, one after the other:

  raw        one broadcast of the manifest's bytes from the trainer to every engine worker over the
             job's own transport group (no disagg code on the wire: the rate the hardware gives)
  <load>     a sync of the next policy version for each ``--loads`` mode (``transport.load``: direct,
             layerwise), from the announce to every engine serving it (acknowledged) - what the
             loop waits for - with each phase's seconds as the engine actor and vLLM's worker saw them

and reports medians: each mode's seconds, raw / sync (the share of the raw rate a sync reaches), the
fixed cost (sync - raw) and the phases. Nothing here is a timed test.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from disagg.bench.pipeline import _composed, _machine, _visible_gpus, bench_device, gpu_overrides
from disagg.logs import setup_logging

log = logging.getLogger("disagg.bench")

PHASES = {  # engine phase key -> what it is (the order of a sync)
    "manifest_s": "manifest from the coordinator",
    "quiesce_s": "requests added, aborted or frozen",
    "start_s": "start_weight_update (RPC; layerwise: nothing yet)",
    "update_s": "update_weights (RPC: wire + loads)",
    "finish_s": "finish_weight_update (RPC; layerwise: finalize)",
    "reset_cache_s": "reset_prefix_cache (RPC)",
    "resume_s": "resume (when paused)",
    "ack_s": "coordinator ack + worker stats",
    "worker_receive_s": "worker: receive loop (wire + loads)",
    "worker_load_s": "worker: vLLM load_weights calls",
    "worker_reload_init_s": "worker: initialize_layerwise_reload",
    "worker_finalize_s": "worker: finalize_layerwise_reload",
}


@dataclasses.dataclass(frozen=True)
class VllmSyncOptions:
    device: str = "auto"  # cpu | cuda | auto
    loads: tuple[str, ...] = ("layerwise",)  # transport.load modes compared (cuda default: direct, layerwise)
    repeats: int = 5
    warmup: int = 1  # untimed iterations after the first sync
    run_dir: str = "runs/bench-vllm-sync"
    log_level: str = "WARNING"
    overrides: tuple[str, ...] = ()


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
    values["loads"] = loads
    overrides = tuple(values.get("overrides", ()))
    values["overrides"] = gpu_overrides(overrides, gpus) if device == "cuda" else overrides
    return VllmSyncOptions(**values)


def summarise(raw_s: list[float], syncs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians of the timed iterations: raw seconds, and per load mode its seconds, raw/sync, fixed
    cost (sync - raw) and each phase's median. Pure."""
    raw = statistics.median(raw_s)
    out: dict[str, Any] = {"raw_s": raw, "modes": {}}
    for mode, runs in syncs.items():
        seconds = statistics.median(r["seconds"] for r in runs)
        keys = sorted({k for r in runs for k in r["phases"]}, key=lambda k: list(PHASES).index(k) if k in PHASES else 99)
        # the driver's share: the announce (gRPC), Ray's dispatch of the calls and the gathering of results
        driver = [r["seconds"] - sum(v for k, v in r["phases"].items() if not k.startswith("worker_")) for r in runs]
        out["modes"][mode] = {
            "seconds": seconds, "raw_vs_sync": raw / seconds if seconds > 0 else None, "fixed_s": seconds - raw,
            "send_s": statistics.median(r["send_s"] for r in runs), "driver_s": statistics.median(driver),
            "phases": {k: statistics.median(r["phases"].get(k, 0.0) for r in runs) for k in keys},
        }
    return out


def _config(o: VllmSyncOptions):
    from disagg.config import load_config

    data = _composed(o.overrides)
    data.setdefault("cluster", {})["device"] = o.device
    data.setdefault("logging", {}).update(progress=False, backends=["jsonl"], plot=False)
    data.setdefault("model", {}).setdefault("warmstart", {})["steps"] = 0  # the weights' values do not matter
    return load_config(data)


def run(o: VllmSyncOptions) -> dict[str, Any]:
    import ray

    from disagg.job import Job
    from disagg.model.warmstart import prepare_model

    cfg = _config(o)
    run_dir = Path(o.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"options": dataclasses.asdict(o), "date": time.strftime("%Y-%m-%d %H:%M"),
                              "machine": _machine(o.device)}
    model_path = prepare_model(cfg)
    job = Job.start(cfg, run_dir, model_path)
    try:
        engines = job.rollout.engines
        version = 1
        first = job.sync_weights(version, trainer_step=0)
        nbytes = first.bytes
        report.update(bytes=nbytes, backend=job.backend, engines=len(engines),
                      engine_workers=job.rollout.num_workers, first_sync_s=first.seconds)
        raw_s: list[float] = []
        syncs: dict[str, list[dict[str, Any]]] = {m: [] for m in o.loads}
        resolved = {}
        for i in range(o.warmup + o.repeats):
            sides = ray.get([job.trainer.transport_method(0, "raw_send").remote(nbytes, 1)]
                            + [e.raw_receive.remote(nbytes, 1) for e in engines], timeout=cfg.transport.timeout_s + 30)
            if i >= o.warmup:
                raw_s.append(max(s[0] for s in sides))
            for mode in o.loads:
                resolved[mode] = ray.get([e.set_load_mode.remote(mode) for e in engines], timeout=60)[0]
                version += 1
                s = job.sync_weights(version, trainer_step=version - 1)
                if i >= o.warmup:
                    syncs[mode].append({"seconds": s.seconds, "send_s": s.send_s, "phases": s.engine_phases})
            log.warning("iteration %d/%d: raw %.3f s, %s", i + 1, o.warmup + o.repeats, max(s[0] for s in sides),
                        ", ".join(f"{m} {syncs[m][-1]['seconds']:.3f} s" for m in o.loads if syncs[m]))
        report.update(summarise(raw_s, syncs), raw_all_s=raw_s, syncs=syncs, resolved_loads=resolved)
    finally:
        job.shutdown()
        ray.shutdown()
    return report


def render(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    gb = report["bytes"] / 1e9
    title = (f"disagg bench vllm-sync ({report['machine']}, {report['backend']}, {gb:.3f} GB, "
             f"{report['engine_workers']} engine worker(s)"
             + "".join(", " + o for o in report["options"]["overrides"]) + ")")
    table = Table(title=title)
    for col in ("measured", "seconds", "GB/s", "raw / this"):
        table.add_column(col, justify="left" if col == "measured" else "right")
    table.add_row("raw broadcast, same group", f"{report['raw_s']:.3f}", f"{gb / report['raw_s']:.2f}", "1.00")
    for mode, m in report["modes"].items():
        table.add_row(f"sync, load={mode}: announce -> serving", f"{m['seconds']:.3f}", f"{gb / m['seconds']:.2f}",
                      f"{m['raw_vs_sync']:.2f}")
        table.add_row("  fixed cost (sync - raw)", f"{m['fixed_s']:.3f}", "", "")
        table.add_row("  trainer send", f"{m['send_s']:.3f}", "", "")
        table.add_row("  driver: announce, Ray dispatch and results", f"{m['driver_s']:.3f}", "", "")
        for k, v in m["phases"].items():
            table.add_row(f"  {PHASES.get(k, k)}", f"{v:.3f}", "", "")
    Console().print(table)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="disagg bench vllm-sync", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", choices=("cpu", "cuda", "auto"))
    p.add_argument("--loads", default=None, help="transport.load modes to compare, comma-separated "
                   "(default: direct,layerwise on cuda, layerwise on cpu)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--run-dir", default="runs/bench-vllm-sync")
    p.add_argument("--log-level", default="WARNING")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the report as JSON")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="`disagg train` overrides (e.g. shape=qwen2.5-1.5b cluster=gpu)")
    a = vars(p.parse_args(argv))
    json_path = a.pop("json")
    a["loads"] = tuple(a["loads"].split(",")) if a["loads"] else ()
    a["overrides"] = tuple(a["overrides"])
    bad = [x for x in a["overrides"] if "=" not in x]
    if bad:
        p.error(f"overrides must be key=value, got {bad}")
    if a["repeats"] < 1 or a["warmup"] < 0:
        p.error(f"--repeats must be >= 1 and --warmup >= 0, got {a['repeats']} and {a['warmup']}")
    try:
        opts = resolve_options(a, _visible_gpus() if a["device"] != "cpu" else 0)
    except ValueError as e:
        p.error(str(e))
    setup_logging("bench", opts.log_level)
    report = run(opts)
    render(report)
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2))
        print(f"wrote {json_path}", file=sys.stderr)
    return 0

