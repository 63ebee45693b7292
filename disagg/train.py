"""``disagg train``: set up the job, sync the initial weights, run the pipeline.

Every mechanism lives in a component (``Job`` for the cluster and transport,
``Pipeline`` for the overlapped generate / score / train / sync loop with bounded
staleness, ``Scorer`` for rewards and advantages). Policy versions: the engines
start on dummy weights (version 0, never served); the trainer's initial weights
are version 1 and every optimizer step produces the next version.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from disagg.config import Config
from disagg.job import Job
from disagg.metrics import MetricsWriter, plot_rewards, reward_summary
from disagg.model.warmstart import prepare_model
from disagg.pipeline import Pipeline
from disagg.scoring import Scorer
from disagg.tasks.base import PromptSource, get_reward

log = logging.getLogger("disagg.train")


def make_source(cfg: Config) -> PromptSource:
    if cfg.data.train_files:
        from disagg.tasks.files import FilePromptSource

        return FilePromptSource(list(cfg.data.train_files), cfg.data.prompt_key, cfg.data.seed, cfg.data.shuffle)
    if cfg.data.task == "calculator":
        from disagg.tasks.calculator import CalculatorSource

        return CalculatorSource(cfg.data.num_digits, seed=cfg.data.seed)
    if cfg.data.task == "code":
        from disagg.tasks.code import CodeTaskSource

        return CodeTaskSource(cfg.data.seed)
    from disagg.tasks.reverse import ReverseDigitsSource

    return ReverseDigitsSource(cfg.data.num_digits, seed=cfg.data.seed)


def encode_prompt(tokenizer, text: str, add_bos: bool) -> tuple[int, ...]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    bos = tokenizer.bos_token_id
    if add_bos and bos is not None and (not ids or ids[0] != bos):
        ids = [bos] + ids
    return tuple(ids)


def make_pipeline(cfg: Config, job: Job, tokenizer, **kw) -> Pipeline:
    """The pipeline of ``cfg``'s task and reward on ``job`` (keyword arguments go to ``Pipeline``)."""
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    scorer = Scorer(get_reward(cfg.reward.name, cfg.reward.path), decode, cfg.algorithm, cfg.reward.latency_s)
    kw.setdefault("agent", is_agent_task(cfg))
    return Pipeline(cfg, job, make_source(cfg), lambda text: encode_prompt(tokenizer, text, cfg.data.add_bos),
                    decode, scorer, **kw)


def is_agent_task(cfg: Config) -> bool:
    """Tasks whose samples are multi-turn tool-calling trajectories."""
    return not cfg.data.train_files and cfg.data.task == "calculator"


def run(cfg: Config, run_dir: Path) -> Path:
    from transformers import AutoTokenizer

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    model_path = prepare_model(cfg)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    metrics = MetricsWriter(run_dir, tensorboard=cfg.logging.tensorboard)
    job = Job.start(cfg, run_dir, model_path)
    try:
        sync = job.sync_weights(1, trainer_step=0)
        log.info("initial weights (version 1) synced: %d bytes in %.3fs", sync.bytes, sync.seconds)
        state = job.coordinator.state
        pipeline = None

        def checkpoint(step: int, version: int) -> str:
            return job.save_checkpoint(step, version, {"data_cursor": getattr(pipeline.data, "cursor", None),
                                                       "counts": dict(pipeline.counts)})

        with _progress(cfg) as bar:
            pipeline = make_pipeline(cfg, job, tokenizer, metrics=metrics, progress=bar, checkpoint=checkpoint)
            try:
                pipeline.run(cfg.trainer.total_steps)
            except BaseException:
                state.set_phase("failed")
                raise
        if pipeline.stopped is not None:
            step, version = pipeline.last_done if pipeline.last_done[0] else (0, 1)
            path = checkpoint(step, version)
            state.checkpoint_written(step, version, path)
            log.warning("stopped on request (%s) after step %d of %d: checkpoint %s; %d prompt groups were still "
                        "generating", pipeline.stopped, step, cfg.trainer.total_steps, path, pipeline.abandoned_groups)
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


class _progress:
    """A tqdm bar showing step, reward and policy version (plain log lines if disabled)."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.total = cfg.trainer.total_steps
        self.bar = None

    def __enter__(self):
        if self.cfg.logging.progress:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, desc="GRPO", unit="step", dynamic_ncols=True)
        return self

    def update(self, step: int, rec: dict) -> None:
        msg = {"reward": f"{rec['reward/mean']:.3f}", "version": rec["policy_version"], "stale": rec["policy/staleness_max"],
               "sync_ms": f"{1000 * rec['timing/weight_sync_s']:.0f}"}
        if self.bar is not None:
            self.bar.set_postfix(msg, refresh=False)
            self.bar.update(1)
        else:
            log.info("step %d/%d %s", step, self.total, msg)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()
