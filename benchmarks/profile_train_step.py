"""Where a GPU train step's time goes, on the long-tail bench's batches (issue 30's profile).

Runs one TrainerWorker in this process (no Ray, no engine) on the shape's random model and times
``train_step`` on two batches the long-tail bench trains: a batch step (32 groups of 4, 10 % of
responses long) and a stream step (mostly the short groups that finish first). Then one step of
each under torch.profiler: the top operators by CPU and by CUDA time.

    python benchmarks/profile_train_step.py [OUT_DIR] [overrides...]   # e.g. shape=qwen2.5-0.5b
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import torch

from disagg.config import load_config
from disagg.config.files import compose_train
from disagg.model.warmstart import prepare_model
from disagg.samples import TrainSample
from disagg.trainer.worker import TrainerWorker


def batch(rng: random.Random, groups: int, long_fraction: float, short: int = 128, long: int = 2048):
    out = []
    for g in range(groups):
        n = long if rng.random() < long_fraction else short
        prompt = [rng.randrange(10, 1000) for _ in range(12)]
        for i in range(4):
            resp = [rng.randrange(10, 1000) for _ in range(n)]
            out.append(TrainSample(prompt, resp, [-1.0] * n, 1.0 if i % 2 else -1.0, 0.0, 1))
    return out


def timed(worker: TrainerWorker, samples, repeats: int = 3) -> list[float]:
    tokens = [sum(len(s.response_ids) for s in samples)]
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        worker.train_step(samples, tokens)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "profile-out")
    out.mkdir(parents=True, exist_ok=True)
    data = compose_train(["cluster=gpu", "shape=qwen2.5-0.5b", *sys.argv[2:]])
    data.setdefault("model", {}).setdefault("warmstart", {})["steps"] = 0
    cfg = load_config(data)
    path = prepare_model(cfg)
    w = TrainerWorker(0, 1, str(path), cfg.trainer, cfg.algorithm, cfg.transport, cfg.rollout.temperature, "cuda",
                      log_level="WARNING")
    w.setup()
    rng = random.Random(0)
    cases = {"batch (32 groups, 10% long)": batch(rng, 32, 0.1),
             "stream-like (28 short + 4 long groups)": batch(rng, 28, 0.0) + batch(rng, 4, 1.0),
             "short only (32 groups of 128)": batch(rng, 32, 0.0)}
    lines = [f"trainer: micro_batch_size={cfg.trainer.micro_batch_size} micro_batch_tokens="
             f"{cfg.trainer.micro_batch_tokens} off_policy={cfg.algorithm.off_policy} kl_coef={cfg.algorithm.kl_coef}"]
    timed(w, cases["short only (32 groups of 128)"], 1)  # warm-up
    for name, samples in cases.items():
        tokens = sum(len(s.response_ids) for s in samples)
        torch.cuda.reset_peak_memory_stats()
        t = timed(w, samples)
        lines.append(f"{name}: {len(samples)} samples, {tokens} response tokens: train_step "
                     f"{', '.join(f'{x:.3f}' for x in t)} s ({tokens / min(t):.0f} tokens/s), "
                     f"peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    print("\n".join(lines), flush=True)
    for name in ("batch (32 groups, 10% long)", "short only (32 groups of 128)"):
        samples = cases[name]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            timed(w, samples, 1)
        avg = prof.key_averages()
        lines.append(f"== {name}: by CPU time\n{avg.table(sort_by='cpu_time_total', row_limit=25)}")
        lines.append(f"== {name}: by CUDA time\n{avg.table(sort_by='cuda_time_total', row_limit=15)}")
    text = "\n".join(lines)
    (out / f"profile_train_step{'_' + '_'.join(sys.argv[2:]) if sys.argv[2:] else ''}.txt").write_text(text)


if __name__ == "__main__":
    main()
