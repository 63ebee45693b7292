"""verl 0.9.1's run of the peers job: ``python -m verl.trainer.main_ppo`` with GRPO, as its docs run it.

Modes:

- ``colocate``: verl's default - the v1 ``sync`` trainer with the hybrid engine (FSDP actor and vLLM
  on every GPU, vLLM asleep while the actor trains, weights handed over in memory).
- ``legacy``: the same placement through the pre-v1 ``RayPPOTrainer`` (``trainer.use_v1=False``,
  deprecated in 0.9.1 but shipped; no TransferQueue, no replay buffer polling).
- ``separate_async``: two or more GPUs, the v1 trainer on one and a standalone vLLM rollout on the rest,
  weights over verl's NCCL checkpoint engine, one step off-policy - what verl's docs present as
  its fastest placement.

verl's defaults stay where the job says nothing: its rollout correction (off), its PPO ratio
against old log-probs the actor recomputes, token-mean loss aggregation. Set to the job: the
learning rate (constant), weight decay 0 (verl's default is 0.01), clipping, the batch (one
optimizer step per step), sampling, no KL, no gradient checkpointing (disagg and TRL do not
checkpoint activations either). Forced by the GPU image: ``sdpa`` attention and no padding removal
(flash-attn has no wheel for it).

Step records come from verl's file logger (``trainer.logger=[console,file]``, one JSON line per step):
``timing_s/step``, ``timing_s/update_weights`` (the trainer blocked on the weight hand-over),
``timing_s/gen``, ``critic/score/mean``, ``response_length/mean``. The logger carries no clock, so a
step's time is when the bench first saw its line (it polls every second).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from disagg.bench.peers.job import JobFiles, PeerJob
from disagg.bench.peers.runs import PeerRun

MODES = ("colocate", "legacy", "separate_async")
CORRECTION = "none (verl's default: rollout_is off)"


def best_mode(gpus: int) -> str:
    return "colocate" if gpus < 2 else "separate_async"


def overrides(job: PeerJob, files: JobFiles, gpus: int, mode: str) -> list[str]:
    """``main_ppo`` overrides that make the job in ``mode`` (pure)."""
    if mode not in MODES:
        raise ValueError(f"verl mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "separate_async" and gpus < 2:
        raise ValueError("verl separate_async needs two GPUs (trainer and rollout on one each)")
    micro = job.micro_batch_size
    rollout = "actor_rollout_ref.rollout."
    actor = "actor_rollout_ref.actor."
    out = [
        "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=False",
        f"data.train_files={files.train_parquet}", f"data.val_files={files.val_parquet}",
        f"data.train_batch_size={job.prompts_per_step}", f"data.max_prompt_length={job.max_prompt_tokens}",
        f"data.max_response_length={job.max_tokens}", "data.shuffle=False", "data.filter_overlong_prompts=False",
        "data.dataloader_num_workers=0", f"data.seed={job.seed}",
        f"actor_rollout_ref.model.path={files.model}", "actor_rollout_ref.model.use_remove_padding=False",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        f"{actor}optim.lr={job.lr}", f"{actor}optim.weight_decay=0.0", f"{actor}optim.clip_grad={job.grad_clip}",
        f"{actor}optim.lr_warmup_steps_ratio=0.0", f"{actor}optim.lr_scheduler_type=constant",
        f"{actor}ppo_mini_batch_size={job.prompts_per_step}", f"{actor}ppo_micro_batch_size_per_gpu={micro}",
        f"{actor}clip_ratio={job.clip_eps}", f"{actor}use_kl_loss=False", f"{actor}entropy_coeff=0",
        f"{actor}ppo_epochs=1",
        f"{rollout}name=vllm", f"{rollout}n={job.group_size}", f"{rollout}tensor_model_parallel_size=1",
        f"{rollout}log_prob_micro_batch_size_per_gpu={micro}", f"{rollout}temperature={job.temperature}",
        f"{rollout}top_p={job.top_p}", f"{rollout}max_model_len={job.max_model_len}",
        f"{rollout}max_num_seqs={max(256, job.samples_per_step)}", f"{rollout}calculate_log_probs=True",
        f"reward.custom_reward_function.path={files.reward}", "reward.custom_reward_function.name=compute_score",
        "trainer.nnodes=1", f"trainer.n_gpus_per_node={1 if mode == 'separate_async' else max(gpus, 1)}",
        "trainer.logger=[console,file]",
        f"trainer.total_training_steps={job.steps}", "trainer.val_before_train=False", "trainer.test_freq=-1",
        "trainer.save_freq=-1", "trainer.project_name=disagg_peers", f"trainer.experiment_name=verl_{mode}",
        "ray_kwargs.ray_init.num_cpus=32",
    ]
    if mode in ("colocate", "legacy"):
        out.append(f"{rollout}gpu_memory_utilization={job.gpu_memory_utilization}")
    if mode == "legacy":
        out.append("trainer.use_v1=False")
    if mode == "separate_async":
        out += ["trainer.v1.trainer_mode=separate_async", "trainer.v1.separate_async.parameter_sync_step=1",
                "actor_rollout_ref.hybrid_engine=False", f"{rollout}nnodes=1", f"{rollout}n_gpus_per_node={gpus - 1}",
                f"{rollout}checkpoint_engine.backend=nccl", f"{rollout}gpu_memory_utilization=0.85"]
    return out


def plan(job: PeerJob, files: JobFiles, gpus: int, mode: str, out: Path, site: str | None) -> PeerRun:
    """verl in its own interpreter, with ``site`` (verl and what it needs) first on its path."""
    env = {"VERL_FILE_LOGGER_PATH": str(out / "verl_metrics.jsonl"), "RAY_DEDUP_LOGS": "0", "HYDRA_FULL_ERROR": "1",
           "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled"}
    seen: dict[int, float] = {}
    return PeerRun(framework="verl", mode=mode, gpus=gpus, correction=CORRECTION,
                   cmd=[sys.executable, "-m", "verl.trainer.main_ppo", *overrides(job, files, gpus, mode)], env=env,
                   out=out, cwd=out, collect=lambda run: collect(run, job, seen), path=[site] if site else [])


def collect(run: PeerRun, job: PeerJob, seen: dict[int, float]) -> list[dict[str, Any]]:
    """verl's file-logger lines as step records; ``seen`` keeps when each step's line first appeared."""
    path = run.out / "verl_metrics.jsonl"
    out = []
    if not path.exists():
        return out
    now = time.time()
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        step, m = int(rec["step"]), rec["data"]
        if not all(k in m for k in ("timing_s/step", "response_length/mean", "critic/score/mean")):
            continue  # not a train step's record
        t = seen.setdefault(step, now)
        samples = job.samples_per_step
        out.append({"step": step, "t": t, "step_s": m["timing_s/step"], "samples": samples,
                    "tokens": m["response_length/mean"] * samples, "reward": m["critic/score/mean"],
                    "sync_s": m.get("timing_s/update_weights", 0.0), "gen_s": m.get("timing_s/gen"),
                    "prob_diff_mean": m.get("training/rollout_probs_diff_mean"),
                    "masked_share": m.get("actor/pg_clipfrac")})
    return out
