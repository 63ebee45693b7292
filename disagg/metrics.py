"""Per-step metrics: ``<run_dir>/metrics.jsonl``, the trackers of ``logging.backends``
(TensorBoard, wandb, MLflow: ``disagg.trackers``), and a reward plot.

One JSON object per step with slash-path keys and unit suffixes
(``timing/weight_sync_s``, ``weight_sync/gb_per_s``); every tracker gets the same names and steps.
The JSONL is always written: resume, the plot and the run's summary read it. The reward curve is
drawn at the end because people would rather look at it than read the JSONL.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from disagg.trackers import Tracker, scalars

log = logging.getLogger("disagg.metrics")

REQUIRED_KEYS = (
    "timing/rollout_s",
    "timing/train_s",
    "timing/weight_sync_s",
    "weight_sync/bytes",
    "weight_sync/gb_per_s",
    "reward/mean",
    "samples/trained",
    "timing/step_s",
    "policy_version",
)


class MetricsWriter:
    """Appends to ``<run_dir>/metrics.jsonl`` and logs each step to ``trackers``.

    ``resume_step``: the run continues after that step (a resume from its checkpoint). Records of
    later steps - written after that checkpoint, by a run that then died or was resumed from an
    older checkpoint - are removed from the JSONL (``num_dropped``); trackers that can replace a
    step (TensorBoard) hide them, the others (wandb, MLflow) already hold those steps and are not
    sent them again, so each step appears once everywhere.
    """

    def __init__(self, run_dir: Path, trackers: Sequence[Tracker] = (), resume_step: int | None = None):
        self.path = run_dir / "metrics.jsonl"
        self.num_dropped = 0
        self._held_until = resume_step or 0  # trackers that cannot replace a step hold those up to here
        if resume_step is not None and self.path.exists():
            self._held_until = max([resume_step, *(r["step"] for r in read_metrics(self.path))])
            self.num_dropped = truncate_metrics(self.path, resume_step)
        self._f = self.path.open("a")
        self.trackers = list(trackers)
        self.failed_trackers: list[str] = []  # trackers whose log raised: dropped, the run goes on
        keep = [t.name for t in self.trackers if not t.replaces_steps]
        if keep and self._held_until > (resume_step or 0):
            log.warning("%s already hold steps %d-%d from before the checkpoint of step %d resumed from: they keep "
                        "those values (metrics.jsonl gets the steps run again)", ", ".join(keep), resume_step + 1,
                        self._held_until, resume_step)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        rec = {"step": step, "time_unix_s": time.time(), **metrics}  # the JSONL only: trackers keep their own
        self._f.write(json.dumps(rec) + "\n")
        self._f.flush()
        values = scalars(metrics)
        for t in list(self.trackers):
            if t.replaces_steps or step > self._held_until:
                try:
                    t.log(step, values)
                except Exception as e:  # noqa: BLE001 - a tracker's failure must not end the run
                    # metrics.jsonl has every step; the tracker is left out from here on.
                    log.error("tracker %s failed at step %d and gets no more steps (metrics.jsonl has them all): "
                              "%s: %s", t.name, step, type(e).__name__, e)
                    self.trackers.remove(t)
                    self.failed_trackers.append(t.name)
                    try:
                        t.close(True)
                    except Exception:  # noqa: BLE001 - already reported above
                        log.debug("tracker %s could not be closed either", t.name, exc_info=True)

    def close(self) -> None:
        """Close the JSONL and end each tracker's run (as failed when called while an exception propagates)."""
        failed = sys.exc_info()[0] is not None
        self._f.close()
        for t in self.trackers:
            t.close(failed)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def truncate_metrics(path: Path, last_step: int) -> int:
    """Keep the records of steps <= ``last_step`` (rewritten atomically); returns how many were removed."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    keep = [line for line in lines if json.loads(line)["step"] <= last_step]
    if len(keep) < len(lines):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        tmp.replace(path)
        log.warning("%s: removed the records of %d steps after step %d (the checkpoint resumed from)", path,
                    len(lines) - len(keep), last_step)
    return len(lines) - len(keep)


def plot_rewards(metrics_path: Path, out: Path) -> Path | None:
    """Reward per step with a moving average; returns the PNG path (None if no steps)."""
    recs = read_metrics(metrics_path)
    if not recs:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in recs]
    reward = [r["reward/mean"] for r in recs]
    w = max(1, len(reward) // 20)
    smooth = [sum(reward[max(0, i - w + 1) : i + 1]) / len(reward[max(0, i - w + 1) : i + 1]) for i in range(len(reward))]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(steps, reward, alpha=0.35, label="reward/mean")
    ax.plot(steps, smooth, label=f"moving average ({w} steps)")
    ax.set_xlabel("step (policy version - 1)")
    ax.set_ylabel("mean reward")
    ax.set_ylim(min(0.0, min(reward)), max(1.0, max(reward)) * 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(f"reward: first 10% {_tenth(reward, first=True):.3f}, last 10% {_tenth(reward, first=False):.3f}")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def _tenth(values: list[float], first: bool) -> float:
    k = max(1, len(values) // 10)
    part = values[:k] if first else values[-k:]
    return sum(part) / len(part)


def reward_summary(metrics_path: Path) -> dict[str, float]:
    reward = [r["reward/mean"] for r in read_metrics(metrics_path)]
    return {"first_10pct": _tenth(reward, True), "last_10pct": _tenth(reward, False), "steps": len(reward)}
