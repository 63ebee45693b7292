"""The driver loop of ``disagg train``: generate -> score -> train -> sync.

It reads like the algorithm; every mechanism lives in a component (``Job`` for
the cluster and transport, ``Scorer`` for rewards and advantages, the pools for
the actors). Policy versions: the engines start on dummy weights (version 0,
never served); the trainer's initial weights are version 1 and every optimizer
step produces the next version, which is synced before the next rollout.
"""

from __future__ import annotations

import json
import logging
import time
from itertools import islice
from pathlib import Path

from disagg.config import Config
from disagg.job import Job
from disagg.metrics import MetricsWriter, plot_rewards, reward_summary
from disagg.model.warmstart import prepare_model
from disagg.rollout.types import GenRequest, SamplingSpec
from disagg.scoring import Scorer
from disagg.tasks.base import PromptSource, get_reward

log = logging.getLogger("disagg.train")


def make_source(cfg: Config) -> PromptSource:
    if cfg.data.train_files:
        from disagg.tasks.files import FilePromptSource

        return FilePromptSource(list(cfg.data.train_files), cfg.data.prompt_key, cfg.data.seed, cfg.data.shuffle)
    from disagg.tasks.reverse import ReverseDigitsSource

    return ReverseDigitsSource(cfg.data.num_digits, seed=cfg.data.seed)


def encode_prompt(tokenizer, text: str, add_bos: bool) -> tuple[int, ...]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    bos = tokenizer.bos_token_id
    if add_bos and bos is not None and (not ids or ids[0] != bos):
        ids = [bos] + ids
    return tuple(ids)


def run(cfg: Config, run_dir: Path) -> Path:
    from transformers import AutoTokenizer

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    model_path = prepare_model(cfg)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    source = make_source(cfg)
    scorer = Scorer(get_reward(cfg.reward.name, cfg.reward.path),
                    lambda ids: tokenizer.decode(ids, skip_special_tokens=True), cfg.algorithm)
    algo, roll = cfg.algorithm, cfg.rollout
    sampling = SamplingSpec(max_tokens=roll.max_tokens, temperature=roll.temperature, top_p=roll.top_p,
                            n=algo.group_size)
    metrics = MetricsWriter(run_dir, tensorboard=cfg.logging.tensorboard)
    job = Job.start(cfg, run_dir, model_path)
    stream = iter(source)
    try:
        version = 1
        sync = job.sync_weights(version, trainer_step=0)
        log.info("initial weights (version 1) synced: %d bytes in %.3fs", sync.bytes, sync.seconds)
        with _progress(cfg) as bar:
            for step in range(1, cfg.trainer.total_steps + 1):
                t0 = time.perf_counter()
                rows = list(islice(stream, algo.prompts_per_step))
                reqs = [GenRequest(f"s{step}-p{r.index}", encode_prompt(tokenizer, r.prompt, cfg.data.add_bos), sampling)
                        for r in rows]
                results = job.rollout.generate(reqs)
                t_roll = time.perf_counter() - t0
                batch = scorer.score(results, [r.row for r in rows])
                t1 = time.perf_counter()
                train = job.trainer.train_step(batch.samples) if batch.samples else {}
                t_train = time.perf_counter() - t1
                version += 1
                sync = job.sync_weights(version, trainer_step=step)
                gen_tokens = sum(batch.response_lens)
                rec = {
                    "policy_version": version,
                    "reward/mean": sum(batch.rewards) / max(len(batch.rewards), 1),
                    "reward/max": max(batch.rewards, default=0.0),
                    "response/len_mean": gen_tokens / max(len(batch.response_lens), 1),
                    "samples/trained": len(batch.samples),
                    "samples/dropped_prompt_too_long": 0,
                    "samples/reward_errors": 0,
                    **{f"samples/{k}": v for k, v in batch.counts.items()},
                    "data/skipped_rows": source.num_skipped,
                    "rollout/tokens_per_s": gen_tokens / t_roll if t_roll > 0 else 0.0,
                    "timing/rollout_s": t_roll,
                    "timing/train_s": t_train,
                    "timing/weight_sync_s": sync.seconds,
                    "weight_sync/bytes": sync.bytes,
                    "weight_sync/gb_per_s": sync.gb_per_s,
                    "weight_sync/send_s": sync.send_s,
                    "timing/step_s": time.perf_counter() - t0,
                    **{f"train/{k}": v for k, v in train.items()},
                }
                metrics.log(step, rec)
                bar.update(step, rec)
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
        msg = {"reward": f"{rec['reward/mean']:.3f}", "version": rec["policy_version"],
               "sync_ms": f"{1000 * rec['timing/weight_sync_s']:.0f}"}
        if self.bar is not None:
            self.bar.set_postfix(msg, refresh=False)
            self.bar.update(1)
        else:
            log.info("step %d/%d %s", step, self.total, msg)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()
