"""disagg's run of the peers job: ``disagg train`` with the job's files and settings.

Modes: ``sync`` (``algorithm.max_staleness=0``, the default: on-policy, engines armed during the
step), ``async`` (``max_staleness=1``: the next batch generates while this one trains) and ``asyncN``
(``max_staleness=N``), each with ``@key=value`` settings after it where the bench gives some
(``async@rollout.compile=false``: more ``disagg train`` overrides). One GPU:
``cluster=one_gpu`` (trainer and engine share it, sync over gloo); two or more: ``cluster=gpu``
(NCCL). CPU: the bench's own tests.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from disagg.bench.peers.job import JobFiles, PeerJob
from disagg.bench.peers.runs import PeerRun

def staleness(mode: str) -> int:
    """``algorithm.max_staleness`` of a mode (pure): ``sync`` 0, ``async`` 1, ``asyncN`` N (a heavy tail
    needs a staleness that covers its longest responses, or its long groups are dropped as too stale)."""
    mode = mode.split("@")[0]
    m = re.fullmatch(r"sync|async(\d*)", mode)
    if m is None or m[1] == "0":
        raise ValueError(f"disagg mode must be sync, async or asyncN (N >= 1: the staleness), got {mode!r}")
    return 0 if mode == "sync" else int(m[1] or 1)


def overrides(job: PeerJob, files: JobFiles, gpus: int, mode: str, run_dir: Path) -> list[str]:
    """The ``disagg train`` overrides that make the job (pure)."""
    max_staleness = staleness(mode)
    out = []
    if gpus == 1:
        out += ["cluster=one_gpu", f"rollout.gpu_memory_utilization={job.gpu_memory_utilization}"]
    elif gpus >= 2:
        out += ["cluster=gpu"]
    if job.shape != "tiny":
        out.append(f"shape={job.shape}")  # its trainer micro-batching; the weights come from model.path
        if gpus == 1:  # the engine holds part of the GPU: 16384-token micro-batches ran out of memory on an H100
            out.append("trainer.micro_batch_tokens=8192")
    out += [
        f"model.path={files.model}", f"data.train_files=[{files.train_jsonl}]", "data.shuffle=false",
        "data.add_bos=true", "reward.path=disagg.bench.peers.job_reward:score_row",
        f"algorithm.group_size={job.group_size}", f"algorithm.prompts_per_step={job.prompts_per_step}",
        f"algorithm.clip_eps={job.clip_eps}", f"algorithm.max_staleness={max_staleness}", "algorithm.kl_coef=0.0",
        "algorithm.num_minibatches=1", f"trainer.lr={job.lr}", "trainer.warmup_steps=0", "trainer.weight_decay=0.0",
        "trainer.betas=[0.9,0.999]", f"trainer.grad_clip={job.grad_clip}", f"trainer.total_steps={job.steps}",
        f"rollout.max_tokens={job.max_tokens}", f"rollout.max_model_len={job.max_model_len}",
        f"rollout.temperature={job.temperature}", f"rollout.top_p={job.top_p}",
        "logging.progress=false", "logging.plot=false", "logging.backends=[jsonl]", f"hydra.run.dir={run_dir}",
        "rollout.vllm_log_level=INFO",  # vLLM's start-up timings (model load, compile, graphs) for setup_phases
    ]
    if job.heavy_tail:  # every group of the long tail in flight at once, as `bench pipeline` runs it
        out += [f"rollout.max_inflight_groups={job.prompts_per_step}",
                f"rollout.max_num_seqs={max(256, job.samples_per_step)}"]
    return out


def plan(job: PeerJob, files: JobFiles, gpus: int, mode: str, out: Path, correction: str | None = None) -> PeerRun:
    """``disagg train`` as ``disagg bench peers`` runs it; ``correction``: ``algorithm.off_policy``
    (None: the default)."""
    run_dir = out / "run"
    args = overrides(job, files, gpus, mode, run_dir) + mode.split("@")[1:]
    if correction is not None:
        args.append(f"algorithm.off_policy={correction}")
    from disagg.config.files import compose_train
    from disagg.config.load import load_config

    used = load_config(compose_train(args), check=False).algorithm.off_policy
    return PeerRun(framework="disagg", mode=mode, gpus=gpus, correction=used,
                   cmd=[sys.executable, "-m", "disagg", "train", *args], env={}, out=out, collect=collect)


def collect(run: PeerRun) -> list[dict[str, Any]]:
    """``metrics.jsonl`` as step records (``runs``)."""
    from disagg.bench.peers.runs import read_steps

    out = []
    sync = staleness(run.mode) == 0  # on-policy: the next step's generation waits for the sync
    for r in read_steps(run.out / "run" / "metrics.jsonl"):
        samples = r["samples/trained"]
        out.append({
            "step": r["step"], "t": r["time_unix_s"], "step_s": r["timing/step_s"], "samples": samples,
            "tokens": r["response/len_mean"] * samples, "reward": r["reward/mean"],
            "sync_s": r["timing/weight_sync_s"] if sync else r["timing/trainer_sync_wait_s"],
            "gen_s": r["timing/rollout_s"],
            "mismatch_mean": r.get("train/logprob_mismatch_mean"), "mismatch_max": r.get("train/logprob_mismatch_max"),
            "masked_share": r.get("train/clip_frac"),
            "dropped": r.get("samples/dropped_stale", 0),  # so far in the run (samples too stale to train)
        })
    return out


_PHASES = (("ray_up", "starting a local Ray cluster"), ("pools_up", "pools up in"),
           ("first_weights", "initial weights (version"), ("first_step", "disagg.train: step 1/"))


def setup_phases(log_path: Path) -> dict[str, float]:
    """Where disagg's set-up went, from its log: seconds from its first line to each milestone, the
    engine's own start (``engine start``) as it reported it, and the trainer's model load split as its
    worker timed it (reading the checkpoint, moving it to the device: a GPU's first CUDA call, the rest)."""
    stamps: dict[str, float] = {}
    out: dict[str, float] = {}
    start = None
    for line in log_path.read_text(errors="replace").splitlines():
        trainer = re.search(r"model loaded from .*read ([\d.]+) s, to \S+ ([\d.]+) s, the rest ([\d.]+) s", line)
        if trainer and "trainer_read_s" not in out:  # the first rank's (an actor's line), as its worker timed it
            out.update(trainer_read_s=float(trainer[1]), trainer_to_device_s=float(trainer[2]),
                       trainer_rest_s=float(trainer[3]))
        m = re.match(r"(\d\d):(\d\d):(\d\d) ", line)
        if not m:
            continue
        t = int(m[1]) * 3600 + int(m[2]) * 60 + int(m[3])
        start = t if start is None else start
        for key, text in _PHASES:
            if key not in stamps and text in line:
                stamps[key] = t
        engine = re.search(r"pools up in [\d.]+s \(engine start ([\d.]+) s\)", line)
        if engine:
            out["engine_start_s"] = float(engine[1])
        imports = re.search(r"engine imports took ([\d.]+) s", line)
        if imports:  # the first engine's
            out["engine_imports_s"] = float(imports[1])

    for key, t in stamps.items():
        out[f"{key}_s"] = (t - start) % 86400
    return out


# vLLM's own start-up lines (0.26 and 0.32 word them so), in any framework's log where vLLM logs at INFO
_VLLM_PHASES = (
    ("vllm_model_load_s", r"Model loading took .*? and ([\d.]+) seconds"),
    ("vllm_dynamo_s", r"Dynamo bytecode transform time: ([\d.]+) s"),
    ("vllm_compile_s", r"torch\.compile (?:takes|took) ([\d.]+) s in total"),
    ("vllm_graphs_s", r"Graph capturing finished in ([\d.]+) secs"),
    ("vllm_init_engine_s", r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s"),
)


def vllm_phases(log_path: Path) -> dict[str, float]:
    """vLLM's start-up as it logged it: model load, torch.compile (its Dynamo trace included), CUDA
    graph capture and the engine core's whole init (profile, KV cache, warm-up), in seconds. The first
    of each: the engine's start, not a later restart. Empty where vLLM logged above INFO."""
    text = log_path.read_text(errors="replace")
    out = {}
    for key, pattern in _VLLM_PHASES:
        m = re.search(pattern, text)
        if m:
            out[key] = float(m[1])
    return out
