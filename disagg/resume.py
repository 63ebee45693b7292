"""Continuing a run from one of its checkpoints (``disagg train resume=<run_dir>``).

A checkpoint is ``<run_dir>/checkpoints/step_<N>/`` (``Job.save_checkpoint``): complete once
its ``.partial`` suffix is gone. This module picks the checkpoint a ``resume`` value names,
checks that the run can continue from it, replays the prompts that were drawn but not trained
when it was written, and keeps the newest checkpoints. It plans on the driver before any actor
starts, so it never imports torch or vLLM; the trainer workers load the tensors themselves.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from disagg.config import Config
from disagg.errors import ConfigError
from disagg.tasks.base import PromptRow, PromptSource

log = logging.getLogger("disagg.resume")

CHECKPOINTS = "checkpoints"
_STEP = re.compile(r"step_(\d+)")


def checkpoint_path(run_dir: Path, step: int) -> Path:
    """Where the checkpoint of ``step`` lives (``Job.save_checkpoint`` writes it as ``.partial`` first)."""
    return run_dir / CHECKPOINTS / f"step_{step:06d}"


def checkpoint_step(path: Path) -> int | None:
    """N of a complete checkpoint directory ``step_<N>``; None for anything else (``.partial`` included)."""
    m = _STEP.fullmatch(path.name)
    return int(m.group(1)) if m else None


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """The run's complete checkpoints, oldest step first."""
    root = run_dir / CHECKPOINTS
    found = [p for p in root.iterdir() if p.is_dir() and checkpoint_step(p) is not None] if root.is_dir() else []
    return sorted(found, key=checkpoint_step)


def find_checkpoint(resume: str) -> Path:
    """The checkpoint ``resume=<path>`` names: the path itself if it is one, else the latest complete
    checkpoint of the run directory it names. A ConfigError naming ``resume`` if there is none."""
    p = Path(resume).expanduser().resolve()
    if not p.is_dir():
        raise ConfigError(f"resume={resume!r}: no such directory")
    if p.name.endswith(".partial"):
        raise ConfigError(f"resume={resume!r}: an incomplete checkpoint (its writer did not finish); "
                          f"resume={str(p.parent.parent)!r} takes the run's latest complete one")
    if checkpoint_step(p) is not None:
        return p
    found = complete_checkpoints(p)
    if not found:
        partial = sorted(x.name for x in (p / CHECKPOINTS).glob("*.partial"))
        raise ConfigError(f"resume={resume!r}: no complete checkpoint in {p / CHECKPOINTS}"
                          + (f" (only incomplete ones: {', '.join(partial)})" if partial else "")
                          + "; a run writes them with trainer.checkpoint_every=N, `disagg ctl checkpoint` "
                            "or `disagg ctl stop`")
    return found[-1]


@dataclass(frozen=True)
class ResumePoint:
    """What a resumed run continues from (``state.json`` of the checkpoint)."""

    checkpoint: Path
    run_dir: Path
    step: int
    """The last step the checkpoint holds; the resumed run's first step is ``step + 1``."""
    policy_version: int
    """The version of the checkpoint's weights (``step + 1``): the resumed run's first sync."""
    data_cursor: int
    """The index of the next prompt row never drawn."""
    data_replay: tuple[int, ...]
    """Rows drawn but not trained when the checkpoint was written: drawn again first."""
    counts: dict[str, int]
    scheduler_counts: dict[str, int]
    base_model_path: str | None
    """The model the run started from: the KL reference when algorithm.kl_coef > 0."""
    num_trainer_workers: int | None

    @property
    def first_step(self) -> int:
        return self.step + 1


def load_resume(cfg: Config) -> ResumePoint:
    """The checkpoint ``cfg.resume`` names and the checks that ``cfg`` can continue from it."""
    assert cfg.resume is not None
    ckpt = find_checkpoint(cfg.resume)
    run_dir = ckpt.parent.parent
    if cfg.run_dir is not None and Path(cfg.run_dir).expanduser().resolve() != run_dir:
        raise ConfigError(f"resume={cfg.resume!r} continues the run in {run_dir}, but run_dir={cfg.run_dir!r}: "
                          "leave run_dir unset")
    later = [p.name for p in complete_checkpoints(run_dir) if checkpoint_step(p) > checkpoint_step(ckpt)]
    if later:
        raise ConfigError(f"resume={cfg.resume!r}: {ckpt.name} is not the run's latest checkpoint (later: "
                          f"{', '.join(later)}) and resuming would rewind the run over them: delete them first, or "
                          f"resume={str(run_dir)!r} for the latest")
    if not (ckpt / "state.json").is_file():
        raise ConfigError(f"resume={cfg.resume!r}: {ckpt} has no state.json (not a disagg checkpoint)")
    state = json.loads((ckpt / "state.json").read_text())
    step, version = int(state["step"]), int(state["policy_version"])
    if version != step + 1:
        raise ConfigError(f"resume={cfg.resume!r}: {ckpt}/state.json has step {step} with policy_version {version}; "
                          "the weights after step N are version N + 1")
    if cfg.trainer.total_steps <= step:
        raise ConfigError(f"trainer.total_steps={cfg.trainer.total_steps}: the checkpoint resume={cfg.resume!r} is "
                          f"at step {step} already; set trainer.total_steps above it")
    base = state.get("base_model_path")
    if cfg.algorithm.kl_coef > 0 and not (base and Path(base).is_dir()):
        raise ConfigError(f"algorithm.kl_coef={cfg.algorithm.kl_coef}: the KL reference is the run's base model "
                          f"{base!r} (from {ckpt}/state.json), which is not a directory here")
    return ResumePoint(ckpt, run_dir, step, version, int(state["data_cursor"]),
                       tuple(state.get("data_pending", ())), dict(state.get("counts", {})),
                       dict(state.get("scheduler_counts", {})), base, state.get("num_trainer_workers"))


class ResumableSource:
    """A task's prompt stream that first draws ``replay`` rows, and knows which row each group drew.

    The pipeline numbers prompt groups in the order it draws rows (group id k holds the k-th
    row drawn), so ``pending`` turns the ids of the groups not trained at a checkpoint into the
    rows a resumed run must draw again.
    """

    def __init__(self, source: PromptSource, replay: Iterable[int] = ()) -> None:
        self.source = source
        self._replay = deque(replay)
        self._drawn: list[int] = []  # group id -> row index

    @property
    def cursor(self) -> int:
        return self.source.cursor

    @property
    def num_skipped(self) -> int:
        return self.source.num_skipped

    def __iter__(self) -> Iterator[PromptRow]:
        rows = iter(self.source)
        while True:
            row = self.source.row_at(self._replay.popleft()) if self._replay else next(rows)
            self._drawn.append(row.index)
            yield row

    def pending(self, gids: Iterable[int]) -> list[int]:
        """The rows of groups ``gids`` (drawn, not trained) and the replay rows not drawn yet."""
        return sorted({self._drawn[g] for g in gids} | set(self._replay))


def prune_checkpoints(run_dir: Path, keep: int, protect: Path | None = None) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints (never ``protect``) and every ``.partial``
    one; returns what was deleted. ``keep=0`` deletes nothing. Call only between checkpoint writes:
    a ``.partial`` directory then is a dead writer's."""
    if keep == 0:
        return []
    root = run_dir / CHECKPOINTS
    gone = [p for p in complete_checkpoints(run_dir)[:-keep] if p != protect]
    gone += sorted(root.glob("*.partial"))
    for p in gone:
        shutil.rmtree(p)
    if gone:
        log.info("deleted checkpoints %s (trainer.keep_checkpoints=%d)", ", ".join(p.name for p in gone), keep)
    return gone


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> dict[str, list]:
    """``{"trainer.num_workers": [1, 2], ...}``: the keys whose values differ (``resume`` left out)."""
    def flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in d.items():
            if isinstance(v, dict):
                out.update(flat(v, f"{prefix}{k}."))
            else:
                out[f"{prefix}{k}"] = list(v) if isinstance(v, tuple) else v
        return out

    a, b = flat(old), flat(new)
    return {k: [a.get(k), b.get(k)] for k in sorted(a.keys() | b.keys()) if k != "resume" and a.get(k) != b.get(k)}

