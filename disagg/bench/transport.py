"""``disagg bench transport``: disagg's weight sync against the baselines, in one run.

For one parameter set (a Qwen2 shape with random weights) it measures, on the
same actors and groups:

  (a) raw        one broadcast of a flat buffer of the model's bytes
  (b) send       disagg's sync, receivers discarding what they receive
  (c) send_load  disagg's sync, receivers loading into their model
  (d) per_param  one broadcast per parameter (the per-tensor baseline)
  (e) object_store  the parameters through Ray's object store via the driver

and prints the rates and the ratios b/a, c/a, b/d, b/e. Trainer ranks and
receivers are Ray actors in two placement groups; the time of an iteration is
that of the slowest rank taking part, after a barrier; the median over
``--repeats`` iterations (after ``--warmup``) is reported.

This module must never import grpc or vLLM: it runs on GPU machines that lack
them.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from disagg.bench.shapes import shape_names
from disagg.logs import ray_get_logged, setup_logging
from disagg.transport.manifest import Manifest

log = logging.getLogger("disagg.bench")

MEASUREMENTS = {
    "raw": "(a) one raw broadcast, flat buffer",
    "send": "(b) disagg sync, send only",
    "send_load": "(c) disagg sync + receivers' load",
    "per_param": "(d) one broadcast per parameter",
    "object_store": "(e) Ray object store via the driver",
}
# Letters of the measurements --skip may leave out; (a)-(c) are what the ratios are about.
SKIPPABLE = {"d": "per_param", "e": "object_store"}
RATIOS = {  # JSON key: (numerator rate, denominator rate)
    "send_vs_raw": ("send", "raw"),
    "send_load_vs_raw": ("send_load", "raw"),
    "send_vs_per_param": ("send", "per_param"),
    "send_vs_object_store": ("send", "object_store"),
}


@dataclass(frozen=True)
class BenchOptions:
    shape: str = "tiny"  # a name from disagg.bench.shapes.SHAPES
    num_trainer_ranks: int = 1  # trainer actors; > 1 shards the model with FSDP2
    num_receivers: int = 1  # receiver actors
    device: str = "auto"  # cpu, cuda, or auto (cuda when this process sees a GPU)
    source: str = "gather"  # gather: rank 0 sends full tensors; shards: every trainer rank sends its shard
    bucket_mb: int | None = None  # bucket size in MiB; default 1024 on cuda, 64 on cpu
    num_buffers: int = 2  # bucket buffers per side: packing/loading one bucket overlaps the wire of the next
    verify: bool = False  # per-bucket checksums (transport.verify), to measure their cost
    repeats: int = 5  # timed iterations per measurement; the median is reported
    warmup: int = 1  # untimed iterations before them
    dtype: str = "bfloat16"  # model and wire dtype: bfloat16 or float32
    skip: frozenset[str] = frozenset()  # measurement letters to leave out: d, e
    check: bool = False  # after (c), compare every receiver's tensors with trainer rank 0's, bit for bit
    object_store_max_bytes: int = 2 * 2**30  # (e) moves the leading parameters that fit in this many bytes
    address: str | None = None  # Ray cluster to join; default: start a local one
    timeout_s: float = 300.0  # every rendezvous, collective and Ray wait
    log_level: str = "WARNING"
    argv: tuple[str, ...] = field(default=())  # the command line, for the report


def object_store_subset(sizes: list[tuple[str, int]], max_bytes: int) -> list[str]:
    """The parameters (e) moves: in manifest order, each one that still fits in ``max_bytes``. Pure."""
    chosen, used = [], 0
    for name, nbytes in sizes:
        if used + nbytes <= max_bytes:
            chosen.append(name)
            used += nbytes
    return chosen


def summarise(seconds: dict[str, float], total_bytes: int, object_store_bytes: int) -> dict[str, float | None]:
    """GB/s of each measurement and the ratios of the rates; None for a measurement not made. Pure."""
    rates: dict[str, float | None] = {}
    for kind in MEASUREMENTS:
        nbytes = object_store_bytes if kind == "object_store" else total_bytes
        s = seconds.get(kind)
        rates[kind] = nbytes / s / 1e9 if s else None
    out: dict[str, float | None] = {f"{k}_gb_per_s": v for k, v in rates.items()}
    for key, (num, den) in RATIOS.items():
        out[key] = rates[num] / rates[den] if rates[num] and rates[den] else None
    return out


def _median_of_slowest(per_rank: list[dict], warmup: int) -> tuple[float, list[float]]:
    """Median over iterations of the slowest taking-part rank's time; also every iteration's time."""
    runs = [r["seconds"] for r in per_rank if r["seconds"] is not None]
    per_iteration = [max(ts) for ts in zip(*runs)][warmup:]
    return statistics.median(per_iteration), per_iteration


class _Bench:
    """The actors and groups of one run; ``run`` drives the measurements."""

    def __init__(self, opts: BenchOptions, device: str) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from disagg.bench.workers import BenchReceiver, BenchTrainer

        self.opts, self.device = opts, device
        self.backend = "nccl" if device == "cuda" else "gloo"
        r, n = opts.num_trainer_ranks, opts.num_receivers
        bundle = {"CPU": 1.0, "GPU": 1.0} if device == "cuda" else {"CPU": 1.0}
        self.pgs = [placement_group([dict(bundle)] * r, strategy="PACK", name="disagg-bench-trainer"),
                    placement_group([dict(bundle)] * n, strategy="PACK", name="disagg-bench-receivers")]
        self._get([pg.ready() for pg in self.pgs], "placement groups (trainer, receivers)")
        gpus = 1 if device == "cuda" else 0

        def place(pg, i):
            return PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)

        common = dict(shape=opts.shape, device=device, dtype=opts.dtype, source=opts.source,
                      num_buffers=opts.num_buffers, verify=opts.verify, log_level=opts.log_level)
        self.trainers = [
            ray.remote(BenchTrainer).options(num_cpus=1, num_gpus=gpus, scheduling_strategy=place(self.pgs[0], i))
            .remote(i, r, timeout_s=opts.timeout_s, **common) for i in range(r)]
        self.receivers = [
            ray.remote(BenchReceiver).options(num_cpus=1, num_gpus=gpus, scheduling_strategy=place(self.pgs[1], j))
            .remote(j, **common) for j in range(n)]

    def _get(self, refs, what: str, timeout_s: float | None = None):
        return ray_get_logged(refs, what=what, timeout_s=timeout_s or self.opts.timeout_s, log=log)

    def setup(self, bucket_bytes: int) -> dict[str, Any]:
        """Build the models, plan the manifest, join the groups, allocate the baselines' buffers."""
        rank0 = self.trainers[0]
        master = (None, None)
        if len(self.trainers) > 1:
            master = (self._get(rank0.node_ip.remote(), "trainer rank 0 address"),
                      self._get(rank0.free_port.remote(), "trainer rank 0 port"))
        t0 = time.perf_counter()
        infos = self._get([t.setup.remote(*master) for t in self.trainers] + [r.setup.remote() for r in self.receivers],
                          "building the models")
        log.info("models built in %.1f s", time.perf_counter() - t0)
        manifest = self._get(rank0.build_manifest.remote(bucket_bytes), "the manifest")
        self._get([a.set_manifest.remote(manifest) for a in self.trainers + self.receivers], "handing out the manifest")

        from disagg.transport.model_transfer import source_groups_needed

        for r in range(source_groups_needed(self.opts.source, len(self.trainers))):
            self._join(r)
        self._get([rank0.prepare_baselines.remote(True)] + [r.prepare_baselines.remote(False) for r in self.receivers],
                  "allocating the baseline buffers")
        return {"manifest": manifest, "trainer": infos[0]}

    def _join(self, source_rank: int) -> None:
        """Trainer rank ``source_rank`` and every receiver join its source group; the trainer hosts the store."""
        trainer = self.trainers[source_rank]
        host = self._get(trainer.node_ip.remote(), f"trainer rank {source_rank} address")
        port = self._get(trainer.free_port.remote(), f"a free port on trainer rank {source_rank}")
        kw = dict(host=host, port=port, world_size=1 + len(self.receivers), backend=self.backend,
                  timeout_s=self.opts.timeout_s)
        refs = [trainer.join.remote(**kw)] + [r.join.remote(source_rank, **kw) for r in self.receivers]
        self._get(refs, f"joining source group {source_rank} ({1 + len(self.receivers)} ranks)")

    def measure(self, kind: str) -> dict[str, Any]:
        """Run ``kind`` on every actor taking part; the median of the slowest rank's times."""
        iters = self.opts.warmup + self.opts.repeats
        actors = [self.trainers[0]] if kind in ("raw", "per_param") else self.trainers
        refs = [a.measure.remote(kind, iters) for a in actors + self.receivers]
        per_rank = self._get(refs, f"measurement {kind}", timeout_s=self.opts.timeout_s * iters)
        median, samples = _median_of_slowest(per_rank, self.opts.warmup)
        log.info("%s: median %.4f s over %d iterations", kind, median, len(samples))
        out: dict[str, Any] = {"seconds": median, "samples_s": samples}
        peaks = per_rank[0].get("peak_extra_bytes")
        if peaks:
            out["peak_extra_bytes"] = max(peaks[self.opts.warmup:])
            out["peak_extra_bytes_first"] = peaks[0]
        return out

    def measure_object_store(self, names: list[str]) -> dict[str, Any]:
        """Trainer rank 0 puts the tensors, the driver hands the ref to each receiver, they get and copy."""
        samples = []
        for _ in range(self.opts.warmup + self.opts.repeats):
            t0 = time.perf_counter()
            refs = self._get(self.trainers[0].put_params.remote(names), "ray.put on trainer rank 0")
            self._get([r.fetch.remote(refs, names, self.opts.timeout_s) for r in self.receivers],
                      "receivers taking the object")
            samples.append(time.perf_counter() - t0)
            del refs
        samples = samples[self.opts.warmup:]
        return {"seconds": statistics.median(samples), "samples_s": samples}

    def check(self) -> dict[str, Any]:
        """Every receiver's model against trainer rank 0's full tensors, tensor by tensor."""
        sums = self._get([t.checksums.remote() for t in self.trainers] + [r.checksums.remote() for r in self.receivers],
                         "checksums")
        unloaded = self._get([r.unloaded_entries.remote() for r in self.receivers], "receivers' unloaded entries")
        want = sums[0]
        problems = []
        for j, (got, extra) in enumerate(zip(sums[len(self.trainers):], unloaded)):
            bad = sorted(n for n in want if got.get(n) != want[n])
            if bad:
                problems.append(f"receiver {j}: {len(bad)} of {len(want)} tensors differ (first {bad[:3]})")
            if extra:
                problems.append(f"receiver {j}: {len(extra)} state-dict entries not carried (first {extra[:3]})")
        return {"passed": not problems, "num_tensors": len(want), "problems": problems}

    def shutdown(self) -> None:
        """Close the groups (trainer rank 0, which hosts the stores, last) and release the actors.

        Runs after failures too: an actor that died or hangs is killed without its close.
        """
        import ray

        for actors in (self.receivers, self.trainers[1:], self.trainers[:1]):
            refs = [a.close.remote() for a in actors]
            ray.wait(refs, num_returns=len(refs), timeout=self.opts.timeout_s)
        for a in self.trainers + self.receivers:
            ray.kill(a)
        for pg in self.pgs:
            ray.util.remove_placement_group(pg)


def _resolve_device(opts: BenchOptions) -> str:
    import torch

    if opts.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if opts.device not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu, cuda or auto, got {opts.device!r}")
    return opts.device


def _validate(opts: BenchOptions) -> None:
    from disagg.bench.shapes import SHAPES
    from disagg.transport.model_transfer import SOURCES

    if opts.shape not in SHAPES:
        raise ValueError(f"--shape {opts.shape!r} is not one of {', '.join(SHAPES)}")
    if opts.num_trainer_ranks < 1 or opts.num_receivers < 1:
        raise ValueError(f"--trainer-ranks={opts.num_trainer_ranks} and --receivers={opts.num_receivers} must be >= 1")
    if opts.repeats < 1 or opts.warmup < 0:
        raise ValueError(f"--repeats={opts.repeats} must be >= 1 and --warmup={opts.warmup} >= 0")
    if opts.dtype not in ("bfloat16", "float32"):
        raise ValueError(f"--dtype must be bfloat16 or float32, got {opts.dtype!r}")
    unknown = set(opts.skip) - set(SKIPPABLE)
    if unknown:
        raise ValueError(f"--skip takes measurement letters {sorted(SKIPPABLE)}, got {sorted(unknown)}")
    if opts.source not in SOURCES:
        raise ValueError(f"--source must be one of {SOURCES}, got {opts.source!r}")
    if opts.num_buffers < 1:
        raise ValueError(f"--num-buffers={opts.num_buffers} must be >= 1")


def run(opts: BenchOptions) -> dict[str, Any]:
    """Run every measurement once and return the report (the JSON written by ``--json``)."""
    import ray

    _validate(opts)
    device = _resolve_device(opts)
    bucket_bytes = (opts.bucket_mb or (1024 if device == "cuda" else 64)) * 2**20
    started = not ray.is_initialized()
    if started:
        if opts.address:
            ray.init(address=opts.address, log_to_driver=True)
        else:
            need = opts.num_trainer_ranks + opts.num_receivers
            ray.init(num_cpus=max(os.cpu_count() or 1, need), include_dashboard=False, log_to_driver=True)
    bench = None
    try:
        bench = _Bench(opts, device)
        info = bench.setup(bucket_bytes)
        manifest = Manifest.from_dict(info["manifest"])
        results: dict[str, dict[str, Any]] = {}
        for kind in ("raw", "per_param", "send", "send_load"):
            if kind == "per_param" and "d" in opts.skip:
                continue
            results[kind] = bench.measure(kind)
        check = bench.check() if opts.check else None
        names = object_store_subset([(t.name, t.nbytes) for t in manifest.tensors], opts.object_store_max_bytes)
        sizes = {t.name: t.nbytes for t in manifest.tensors}
        object_store_bytes = sum(sizes[n] for n in names)
        if "e" not in opts.skip:
            results["object_store"] = bench.measure_object_store(names)
    finally:
        if bench is not None:
            bench.shutdown()
        if started:
            ray.shutdown()

    seconds = {k: v["seconds"] for k, v in results.items()}
    return {
        **summarise(seconds, manifest.total_bytes, object_store_bytes),
        "shape": opts.shape, "bytes": manifest.total_bytes, "ranks": opts.num_trainer_ranks,
        "receivers": opts.num_receivers, "device": device, "backend": bench.backend, "source": opts.source,
        "dtype": opts.dtype, "bucket_bytes": bucket_bytes, "num_buckets": len(manifest.buckets),
        "num_tensors": len(manifest.tensors), "num_buffers": opts.num_buffers, "verify": opts.verify,
        "object_store_bytes": object_store_bytes if "e" not in opts.skip else None,
        "object_store_num_tensors": len(names) if "e" not in opts.skip else None,
        "peak_extra_bytes_rank0": results["send"].get("peak_extra_bytes"),
        "peak_extra_bytes_rank0_first_sync": results["send"].get("peak_extra_bytes_first"),
        "seconds": seconds, "samples_s": {k: v["samples_s"] for k, v in results.items()},
        "iterations": {"warmup": opts.warmup, "repeats": opts.repeats},
        "check": check,
        "torch": info["trainer"]["torch"], "transformers": info["trainer"]["transformers"],
        "nccl": info["trainer"]["nccl"], "gpu": info["trainer"]["gpu"],
        "torch_threads": info["trainer"]["torch_threads"],
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(opts.argv) if opts.argv else None,
        "options": {k: (sorted(v) if isinstance(v, frozenset) else v) for k, v in asdict(opts).items()},
    }


def render(report: dict[str, Any]) -> None:
    """Print the report as a rich table: one row per measurement, then the ratios."""
    from rich.console import Console
    from rich.table import Table

    gpu = f" ({report['gpu']})" if report["gpu"] else ""
    title = (f"{report['shape']}: {report['bytes'] / 1e9:.3f} GB in {report['num_tensors']} tensors, "
             f"{report['ranks']} trainer rank(s) -> {report['receivers']} receiver(s), {report['device']}{gpu}, "
             f"{report['backend']}, source={report['source']}")
    table = Table(title=title)
    for col in ("measurement", "seconds (median)", "GB/s", "vs raw"):
        table.add_column(col, justify="left" if col == "measurement" else "right")
    raw = report["raw_gb_per_s"]
    for kind, label in MEASUREMENTS.items():
        rate = report[f"{kind}_gb_per_s"]
        if rate is None:
            table.add_row(label, "skipped", "", "")
            continue
        if kind == "object_store" and report["object_store_bytes"] != report["bytes"]:
            label += f" ({report['object_store_bytes'] / 1e9:.2f} GB subset)"
        table.add_row(label, f"{report['seconds'][kind]:.4f}", f"{rate:.2f}", f"{rate / raw:.2f}")
    table.add_section()
    for key, text in (("send_vs_raw", "b/a"), ("send_load_vs_raw", "c/a"), ("send_vs_per_param", "b/d"),
                      ("send_vs_object_store", "b/e")):
        value = report[key]
        table.add_row(f"ratio {text}", "", f"{value:.2f}" if value is not None else "-", "")
    console = Console()
    console.print(table)
    nccl = f", nccl {report['nccl']}" if report["nccl"] else ""
    console.print(f"bucket {report['bucket_bytes'] / 2**20:.0f} MiB x {report['num_buckets']}, "
                  f"num_buffers={report['num_buffers']}, verify={report['verify']}, {report['dtype']}, "
                  f"torch {report['torch']}{nccl}, {report['iterations']['repeats']} repeats after "
                  f"{report['iterations']['warmup']} warm-up")
    if report["peak_extra_bytes_rank0"] is not None:
        console.print(f"trainer rank 0 peak extra memory during a sync: {report['peak_extra_bytes_rank0'] / 2**20:.0f} "
                      f"MiB ({report['peak_extra_bytes_rank0_first_sync'] / 2**20:.0f} MiB in the first, "
                      "which allocates the sender's buckets)")
    if report["check"] is not None:
        c = report["check"]
        console.print(f"check: {'passed' if c['passed'] else 'FAILED'} ({c['num_tensors']} tensors per receiver)"
                      + "".join(f"\n  {p}" for p in c["problems"]))


def parse_args(argv: list[str]) -> tuple[BenchOptions, str | None]:
    p = argparse.ArgumentParser(
        prog="disagg bench transport",
        description="Weight sync vs raw broadcast, per-parameter broadcast and Ray's object store.")
    p.add_argument("--shape", default="tiny", choices=shape_names())
    p.add_argument("--trainer-ranks", type=int, default=1, help="trainer actors (> 1: FSDP2-sharded)")
    p.add_argument("--receivers", type=int, default=1)
    p.add_argument("--device", default="auto", choices=("cpu", "cuda", "auto"))
    p.add_argument("--source", default="gather", choices=("gather", "shards"))
    p.add_argument("--bucket-mb", type=int, default=None, help="bucket size in MiB (default 1024 on cuda, 64 on cpu)")
    p.add_argument("--num-buffers", type=int, default=2, help="bucket buffers per side (pipeline depth)")
    p.add_argument("--verify", action="store_true", help="per-bucket checksums (transport.verify)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--skip", default="", help="measurements to leave out, comma-separated: d (per parameter), "
                                              "e (object store)")
    p.add_argument("--check", action="store_true", help="verify every receiver bit for bit after the run")
    p.add_argument("--object-store-max-bytes", type=int, default=2 * 2**30)
    p.add_argument("--address", default=None, help="Ray cluster address (default: start a local cluster)")
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--log-level", default="WARNING")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the report as JSON")
    a = p.parse_args(argv)
    opts = BenchOptions(
        shape=a.shape, num_trainer_ranks=a.trainer_ranks, num_receivers=a.receivers, device=a.device,
        source=a.source, bucket_mb=a.bucket_mb, num_buffers=a.num_buffers, verify=a.verify, repeats=a.repeats,
        warmup=a.warmup, dtype=a.dtype, skip=frozenset(x for x in a.skip.replace(",", " ").split()), check=a.check,
        object_store_max_bytes=a.object_store_max_bytes, address=a.address, timeout_s=a.timeout_s,
        log_level=a.log_level, argv=("disagg", "bench", "transport", *argv))
    return opts, a.json


def main(argv: list[str]) -> int:
    """Entry point of ``disagg bench transport``; 1 when ``--check`` failed."""
    opts, json_path = parse_args(argv)
    setup_logging("bench", opts.log_level)
    report = run(opts)
    render(report)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {json_path}", file=sys.stderr)
    return 0 if report["check"] is None or report["check"]["passed"] else 1
