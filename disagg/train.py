"""``disagg train``: set up the job, sync the initial weights, run the pipeline.

Every mechanism lives in a component (``Job`` for the cluster and transport,
``Pipeline`` for the overlapped generate / score / train / sync loop with bounded
staleness, ``Scorer`` for rewards and advantages). Policy versions: the engines
start on dummy weights (version 0, never served); the trainer's initial weights
are version 1 and every optimizer step produces the next version. A resumed run
(``resume=``, ``disagg.resume``) starts from a checkpoint of step N: its trainer
loads the checkpoint, its first sync is version N + 1, its first step N + 1.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path

from disagg import faults, storage
from disagg.cluster import write_placement
from disagg.config import Config
from disagg.job import Job
from disagg.metrics import MetricsWriter, plot_rewards, reward_summary
from disagg.model.warmstart import prepare_model
from disagg.pipeline import Pipeline
from disagg.paths import check_outside_ray_package
from disagg.resume import (ResumableSource, ResumePoint, config_changes, default_checkpoint_dir, load_resume,
                           prune_checkpoints)
from disagg.scoring import Scorer
from disagg.tasks import get_reward
from disagg.tasks.base import PromptSource
from disagg.sandbox import require_filesystem_isolation
from disagg.trackers import open_trackers

log = logging.getLogger("disagg.train")


def make_source(cfg: Config, start: int = 0) -> PromptSource:
    """The task's prompt stream from row ``start`` on."""
    if cfg.data.train_files:
        from disagg.tasks.files import FilePromptSource

        return FilePromptSource(list(cfg.data.train_files), cfg.data.prompt_key, cfg.data.seed, cfg.data.shuffle,
                                start)
    if cfg.data.task == "calculator":
        from disagg.tasks.calculator import CalculatorSource

        return CalculatorSource(cfg.data.num_digits, seed=cfg.data.seed, start=start)
    if cfg.data.task == "code":
        from disagg.tasks.code import CodeTaskSource

        return CodeTaskSource(cfg.data.seed, start)
    from disagg.tasks.reverse import ReverseDigitsSource

    return ReverseDigitsSource(cfg.data.num_digits, seed=cfg.data.seed, start=start)


def encode_prompt(tokenizer, text: str, add_bos: bool) -> tuple[int, ...]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    bos = tokenizer.bos_token_id
    if add_bos and bos is not None and (not ids or ids[0] != bos):
        ids = [bos] + ids
    return tuple(ids)


def make_pipeline(cfg: Config, job: Job, tokenizer, source: PromptSource | None = None, **kw) -> Pipeline:
    """The pipeline of ``cfg``'s task (or ``source``) and reward on ``job`` (keyword arguments go to ``Pipeline``)."""
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    if cfg.reward.require_sandbox_isolation:
        require_filesystem_isolation()  # the driver scores when reward.num_workers=0
    scorer = Scorer(get_reward(cfg.reward.name, cfg.reward.path), decode, cfg.algorithm, cfg.reward.latency_s)
    kw.setdefault("agent", is_agent_task(cfg))
    return Pipeline(cfg, job, source or make_source(cfg), lambda text: encode_prompt(tokenizer, text, cfg.data.add_bos),
                    decode, scorer, **kw)


def is_agent_task(cfg: Config) -> bool:
    """Tasks whose samples are multi-turn tool-calling trajectories."""
    return not cfg.data.train_files and cfg.data.task == "calculator"


def run(cfg: Config, run_dir: Path) -> Path:
    from transformers import AutoTokenizer

    faults.arm_from_env()
    get_reward(cfg.reward.name, cfg.reward.path)  # an unknown reward: a ConfigError (exit 2) before Ray starts
    cfg, run_dir, resume, changes = _plan_run(cfg, run_dir)
    # A checkpoint is a complete model directory: the trainer loads its weights, the engines its
    # architecture and tokenizer (they start on dummy weights either way), each from its node's copy.
    model_path = resume.checkpoint if resume else prepare_model(cfg)
    base_model = resume.base_model_path if resume else str(model_path)
    tokenizer = AutoTokenizer.from_pretrained(storage.local_copy(str(model_path), cfg.model.cache_dir))
    resume_step = resume.step if resume else None
    metrics = MetricsWriter(run_dir, open_trackers(cfg, run_dir, resume_step), resume_step=resume_step)
    job = Job.start(cfg, run_dir, model_path)
    try:
        write_placement(job)
        first_step = 1  # the initial weights are version first_step (the pipeline's convention)
        if resume is not None:
            _restore(job, cfg, resume, run_dir, metrics.num_dropped, changes)
            first_step = resume.first_step
        sync = job.sync_weights(first_step, trainer_step=first_step - 1)
        log.info("initial weights (version %d) synced: %d bytes in %.3fs", first_step, sync.bytes, sync.seconds)
        state = job.coordinator.state
        source = ResumableSource(make_source(cfg, resume.data_cursor if resume else 0),
                                 resume.data_replay if resume else ())
        pipeline = None
        written: dict[int, str] = {}  # step -> checkpoint path, this process's

        def checkpoint(step: int, version: int) -> str:
            untrained = [*pipeline.sched.inflight, *(g.gid for g in pipeline.sched.ready)]
            path = job.save_checkpoint(step, version, {
                "data_cursor": source.cursor, "data_pending": source.pending(untrained),
                "counts": dict(pipeline.scored), "scheduler_counts": dict(pipeline.sched.counts),
                "base_model_path": base_model, "num_trainer_workers": cfg.trainer.num_workers,
                "run_dir": str(run_dir)})
            written[step] = path
            prune_checkpoints(job.checkpoint_dir, cfg.trainer.keep_checkpoints, resume.checkpoint if resume else None)
            faults.hit("checkpoint_written")
            return path

        with _progress(cfg, first_step - 1) as bar:
            pipeline = make_pipeline(cfg, job, tokenizer, source=source, metrics=metrics, progress=bar,
                                     checkpoint=checkpoint)
            if resume is not None:
                pipeline.scored.update(resume.counts)
                pipeline.sched.counts.update(resume.scheduler_counts)
            try:
                pipeline.run(cfg.trainer.total_steps - (first_step - 1), first_step=first_step)
            except BaseException:
                state.set_phase("failed")
                raise
        step, version = pipeline.last_done if pipeline.last_done[0] else (first_step - 1, first_step)
        if (pipeline.stopped is not None or cfg.trainer.checkpoint_every) and step not in written:
            state.checkpoint_written(step, version, checkpoint(step, version))
        if pipeline.stopped is not None:
            log.warning("stopped on request (%s) after step %d of %d: checkpoint %s; %d prompt groups were still "
                        "generating", pipeline.stopped, step, cfg.trainer.total_steps, written[step],
                        pipeline.abandoned_groups)
        state.set_phase("stopped")
    finally:
        metrics.close()
        job.shutdown()
    if cfg.logging.plot:
        png = plot_rewards(metrics.path, run_dir / "reward.png")
        if png:
            log.info("reward curve: %s", png)
    summary = reward_summary(metrics.path)
    log.info("reward: first 10%% of steps %.3f, last 10%% %.3f (%d steps)", summary["first_10pct"],
             summary["last_10pct"], summary["steps"])
    return run_dir


def _plan_run(cfg: Config, run_dir: Path) -> tuple[Config, Path, ResumePoint | None, dict[str, list]]:
    """Before anything starts: the checkpoint ``cfg.resume`` names (checked: ``load_resume``), the run
    directory the run goes on in, the config with its checkpoint directory, written there as
    ``config.json``, and the keys a resume changed."""
    resume = load_resume(cfg) if cfg.resume else None
    if resume is not None:
        if resume.run_dir is None:
            log.info("the run directory of %s is not on this machine: the resumed run goes on in %s",
                     resume.checkpoint, run_dir)
        run_dir = resume.run_dir or run_dir
        log.info("resuming the run in %s from %s (step %d, policy version %d)", run_dir, resume.checkpoint,
                 resume.step, resume.policy_version)
    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer,
                                                               checkpoint_dir=_checkpoint_dir(cfg, run_dir, resume)))
    run_dir.mkdir(parents=True, exist_ok=True)
    log.info("run directory: %s; checkpoints: %s", run_dir,
             cfg.trainer.checkpoint_dir or default_checkpoint_dir(run_dir))
    changes = _config_changes(run_dir, cfg) if resume else {}
    (run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    return cfg, run_dir, resume, changes


def _checkpoint_dir(cfg: Config, run_dir: Path, resume: ResumePoint | None) -> str | None:
    """``trainer.checkpoint_dir`` as this run uses it: a path made absolute (never inside a Ray
    package) or a URL; unset, a resumed run keeps the directory of the checkpoint it resumed from;
    None = ``<run_dir>/checkpoints``."""
    value = cfg.trainer.checkpoint_dir
    if value is not None:
        where = storage.normalize(value)
        if not storage.is_url(where):
            check_outside_ray_package(Path(where), "trainer.checkpoint_dir", value, "/shared/checkpoints/<name>")
        return where
    if resume is None or (not storage.is_url(resume.checkpoint_dir) and os.path.realpath(resume.checkpoint_dir)
                          == os.path.realpath(default_checkpoint_dir(run_dir))):
        return None
    return resume.checkpoint_dir


def _config_changes(run_dir: Path, cfg: Config) -> dict[str, list]:
    """What differs from the config the run last started with (its ``config.json``)."""
    old = run_dir / "config.json"
    return config_changes(json.loads(old.read_text()), cfg.to_dict()) if old.exists() else {}


def _restore(job: Job, cfg: Config, resume: ResumePoint, run_dir: Path, metrics_dropped: int, changes: dict) -> None:
    """Load the checkpoint's optimizer, scheduler and RNG state into the trainer (its weights were
    loaded at start) and append what was restored to ``<run_dir>/resume.jsonl``."""
    reference = resume.base_model_path if cfg.algorithm.kl_coef > 0 else None
    trainer = job.trainer.load_checkpoint(resume.checkpoint, reference)
    entry = {"time_unix_s": time.time(), "checkpoint": str(resume.checkpoint), "step": resume.step,
             "policy_version": resume.policy_version, "num_trainer_workers_saved": resume.num_trainer_workers,
             "num_trainer_workers": cfg.trainer.num_workers, "data_cursor": resume.data_cursor,
             "data_replayed": list(resume.data_replay), "metrics_records_removed": metrics_dropped,
             "trainer": trainer, "config_changes": changes}
    with (run_dir / "resume.jsonl").open("a") as f:
        f.write(json.dumps(entry) + "\n")
    kept = [k for k in ("trainer.lr", "trainer.betas", "trainer.weight_decay") if k in changes]
    if kept:
        log.warning("%s changed, but the resumed optimizer keeps the checkpoint's hyperparameters", ", ".join(kept))
    log.info("resumed at step %d: %s -> %d trainer workers, Adam step %d, lr %.3g, data row %d (%d rows in flight "
             "at the checkpoint drawn again first); config changes: %s", resume.step, resume.num_trainer_workers,
             cfg.trainer.num_workers, trainer["optimizer_step"], trainer["lr"], resume.data_cursor,
             len(resume.data_replay), ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changes.items()) or "none")


class _progress:
    """A tqdm bar showing step, reward and policy version (plain log lines if disabled)."""

    def __init__(self, cfg: Config, initial: int = 0):
        self.cfg = cfg
        self.total = cfg.trainer.total_steps
        self.initial = initial  # steps done before this process (a resumed run)
        self.bar = None

    def __enter__(self):
        if self.cfg.logging.progress:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, initial=self.initial, desc="GRPO", unit="step", dynamic_ncols=True)
        return self

    def update(self, step: int, rec: dict) -> None:
        msg = {"reward": f"{rec['reward/mean']:.3f}", "version": rec["policy_version"], "stale": rec["policy/staleness_max"],
               "sync_ms": f"{1000 * rec['timing/weight_sync_s']:.0f}"}
        if "train/logprob_mismatch_mean" in rec:  # |engine - trainer| log-prob of the tokens trained
            msg["mismatch"] = f"{rec['train/logprob_mismatch_mean']:.3f}"
        if rec.get("samples/dropped_stale"):  # the run's total: samples too stale to train, dropped
            msg["stale_drops"] = rec["samples/dropped_stale"]
        if rec.get("samples/steps_held_for_old_groups"):  # algorithm.stale_groups=wait: steps that waited
            msg["held"] = rec["samples/steps_held_for_old_groups"]
        if self.bar is not None:
            self.bar.set_postfix(msg, refresh=False)
            self.bar.update(1)
        else:
            log.info("step %d/%d %s", step, self.total, msg)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()
