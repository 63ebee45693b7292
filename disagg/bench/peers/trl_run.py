"""TRL 1.16's run of the peers job: ``GRPOTrainer`` with vLLM, as its docs run it.

Modes: ``colocate`` (one GPU: vLLM inside the trainer's process, TRL's default) and ``server`` (two
GPUs: ``trl vllm-serve`` - vLLM's own server with its NCCL weight transfer - on the second GPU, the
trainer on the first). TRL's own defaults stay where the job says nothing: its mismatch correction
(``vllm_importance_sampling_mode=sequence_mask``, cap 3.0), ``loss_type=dapo`` (a token mean, as
disagg's), ``scale_rewards=group``. Set to the job: the learning rate (constant, no warm-up), AdamW,
clipping, batch (one optimizer step per ``prompts_per_step`` x ``group_size`` samples), sampling,
``gradient_checkpointing=False`` (disagg and verl do not checkpoint activations either).

Run in TRL's environment as ``python -m disagg.bench.peers.trl_run JOB_DIR OUT_DIR MODE``: it writes the
step records (``runs``) to ``OUT_DIR/steps.jsonl`` from a ``TrainerCallback``, timing the
weight sync (``vllm_generation.sync_weights``) and generation (``vllm_generation.generate``) by
wrapping those methods, with the GPU synchronised around each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from disagg.bench.peers.job import JobFiles, PeerJob, job_files, load_job
from disagg.bench.peers.runs import PeerRun

MODES = ("colocate", "server")
SERVER_PORT = 18000
CORRECTION = "sequence_mask, cap 3.0 (TRL's default)"


def config_kwargs(job: PeerJob, mode: str, out: Path) -> dict[str, Any]:
    """``GRPOConfig`` keyword arguments for the job (pure). One optimizer step per generation round:
    ``per_device_train_batch_size`` x ``gradient_accumulation_steps`` = the step's samples."""
    if mode not in MODES:
        raise ValueError(f"TRL mode must be one of {', '.join(MODES)}, got {mode!r}")
    micro = min(job.micro_batch_size, job.samples_per_step)
    if job.samples_per_step % micro:
        raise ValueError(f"samples per step {job.samples_per_step} is not a multiple of TRL's micro-batch {micro}")
    kw: dict[str, Any] = dict(
        output_dir=str(out / "trl"), use_vllm=True, vllm_mode=mode,
        per_device_train_batch_size=micro, gradient_accumulation_steps=job.samples_per_step // micro,
        num_generations=job.group_size, num_iterations=1, max_completion_length=job.max_tokens,
        temperature=job.temperature, top_p=job.top_p, learning_rate=job.lr, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=job.grad_clip,
        beta=0.0, epsilon=job.clip_eps, max_steps=job.steps, logging_steps=1, report_to="none",
        save_strategy="no", bf16=True, gradient_checkpointing=False, shuffle_dataset=False, seed=job.seed,
        vllm_max_model_length=job.max_model_len,
    )
    if mode == "colocate":
        kw["vllm_gpu_memory_utilization"] = job.gpu_memory_utilization
    else:
        kw["vllm_server_base_url"] = f"http://127.0.0.1:{SERVER_PORT}"
    return kw


def plan(job: PeerJob, files: JobFiles, gpus: int, mode: str, out: Path, site: str | None) -> PeerRun:
    """TRL in its own interpreter, with ``site`` (TRL and what it needs) first on its path."""
    if mode == "server" and gpus < 2:
        raise ValueError("TRL server mode needs two GPUs (the server on one, the trainer on the other)")
    env = {"HF_HUB_DISABLE_TELEMETRY": "1", "TOKENIZERS_PARALLELISM": "false"}
    return PeerRun(framework="trl", mode=mode, gpus=gpus, correction=CORRECTION,
                   cmd=[sys.executable, "-m", "disagg.bench.peers.trl_run", str(files.root), str(out), mode],
                   env=env, out=out, path=[site] if site else [])


def _serve(files: JobFiles, job: PeerJob, out: Path) -> subprocess.Popen:
    """``trl vllm-serve`` on the second GPU; returns once it answers /health (or raises)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "1"}
    cmd = [sys.executable, "-m", "trl.scripts.vllm_serve", "--model", str(files.model), "--port", str(SERVER_PORT),
           "--max-model-len", str(job.max_model_len), "--gpu-memory-utilization", "0.85"]
    proc = subprocess.Popen(cmd, env=env, stdout=open(out / "vllm_serve.log", "w"), stderr=subprocess.STDOUT)
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"trl vllm-serve exited with {proc.returncode}; see {out / 'vllm_serve.log'}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{SERVER_PORT}/health", timeout=2):
                return proc
        except OSError:
            time.sleep(2)
    raise RuntimeError(f"trl vllm-serve did not answer /health within 600 s; see {out / 'vllm_serve.log'}")


def main(argv: list[str]) -> int:
    root, out, mode = Path(argv[0]), Path(argv[1]), argv[2]
    job, files = load_job(root), job_files(root)
    out.mkdir(parents=True, exist_ok=True)
    server = _serve(files, job, out) if mode == "server" else None
    if mode == "server":
        os.environ["CUDA_VISIBLE_DEVICES"] = "0"
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from disagg.bench.peers.job_reward import trl_reward

    rows = [json.loads(x) for x in files.train_jsonl.read_text().splitlines()]
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
                            for r in rows])
    tok = AutoTokenizer.from_pretrained(files.model)
    args = GRPOConfig(**config_kwargs(job, mode, out))
    trainer = GRPOTrainer(model=str(files.model), reward_funcs=[trl_reward], args=args, train_dataset=ds,
                          processing_class=tok)
    timer = {"sync_s": 0.0, "gen_s": 0.0}

    def timed(obj, name: str, key: str) -> None:
        fn = getattr(obj, name)

        def wrapper(*a, **k):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                torch.cuda.synchronize()
                timer[key] += time.perf_counter() - t0

        setattr(obj, name, wrapper)

    timed(trainer.vllm_generation, "sync_weights", "sync_s")
    timed(trainer.vllm_generation, "generate", "gen_s")
    steps_path = out / "steps.jsonl"

    class Steps(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            self.t_last = time.time()

        def on_log(self, args, state, control, logs=None, **kw):
            if not logs or "reward" not in logs:
                return
            now = time.time()
            samples = job.samples_per_step
            rec = {"step": state.global_step, "t": now, "step_s": now - self.t_last, "samples": samples,
                   "tokens": logs["completions/mean_length"] * samples, "reward": logs["reward"],
                   "sync_s": timer["sync_s"], "gen_s": timer["gen_s"],
                   "mismatch_mean": logs.get("sampling/sampling_logp_difference/mean"),
                   "mismatch_max": logs.get("sampling/sampling_logp_difference/max")}
            with open(steps_path, "a") as f:
                f.write(json.dumps(rec) + "\n")
            timer.update(sync_s=0.0, gen_s=0.0)
            self.t_last = now

    trainer.add_callback(Steps())
    try:
        trainer.train()
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
