"""``disagg bench pipeline``: what the asynchronous pipeline buys, measured side by side in one run.

Three comparisons with real Ray, vLLM engines and trainer. On CPU (the default)
on the embedded tiny model; with ``--device cuda`` on the embedded model at
Qwen2.5-0.5B's shape (``shape=qwen2.5-0.5b``) with realistic lengths
(``GPU_DEFAULTS``) on ``cluster=gpu`` (a GPU for the trainer and one for the
engine) or, with one GPU visible, ``cluster=one_gpu`` (both share it). Trailing
``key=value`` arguments compose ``configs/train.yaml`` with them, as
``disagg train`` does, under the bench's own settings:

  long tail      response lengths drawn from a heavy-tailed distribution (most
                 short, a few near the cap; ``ignore_eos`` makes each length
                 exact): trained tokens per second of three runs on the same
                 length sequence: ``batch`` (the synchronous pattern, staleness 0:
                 each step waits for its slowest group, nothing generates while it
                 trains), ``batch_async`` (the same scheduler at
                 ``--tail-staleness``: the next step's groups generate while this
                 one trains, one-step off-policy) and ``stream``
                 (``rollout.scheduler=stream`` at ``--tail-staleness``). Stream vs
                 batch is the scheduler's gain at one staleness (stream /
                 batch_async); async + stream vs sync + batch is stream / batch.
                 ``--tail-sync-interval N`` > 1 adds ``stream_interval``: the
                 stream run with the engines taking every N-th version
                 (``algorithm.sync_interval``), and its ratio to batch.
                 ``--tail-runs stream,batch`` makes only the runs named (a
                 ratio needs both of its runs); there ``stream_keep`` and
                 ``stream_resubmit`` are the stream run with the engines keeping
                 or resubmitting the requests in flight at a sync
                 (``rollout.in_flight_at_sync``, switched between runs), and a
                 keep run beside a resubmit run gives keep vs resubmit: what
                 ``auto`` should pick on that vLLM.
  reward overlap a reward with a set latency per sample, chosen so that the total
                 reward time of a batch (the sum over its samples) equals the
                 rollout time measured without it: the time from a step's start to
                 its batch being ready, rewards scored by the worker pool while
                 generation goes on vs. after the whole batch was generated, each
                 divided by the longer stage. Response lengths vary and the engine's
                 concurrency is bounded, so groups finish over the whole rollout.
  async vs sync  samples per second of ``max_staleness=1`` vs ``0`` on the default
                 task from the same initial weights (``--async-max-tokens``: every
                 response that long), after the first
                 ``--async-warmup-steps`` (the engine's and the trainer's first
                 step cost seconds of one-off warm-up in both runs; the ratio with
                 them is reported too), and the step (and seconds) at which each
                 run's reward first reaches the threshold.

Nothing here is a timed test: it prints the ratios and, with ``--json``, writes
them with the raw figures behind them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from disagg.bench.common import bench_device, gpu_overrides, machine, visible_gpus
from disagg.config.files import compose_train
from disagg.logs import setup_logging

log = logging.getLogger("disagg.bench")


@dataclasses.dataclass(frozen=True)
class PipelineBenchOptions:
    device: str = "cpu"  # cpu | cuda | auto (cuda where this process sees a GPU)
    tail_steps: int = 64  # train steps per scheduler in the long-tail comparison
    # train steps of each stream run there (0: tail_steps): long enough that a stream's one-off fill
    # (its first batch waits for a whole wave of groups in flight) is a small part of its run, as in
    # a training run, where a batch run's steps are alike from the first
    tail_stream_steps: int = 0
    tail_warmup_steps: int = 2  # batch steps run first and not measured (the engine's one-off warm-up)
    tail_short: int = 4  # most responses: this many tokens
    tail_long: int = 96  # the tail: this many tokens
    tail_fraction: float = 0.1  # share of prompts whose responses are long
    tail_staleness: int = 16  # the staleness limit of the stream run (batch: 0, the synchronous pattern)
    tail_inflight: int = 16  # rollout.max_inflight_groups of the stream scheduler
    tail_prompts: int = 8  # prompts per step there (groups of 4)
    tail_sync_interval: int = 1  # > 1: a fourth run, the stream with algorithm.sync_interval this
    tail_runs: str = "all"  # the long-tail runs to make, comma-separated (batch, batch_async, stream,
    # stream_interval, stream_keep, stream_resubmit)
    overlap_steps: int = 10  # steps per variant in the reward-overlap comparison
    overlap_max_seqs: int = 32  # engine concurrency there: a step's groups finish in waves
    overlap_prompts: int = 16  # prompts per step there (groups of 8)
    overlap_min_tokens: int = 4  # response lengths there: uniform in [min, max]
    overlap_max_tokens: int = 24
    reward_workers: int = 4  # reward.num_workers there
    async_steps: int = 120  # steps per run in the async-vs-sync comparison
    async_warmup_steps: int = 5  # first steps left out of the throughput (engine and trainer warm-up, both runs)
    async_max_tokens: int = 0  # > 0: every response exactly this long (ignore_eos); 0: the task's lengths
    async_prompts: int = 0  # prompts per step there; 0: the config's algorithm.prompts_per_step
    threshold: float = 0.75  # reward (10-step moving mean) both runs must reach
    cpus: int | None = None  # Ray CPUs (default: the machine's)
    pin_pools: bool = True  # engines on the first half of the cores, the trainer on the rest (both sides alike)
    run_dir: str = "runs/bench-pipeline"
    log_level: str = "WARNING"
    overrides: tuple[str, ...] = ()  # `disagg train` overrides (key=value) composed under the bench's settings


GPU_DEFAULTS: dict[str, Any] = {
    # Qwen2.5-0.5B's shape with lengths a post-training run sees; sized so that the whole bench
    # takes ~20 minutes on one H200. Flags given on the command line win. 512 groups in flight
    # (2,048 sequences): the stream's engine full enough on an H200 (2 x H200, 2026-11-29: async +
    # stream vs sync + batch 2.85 at 128, 2.78 at 256, 3.06 at 512).
    "tail_steps": 16, "tail_stream_steps": 48, "tail_warmup_steps": 1, "tail_short": 128, "tail_long": 2048, "tail_fraction": 0.1,
    "tail_staleness": 8, "tail_inflight": 512, "tail_prompts": 32, "tail_sync_interval": 4,
    "overlap_steps": 6, "overlap_max_seqs": 64, "overlap_prompts": 32, "overlap_min_tokens": 64,
    "overlap_max_tokens": 512,
    "async_steps": 12, "async_warmup_steps": 2, "async_max_tokens": 512, "async_prompts": 64,
    "pin_pools": False,
}
"""``--device cuda``: the defaults that differ from the CPU ones."""


def resolve_options(given: dict[str, Any], gpus: int) -> PipelineBenchOptions:
    """The bench's options: ``given`` (what the command line set; absent keys take the defaults) on
    ``device`` with ``gpus`` GPUs visible. On cuda, GPU_DEFAULTS replace the CPU defaults and the
    overrides get a shape and a cluster (``gpu_overrides``). Pure."""
    device = bench_device(given.get("device", "cpu"), gpus)
    values = {**(GPU_DEFAULTS if device == "cuda" else {}), **given, "device": device}
    overrides = tuple(values.get("overrides", ()))
    values["overrides"] = gpu_overrides(overrides, gpus) if device == "cuda" else overrides
    return PipelineBenchOptions(**values)


def _base_config(o: PipelineBenchOptions, **overrides: dict):
    from disagg.config import load_config

    data: dict[str, Any] = compose_train(o.overrides) if o.overrides else {}
    settings: dict[str, dict] = {"logging": {"progress": False, "backends": ["jsonl"], "plot": False},
                                 "cluster": {"num_cpus": o.cpus, "device": o.device}}
    rollout_cores, trainer_cores = pool_cores(o.pin_pools)
    if rollout_cores:
        settings["rollout"] = {"cpu_affinity": rollout_cores}
        settings["trainer"] = {"cpu_affinity": trainer_cores}
    for section in (settings, overrides):
        for k, v in section.items():
            data.setdefault(k, {}).update(v)
    return load_config(data)


def pool_cores(pin: bool) -> tuple[list[int] | None, list[int] | None]:
    """Disjoint cores for the rollout and trainer pools (None, None: unpinned, or one core only).

    A disaggregated cluster gives each pool its own devices; on one CPU machine that means
    its own cores, or the engine's threads and the trainer's compete and no overlap shows.
    """
    cores = sorted(os.sched_getaffinity(0))
    if not pin or len(cores) < 2:
        return None, None
    half = len(cores) // 2
    return cores[:half], cores[half:]


def _replace(cfg, section: str, **kw):
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **kw)})


def _start(cfg, run_dir: Path):
    from transformers import AutoTokenizer

    from disagg.bench.actors import BenchEngineActor
    from disagg.job import Job
    from disagg.model.warmstart import prepare_model

    model_path = prepare_model(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    job = Job.start(cfg, run_dir, model_path, engine_cls=BenchEngineActor)  # its in-flight mode set run by run
    job.sync_weights(1, trainer_step=0)
    return job, AutoTokenizer.from_pretrained(model_path)


def _reward_pool(cfg) -> list[Any]:
    """``cfg``'s reward workers, started and ready: a section's runs share them (``reward_workers``),
    so that no run's clock holds their start (a Ray worker process each)."""
    import ray

    from disagg.pipeline.rewards import start_reward_workers

    pool = start_reward_workers(cfg)
    ray.get([w.set_latency.remote(0.0) for w in pool], timeout=120)
    return pool


def _end(pool: list[Any]) -> None:
    import ray

    for w in pool:
        ray.kill(w)


def _run(cfg, job, tok, steps: int, first: int, **kw) -> tuple[Any, float]:
    from disagg.train import make_pipeline

    pipeline = make_pipeline(cfg, job, tok, **kw)
    t0 = time.perf_counter()
    pipeline.run(steps, first_step=first)
    return pipeline, time.perf_counter() - t0


def long_tail(o: PipelineBenchOptions, run_dir: Path) -> dict[str, Any]:
    """Trained tokens per second, stream vs batch, on heavy-tailed response lengths."""
    cfg = _base_config(o, rollout={"max_model_len": o.tail_long + 16, "max_inflight_groups": o.tail_inflight},
                       algorithm={"max_staleness": o.tail_staleness, "prompts_per_step": o.tail_prompts, "group_size": 4},
                       reward={"num_workers": 1})
    if cfg.rollout.max_num_seqs < 4 * o.tail_inflight:  # the engine's concurrency covers the stream's groups
        cfg = _replace(cfg, "rollout", max_num_seqs=4 * o.tail_inflight)
    r = cfg.rollout
    if o.device == "cuda" and r.max_cudagraph_capture_size is None and r.max_num_seqs > 512:
        # and CUDA graphs cover it too (vLLM's default stops at 512; the overrides may set another)
        cfg = _replace(cfg, "rollout", max_cudagraph_capture_size=r.max_num_seqs)
    job, tok = _start(cfg, run_dir / "tail")
    version, out = 1, {}

    def lengths_from(rng: random.Random):
        def lengths(row: dict):
            from disagg.rollout.types import SamplingSpec

            n = o.tail_long if rng.random() < o.tail_fraction else o.tail_short
            return SamplingSpec(max_tokens=n, temperature=1.0, n=cfg.algorithm.group_size, ignore_eos=True)
        return lengths

    pool = _reward_pool(cfg)  # every run's reward worker (started once, not on any run's clock)
    try:
        if o.tail_warmup_steps:  # vLLM's first batches of each shape are slow: not on the batch run's clock
            job.coordinator.state.set_max_staleness(0)
            _run(_replace(_replace(cfg, "rollout", scheduler="batch"), "algorithm", max_staleness=0), job, tok,
                 o.tail_warmup_steps, version, sampling_for=lengths_from(random.Random(1)), reward_workers=pool)
            version += o.tail_warmup_steps
        started = job.rollout.start_info[0]["in_flight_at_sync"]  # as the engines chose it
        for mode, scheduler, staleness, in_flight in tail_runs(o):
            lengths = lengths_from(random.Random(0))  # the same length sequence for every run
            in_flight = _set_in_flight(job, in_flight or started)
            limit = o.tail_staleness if staleness is None else staleness
            mcfg = _replace(_replace(cfg, "rollout", scheduler=scheduler), "algorithm", max_staleness=limit,
                            sync_interval=min(o.tail_sync_interval, limit) if mode == "stream_interval" else 1)
            job.coordinator.state.set_max_staleness(mcfg.algorithm.max_staleness)
            before = _engine_counts(job)
            steps = (o.tail_stream_steps or o.tail_steps) if scheduler == "stream" else o.tail_steps
            p, wall = _run(mcfg, job, tok, steps, version, sampling_for=lengths, reward_workers=pool)
            engines = {k: v - before[k] for k, v in _engine_counts(job).items()}
            version += steps
            out[mode] = {"trained_tokens": p.trained_tokens, "seconds": wall, "in_flight_at_sync": in_flight,
                         "num_steps": steps,
                         "trained_tokens_per_s": p.trained_tokens / wall,
                         # what the engines made over the whole run (the step medians' rate is the
                         # rate while a step waited, none where the stream never waits)
                         "engine_tokens_per_s": engines["tokens_generated"] / wall,
                         # and what they sampled, finished or not: the engines' whole rate
                         "engine_sampled_tokens_per_s": engines["vllm_generation_tokens"] / wall,
                         "dropped_stale": p.records[-1]["samples/dropped_stale"],
                         "staleness_max": max(r["policy/staleness_max"] for r in p.records),
                         "step_s_median": statistics.median(r["timing/step_s"] for r in p.records),
                         "group_seconds_max": max(r["rollout/group_seconds_max"] for r in p.records),
                         "group_seconds_mean": statistics.mean(r["rollout/group_seconds_mean"] for r in p.records),
                         # the profile a missed goal asks for: where a step's time goes, per step,
                         # and what syncs cost the engines (resubmit mode: tokens prefilled again)
                         "engines": engines, **_profile(p.records)}
            log.warning("long tail, %s: %.0f trained tokens/s", mode, out[mode]["trained_tokens_per_s"])
    finally:
        _end(pool)
        job.shutdown()
    # what a sync did with the requests in flight (rollout.in_flight_at_sync, as the engines chose it)
    out["in_flight_at_sync"] = job.rollout.start_info[0]["in_flight_at_sync"]
    out["max_num_seqs"] = cfg.rollout.max_num_seqs
    out["cudagraph_max_size"] = job.rollout.start_info[0]["cudagraph_max_size"]  # as vLLM resolved it
    rate = {mode: out[mode]["trained_tokens_per_s"] for mode, *_ in tail_runs(o)}
    for name, mode, base, _ in TAIL_RATIOS:
        if mode in rate and base in rate:  # the runs --tail-runs left out give no ratio
            out[name] = rate[mode] / rate[base]
    pair = keep_and_resubmit(out)
    if pair:  # the stream under each in-flight mode, on the same engines: what `auto` should pick
        out["keep_vs_resubmit"] = rate[pair[0]] / rate[pair[1]]
    return out


def _set_in_flight(job, mode: str) -> str:
    """Every engine's ``rollout.in_flight_at_sync`` for the next run (between runs only); the mode
    they resolved it to."""
    import ray

    got = set(ray.get([e.set_in_flight_mode.remote(mode) for e in job.rollout.engines], timeout=120))
    if len(got) != 1:
        raise RuntimeError(f"engines resolved rollout.in_flight_at_sync={mode!r} differently: {sorted(got)}")
    return got.pop()


def keep_and_resubmit(tail: dict[str, Any]) -> tuple[str, str] | None:
    """Of the long tail's stream runs (every version synced), one whose engines kept the requests in
    flight at a sync and one whose engines resubmitted them: (keep run, resubmit run), or None. Pure."""
    by_mode = {}
    for name in ("stream", "stream_keep", "stream_resubmit"):
        if isinstance(tail.get(name), dict):
            by_mode.setdefault(tail[name]["in_flight_at_sync"], name)
    return (by_mode["keep"], by_mode["resubmit"]) if {"keep", "resubmit"} <= by_mode.keys() else None


ENGINE_COUNTS = ("tokens_generated", "pauses", "resubmits", "resubmit_kv_kept_tokens", "resubmit_prefill_tokens",
                 "counted_cuts", "vllm_generation_tokens", "dropped_stale_in_flight")
"""``tokens_generated``: the tokens of the responses the engines returned; ``vllm_generation_tokens``:
every token vLLM sampled, also for requests still in flight or cut off when a run ends (the long
tail's groups a stream never trained); ``dropped_stale_in_flight``: groups the engines stopped once
no step could train them."""


def _engine_counts(job) -> dict[str, int]:
    """The engines' counters of ENGINE_COUNTS, summed over the engines."""
    import ray

    stats = ray.get([e.get_stats.remote() for e in job.rollout.engines], timeout=120)
    return {k: sum(int(s.get(k, 0)) for s in stats) for k in ENGINE_COUNTS}


TAIL_RUNS = (("batch", "batch", 0, None), ("batch_async", "batch", None, None), ("stream", "stream", None, None))
"""The long-tail runs: (name, rollout.scheduler, max_staleness, rollout.in_flight_at_sync); None:
--tail-staleness, the mode the engines started with."""

IN_FLIGHT_RUNS = (("stream_keep", "stream", None, "keep"), ("stream_resubmit", "stream", None, "resubmit"))
"""The stream under one in-flight mode, made only when --tail-runs names them: beside ``stream`` (the
engines' own mode) they give ``keep_vs_resubmit`` in one run, on one machine."""

TAIL_RATIOS = (("stream_vs_batch", "stream", "batch_async", ">= 2"),  # one staleness: the scheduler's gain
               ("async_stream_vs_sync_batch", "stream", "batch", ">= 3"),
               ("stream_interval_vs_sync_batch", "stream_interval", "batch", ">= 3"))
"""The long tail's ratios: (name, run, the run it is divided by, the goal)."""


def tail_runs(o: PipelineBenchOptions) -> tuple:
    """TAIL_RUNS, and the stream with a sync interval where ``--tail-sync-interval`` asks for one;
    of those, the ones ``--tail-runs`` names (``all``: every one). Pure."""
    runs = TAIL_RUNS + ((("stream_interval", "stream", None, None),) if o.tail_sync_interval > 1 else ())
    if o.tail_runs == "all":
        return runs
    runs += IN_FLIGHT_RUNS
    names = [n.strip() for n in o.tail_runs.split(",") if n.strip()]
    known = [r[0] for r in runs]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(f"--tail-runs={o.tail_runs!r}: {', '.join(unknown) or 'no run'} is not one of "
                         f"{', '.join(known)} (stream_interval needs --tail-sync-interval > 1) or 'all'")
    return tuple(r for r in runs if r[0] in names)


PROFILE_KEYS = ("timing/step_s", "timing/train_s", "timing/rollout_s", "timing/weight_sync_s",
                "rollout/tokens_per_s", "rollout/inflight_groups", "policy/staleness_max",
                # the slowest engine's part of a step's sync: its requests frozen, the load, the resume
                "weight_sync/engine_quiesce_s", "weight_sync/engine_update_s", "weight_sync/engine_resume_s")


def _profile(records: list[dict]) -> dict[str, Any]:
    """Medians of PROFILE_KEYS over the ``records`` that have them (``<key>_median``, the keys' last
    part; a step with no sync of its own has no engine phases) and the per-step values under
    ``steps``: the trainer's share of the step, the wait for a batch, the engines' token rate and
    their pause at each sync say which side bounds a comparison."""
    present = [k for k in PROFILE_KEYS if any(k in r for r in records)]
    out: dict[str, Any] = {f"{k.split('/')[1]}_median": statistics.median(r[k] for r in records if k in r)
                           for k in present}
    out["steps"] = [{k: r[k] for k in present if k in r} for r in records]
    return out


def _stage(p) -> float:
    """Median time from a step's start (previous sync done) to its batch being ready."""
    return statistics.median(r["timing/rollout_s"] for r in p.records[1:] or p.records)


def reward_overlap(o: PipelineBenchOptions, run_dir: Path) -> dict[str, Any]:
    """Batch-ready time with rewards overlapped with generation vs scored after it."""
    import ray

    from disagg.rollout.types import SamplingSpec

    workers = o.reward_workers
    cfg = _base_config(o, algorithm={"max_staleness": 0, "prompts_per_step": o.overlap_prompts, "group_size": 8},
                       rollout={"scheduler": "batch", "max_num_seqs": o.overlap_max_seqs,
                                "max_model_len": max(64, o.overlap_max_tokens + 64)},
                       reward={"num_workers": workers})
    job, tok = _start(cfg, run_dir / "overlap")
    version, out = 1, {}

    def lengths():  # varied lengths (the same sequence in every run): groups finish over the rollout
        rng = random.Random(1)
        return lambda row: SamplingSpec(max_tokens=rng.randint(o.overlap_min_tokens, o.overlap_max_tokens),
                                        temperature=1.0, n=cfg.algorithm.group_size, ignore_eos=True)

    pool = _reward_pool(cfg)  # every run's reward workers, and the reward stage's alone
    try:
        _run(cfg, job, tok, 2, version, sampling_for=lengths(), reward_workers=pool)  # warm-up: first requests
        version += 2
        p, _ = _run(cfg, job, tok, o.overlap_steps, version, sampling_for=lengths(), reward_workers=pool)
        version += o.overlap_steps
        rollout_s = _stage(p)  # generation alone (rewards are instant)
        samples = cfg.algorithm.prompts_per_step * cfg.algorithm.group_size
        latency = rollout_s / samples  # total reward time (the sum over a batch) ~ total rollout time
        # The reward stage alone: one batch through the same pool, nothing generating.
        texts = ["1234"] * cfg.algorithm.group_size
        row = {"answer": "4321", "prompt": "1234="}
        ray.get([w.set_latency.remote(latency) for w in pool], timeout=120)
        t0 = time.perf_counter()
        ray.get([pool[g % workers].score.remote(texts, row) for g in range(cfg.algorithm.prompts_per_step)],
                timeout=600)
        pool_s = time.perf_counter() - t0
        reward_s = latency * samples
        lcfg = _replace(cfg, "reward", latency_s=latency)
        for name, overlap in (("serial", False), ("overlapped", True)):
            p, _ = _run(lcfg, job, tok, o.overlap_steps, version, overlap_rewards=overlap, sampling_for=lengths(),
                        reward_workers=pool)
            version += o.overlap_steps
            out[f"{name}_stage_s"] = _stage(p)
    finally:
        _end(pool)
        job.shutdown()
    longest = max(rollout_s, reward_s)
    out.update(rollout_stage_s=rollout_s, reward_stage_s=reward_s, reward_pool_s=pool_s, reward_workers=workers,
               reward_latency_per_sample_s=latency,
               overlap_step_vs_max_stage=out["overlapped_stage_s"] / longest,
               serial_step_vs_max_stage=out["serial_stage_s"] / longest)
    return out


def _first_reaching(records: list[dict], threshold: float, window: int = 10) -> tuple[int | None, float | None]:
    """(step, seconds since the run's start) where the moving mean reward first reaches ``threshold``."""
    elapsed = 0.0
    for i, r in enumerate(records):
        elapsed += r["timing/step_s"]
        part = records[max(0, i - window + 1) : i + 1]
        if len(part) == window and sum(x["reward/mean"] for x in part) / window >= threshold:
            return i + 1, elapsed
    return None, None


def steady_throughput(records: list[dict], warmup: int) -> tuple[float, float]:
    """(trained samples per second, seconds) from the end of step ``warmup`` to the end of the last
    step; each record's ``timing/step_s`` is the time since the previous step completed."""
    steady = records[warmup:]
    if not steady:
        raise ValueError(f"--async-warmup-steps={warmup} leaves none of the {len(records)} steps to measure")
    seconds = sum(r["timing/step_s"] for r in steady)
    return sum(r["samples/trained"] for r in steady) / seconds, seconds


def async_vs_sync(o: PipelineBenchOptions, run_dir: Path) -> dict[str, Any]:
    """Samples per second and steps to the reward threshold, max_staleness 1 vs 0, same start."""
    out: dict[str, Any] = {}
    from disagg.rollout.types import SamplingSpec

    for name, limit in (("sync", 0), ("async", 1)):
        algorithm: dict[str, Any] = {"max_staleness": limit}
        rollout: dict[str, Any] = {}
        if o.async_prompts:
            algorithm["prompts_per_step"] = o.async_prompts
            rollout["max_inflight_groups"] = o.async_prompts
        if o.async_max_tokens:
            rollout["max_model_len"] = o.async_max_tokens + 64
        cfg = _base_config(o, algorithm=algorithm, rollout=rollout)
        kw = {}
        if o.async_max_tokens:
            n, group = o.async_max_tokens, cfg.algorithm.group_size
            kw["sampling_for"] = lambda row: SamplingSpec(max_tokens=n, temperature=1.0, n=group, ignore_eos=True)
        job, tok = _start(cfg, run_dir / name)
        try:
            p, wall = _run(cfg, job, tok, o.async_steps, 1, **kw)
        finally:
            job.shutdown()
        step, seconds = _first_reaching(p.records, o.threshold)
        steady = p.records[o.async_warmup_steps:]
        rate, steady_s = steady_throughput(p.records, o.async_warmup_steps)
        out[name] = {"samples_per_s": rate,
                     "samples_per_s_with_warmup": p.trained_samples / wall, "seconds": wall,
                     "warmup_s": wall - steady_s, "steps": o.async_steps, "warmup_steps": o.async_warmup_steps,
                     "median_s": {k.split("/")[1]: statistics.median(r[k] for r in steady)
                                  for k in ("timing/step_s", "timing/train_s", "timing/rollout_s",
                                            "timing/weight_sync_s")},
                     "threshold_step": step, "threshold_seconds": seconds,
                     "reward_last_10": statistics.mean(r["reward/mean"] for r in p.records[-10:]),
                     "staleness_max": max(r["policy/staleness_max"] for r in p.records)}
        log.warning("%s: %.0f samples/s, threshold %.2f at step %s", name, out[name]["samples_per_s"], o.threshold,
                    step)
    out["async_vs_sync"] = out["async"]["samples_per_s"] / out["sync"]["samples_per_s"]
    out["async_vs_sync_with_warmup"] = (out["async"]["samples_per_s_with_warmup"]
                                        / out["sync"]["samples_per_s_with_warmup"])
    out["threshold"] = o.threshold
    out["both_reach_threshold"] = out["sync"]["threshold_step"] is not None and out["async"]["threshold_step"] is not None
    return out


def run(o: PipelineBenchOptions, only: set[str]) -> dict[str, Any]:
    import ray

    run_dir = Path(o.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    rollout_cores, trainer_cores = pool_cores(o.pin_pools)
    report: dict[str, Any] = {"options": dataclasses.asdict(o), "cpus": os.cpu_count(),
                              "date": time.strftime("%Y-%m-%d"), "rollout_cores": rollout_cores,
                              "trainer_cores": trainer_cores, "machine": machine(o.device)}
    ray.init(num_cpus=o.cpus, include_dashboard=False, ignore_reinit_error=True)
    try:
        if "tail" in only:
            report["long_tail"] = long_tail(o, run_dir)
            for ratio in ("stream_vs_batch", "async_stream_vs_sync_batch"):
                if ratio in report["long_tail"]:
                    report[ratio] = report["long_tail"][ratio]
        if "overlap" in only:
            report["reward_overlap"] = r = reward_overlap(o, run_dir)
            report["overlap_step_vs_max_stage"] = r["overlap_step_vs_max_stage"]
            report["serial_step_vs_max_stage"] = r["serial_step_vs_max_stage"]
        if "async" in only:
            report["async"] = a = async_vs_sync(o, run_dir)
            report["async_vs_sync"] = a["async_vs_sync"]
    finally:
        ray.shutdown()
    return report


def _tail_ratio_rows(table, t: dict[str, Any], options: dict[str, Any]) -> None:
    """The long tail's ratios between runs (or, with one run of each pair left out, the rates alone)."""
    st = options["tail_staleness"]
    k = options["tail_sync_interval"]
    labels = {"stream_vs_batch": f"long tail: trained tokens/s, stream vs batch (both at staleness {st}; "
                                 f"requests in flight at a sync: {t['in_flight_at_sync']})",
              "async_stream_vs_sync_batch": f"long tail: async + stream (staleness {st}) vs sync + batch "
                                            "(staleness 0)",
              "stream_interval_vs_sync_batch": f"long tail: async + stream, engines taking every {k}th "
                                               "version, vs sync + batch"}
    for name, mode, base, target in TAIL_RATIOS:
        if name in t:
            a, b = t[mode], t[base]
            measured = (f"{a['trained_tokens_per_s']:.0f} vs {b['trained_tokens_per_s']:.0f} "
                        f"(stale drops {a['dropped_stale']} vs {b['dropped_stale']}; "
                        f"{a.get('num_steps', '?')} vs {b.get('num_steps', '?')} steps)")
            table.add_row(labels[name], measured, f"{t[name]:.2f}", target)
    if "keep_vs_resubmit" in t:
        keep, res = keep_and_resubmit(t)
        table.add_row("long tail: trained tokens/s, stream with the requests in flight at a sync kept vs "
                      f"resubmitted ({keep} vs {res}; above 1: `auto` should keep)",
                      f"{t[keep]['trained_tokens_per_s']:.0f} vs {t[res]['trained_tokens_per_s']:.0f} "
                      f"(stale drops {t[keep]['dropped_stale']} vs {t[res]['dropped_stale']})",
                      f"{t['keep_vs_resubmit']:.2f}", "")
    if not any(name in t for name, *_ in TAIL_RATIOS):  # --tail-runs left one run of a pair out: rates alone
        rates = ", ".join(f"{m} {v['trained_tokens_per_s']:.0f}" for m, v in t.items() if isinstance(v, dict))
        table.add_row(f"long tail: trained tokens/s (requests in flight at a sync: {t['in_flight_at_sync']})",
                      rates, "", "")
    if t.get("max_num_seqs"):
        table.add_row("  the engine: concurrent sequences / largest CUDA-graph batch",
                      f"{t['max_num_seqs']} / {t.get('cudagraph_max_size') or 'none'}", "", "")


def _tail_run_rows(table, mode: str, m: dict[str, Any]) -> None:
    """One long-tail run's figures: its step median, the engines' rates, their part of each sync."""
    if "train_s_median" in m:
        table.add_row(f"  {mode} step median (train / waiting for a batch / engines' tokens/s then)",
                      f"{m['step_s_median']:.2f} s ({m['train_s_median']:.2f} / "
                      f"{m.get('rollout_s_median', 0.0):.2f} / {m.get('tokens_per_s_median', 0.0):.0f})", "", "")
    if "engine_tokens_per_s" in m:
        table.add_row(f"  {mode}: tokens the engines made per second of the run",
                      f"{m['engine_tokens_per_s']:.0f} ({m['engines']['tokens_generated']} in "
                      f"{m['seconds']:.1f} s)", "", "")
    if m.get("engine_sampled_tokens_per_s"):
        table.add_row(f"  {mode}: tokens the engines sampled per second, finished or not",
                      f"{m['engine_sampled_tokens_per_s']:.0f} ({m['engines']['vllm_generation_tokens']})",
                      "", "")
    if "engine_update_s_median" in m:
        table.add_row(f"  {mode}: an engine's part of each sync, median (requests frozen / load / resume)",
                      f"{1e3 * m.get('engine_quiesce_s_median', 0.0):.1f} / "
                      f"{1e3 * m['engine_update_s_median']:.1f} / {1e3 * m.get('engine_resume_s_median', 0.0):.1f} ms",
                      "", "")
    e = m.get("engines") or {}
    if e.get("resubmits"):
        table.add_row(f"  {mode} resubmits at syncs (KV kept / prefilled again, tokens)",
                      f"{e['resubmits']} ({e['resubmit_kv_kept_tokens']} / {e['resubmit_prefill_tokens']})",
                      "", "")
    if e.get("counted_cuts"):
        table.add_row(f"  {mode} pauses at syncs (responses cut by the engine core's counts)",
                      f"{e['pauses']} ({e['counted_cuts']} cuts)", "", "")
    if e.get("dropped_stale_in_flight"):
        table.add_row(f"  {mode}: groups the engines stopped once no step could train them",
                      f"{e['dropped_stale_in_flight']} (stale drops in all: {m['dropped_stale']} "
                      "samples)", "", "")


def _overlap_rows(table, r: dict[str, Any]) -> None:
    stages = (f"rollout {r['rollout_stage_s']:.2f} s, reward {r['reward_stage_s']:.2f} s in total, "
              f"{r['reward_pool_s']:.2f} s on {r['reward_workers']} workers")
    table.add_row("reward overlap: batch ready, overlapped / longest stage",
                  f"{r['overlapped_stage_s']:.2f} s ({stages})", f"{r['overlap_step_vs_max_stage']:.2f}", "<= 1.2")
    table.add_row("reward after generation: serial / longest stage", f"{r['serial_stage_s']:.2f} s",
                  f"{r['serial_step_vs_max_stage']:.2f}", "")


def _async_rows(table, a: dict[str, Any]) -> None:
    table.add_row(f"async (staleness 1) vs sync: samples/s after {a['async']['warmup_steps']} warm-up steps",
                  f"{a['async']['samples_per_s']:.0f} vs {a['sync']['samples_per_s']:.0f}",
                  f"{a['async_vs_sync']:.2f}", ">= 1.6")
    table.add_row("  the same, warm-up included",
                  f"{a['async']['samples_per_s_with_warmup']:.0f} vs {a['sync']['samples_per_s_with_warmup']:.0f} "
                  f"(warm-up {a['async']['warmup_s']:.1f} s vs {a['sync']['warmup_s']:.1f} s)",
                  f"{a['async_vs_sync_with_warmup']:.2f}", "")
    for name in ("sync", "async"):
        m = a[name]["median_s"]
        table.add_row(f"  {name}: step median (train / waiting for a batch / sync)",
                      f"{m['step_s']:.2f} s ({m['train_s']:.2f} / {m['rollout_s']:.2f} / {m['weight_sync_s']:.2f})",
                      "", "")
    for name in ("sync", "async"):
        x = a[name]
        reached = (f"step {x['threshold_step']} ({x['threshold_seconds']:.0f} s)" if x["threshold_step"]
                   else "not reached")
        table.add_row(f"  {name}: reward >= {a['threshold']} (10-step mean)", reached,
                      f"{x['reward_last_10']:.3f}", "")


def render(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    extra = " ".join(report["options"]["overrides"])
    table = Table(title=f"disagg bench pipeline ({report.get('machine', str(report['cpus']) + ' CPUs')}, "
                        f"{report['date']}{', ' + extra if extra else ''})")
    for col in ("comparison", "measured", "ratio", "target"):
        table.add_column(col, justify="left" if col in ("comparison", "measured") else "right")
    if "long_tail" in report:
        t = report["long_tail"]
        _tail_ratio_rows(table, t, report["options"])
        for mode, m in t.items():
            if isinstance(m, dict):
                _tail_run_rows(table, mode, m)
    if "reward_overlap" in report:
        _overlap_rows(table, report["reward_overlap"])
    if "async" in report:
        _async_rows(table, report["async"])
    Console().print(table)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="disagg bench pipeline", description=__doc__.split("\n\n")[0])
    f = {x.name: x for x in dataclasses.fields(PipelineBenchOptions)}
    for name, field in f.items():
        if name == "overrides":
            continue
        gpu = f" (--device cuda: {GPU_DEFAULTS[name]})" if name in GPU_DEFAULTS else ""
        if isinstance(field.default, bool):  # --pin-pools / --no-pin-pools
            p.add_argument("--" + name.replace("_", "-"), action=argparse.BooleanOptionalAction,
                           default=argparse.SUPPRESS, help=f"default {field.default}{gpu}")
            continue
        p.add_argument("--" + name.replace("_", "-"), type=type(field.default) if field.default is not None else int,
                       default=argparse.SUPPRESS, help=f"default {field.default}{gpu}")
    p.add_argument("--only", default="tail,overlap,async", help="comparisons to run, comma-separated")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the report as JSON")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="`disagg train` overrides (e.g. cluster=gpu shape=qwen2.5-1.5b), under the bench's settings")
    a = vars(p.parse_args(argv))
    json_path, only = a.pop("json"), set(a.pop("only").split(","))
    unknown = only - {"tail", "overlap", "async"}
    if unknown:
        p.error(f"--only: unknown comparisons {sorted(unknown)} (tail, overlap, async)")
    bad = [x for x in a.get("overrides", []) if "=" not in x]
    if bad:
        p.error(f"overrides must be key=value, got {bad}")
    a["overrides"] = tuple(a.get("overrides", ()))
    try:
        opts = resolve_options(a, visible_gpus() if a.get("device", "cpu") != "cpu" else 0)
        tail_runs(opts)  # --tail-runs checked before any engine starts
    except ValueError as e:
        p.error(str(e))
    setup_logging("bench", opts.log_level)
    report = run(opts, only)
    render(report)
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2))
        print(f"wrote {json_path}", file=sys.stderr)
    return 0
