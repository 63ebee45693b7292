"""Continuing a run from one of its checkpoints (``disagg train resume=<run_dir>``).

A checkpoint is ``<checkpoint_dir>/step_<N>/`` (``Job.save_checkpoint``), where the checkpoint
directory is ``trainer.checkpoint_dir`` - a shared path or an fsspec URL - or by default
``<run_dir>/checkpoints``. It is complete once its ``state.json`` is there: a local writer fills
``step_<N>.partial`` and renames it, a remote one writes ``state.json``, then ``manifest.json``, the
size and digest of every file (``disagg.digests``). This module picks the checkpoint a ``resume``
value names - the newest whose files match its manifest: a damaged one is skipped, moved aside and
named with its faults - checks that the run can continue from it, replays the prompts
that were drawn but not trained when it was written, and keeps the newest checkpoints. It plans on
the driver before any actor starts, so it never imports torch or vLLM; the trainer workers and
engines load the checkpoint themselves, each from its node's copy (``disagg.storage``).
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import re
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from disagg import storage
from disagg.config import Config
from disagg.digests import MANIFEST
from disagg.errors import CheckpointDamaged, ConfigError
from disagg.tasks.base import PromptRow, PromptSource

log = logging.getLogger("disagg.resume")

CHECKPOINTS = "checkpoints"
STATE = "state.json"
DEFAULT_CACHE_DIR = "~/.cache/disagg"
"""``model.cache_dir``'s default: where a checkpoint at a URL is copied to be checked and loaded."""
_STEP = re.compile(r"step_(\d+)")


def default_checkpoint_dir(run_dir: Path) -> str:
    """Where a run's checkpoints go when ``trainer.checkpoint_dir`` is null."""
    return str(run_dir / CHECKPOINTS)


def checkpoint_path(checkpoint_dir: str, step: int) -> str:
    """Where the checkpoint of ``step`` lives under ``checkpoint_dir`` (a path or an fsspec URL)."""
    return storage.join(checkpoint_dir, f"step_{step:06d}")


def checkpoint_step(location: str) -> int | None:
    """N of a checkpoint named ``step_<N>``; None for any other name (``.partial`` included)."""
    m = _STEP.fullmatch(posixpath.basename(str(location).rstrip("/")))
    return int(m.group(1)) if m else None


def complete_checkpoints(checkpoint_dir: str) -> list[str]:
    """The complete checkpoints under ``checkpoint_dir``, oldest step first: the ``step_<N>``
    directories holding a ``state.json`` (written last)."""
    found = [storage.join(checkpoint_dir, n) for n in storage.list_dirs(checkpoint_dir)
             if checkpoint_step(n) is not None]
    return sorted((c for c in found if storage.exists(storage.join(c, STATE))), key=checkpoint_step)


def _is_run_dir(location: str) -> bool:
    """A run directory: local, with the ``config.json`` every run writes when it starts."""
    return not storage.is_url(location) and os.path.isfile(os.path.join(location, "config.json"))


def run_checkpoint_dir(run_dir: str) -> str:
    """Where the run in ``run_dir`` writes its checkpoints: ``trainer.checkpoint_dir`` of its
    ``config.json`` if set, else ``<run_dir>/checkpoints``."""
    cfg = os.path.join(run_dir, "config.json")
    recorded = json.loads(Path(cfg).read_text()).get("trainer", {}).get("checkpoint_dir") if os.path.isfile(cfg) \
        else None
    return recorded or os.path.join(run_dir, CHECKPOINTS)


@dataclass(frozen=True)
class Verdict:
    """What a checkpoint's files said when checked against its manifest (``verify_checkpoint``)."""

    checkpoint: str
    faults: tuple[str, ...]
    """One line per damaged file ('optimizer.pt: missing'); empty: the checkpoint can be loaded."""
    verified: bool
    """False for a checkpoint written before checkpoints carried a manifest: nothing to check."""

    @property
    def name(self) -> str:
        return posixpath.basename(self.checkpoint)

    def says(self) -> str:
        return f"{self.name} ({'; '.join(self.faults)})"


def verify_checkpoint(location: str, cache_dir: str = DEFAULT_CACHE_DIR) -> Verdict:
    """Check every file of the checkpoint at ``location`` against its ``manifest.json``: sizes,
    then digests (``disagg.digests``). A checkpoint at a URL is copied into this node's cache, where
    the copy is checked (``storage.local_copy``; the processes of this node then reuse it)."""
    manifest = storage.join(location, MANIFEST)
    if not storage.exists(manifest):
        try:
            state = json.loads(storage.read_text(storage.join(location, STATE)))
        except (OSError, ValueError) as e:
            return Verdict(location, (f"{STATE}: unreadable ({type(e).__name__}: {e})",), False)
        if isinstance(state, dict) and "manifest" in state:  # its writer died before writing the manifest
            return Verdict(location, (f"{MANIFEST}: missing (its writer did not finish)",), True)
        return Verdict(location, (), False)
    if storage.is_url(location):
        try:
            storage.local_copy(location, cache_dir)
        except CheckpointDamaged as e:
            return Verdict(location, tuple(e.faults), True)
        return Verdict(location, (), True)
    return Verdict(location, tuple(storage.manifest_faults(Path(location))), True)


def find_checkpoint(resume: str, cache_dir: str = DEFAULT_CACHE_DIR) -> str:
    """The checkpoint ``resume=<location>`` names: the location itself if it is one (named
    ``step_<N>`` or holding a ``state.json``), else the newest complete checkpoint that verifies
    (``newest_verified``) of the run directory it names (see ``run_checkpoint_dir``) or of the
    checkpoint directory it names (a path or fsspec URL holding ``step_<N>`` directories). A
    ConfigError naming ``resume`` if there is none, or if the one it names is damaged."""
    loc = storage.normalize(resume).rstrip("/")
    if not storage.exists(loc):
        raise ConfigError(f"resume={resume!r}: no such directory")
    if loc.endswith(".partial"):
        raise ConfigError(f"resume={resume!r}: an incomplete checkpoint (its writer did not finish); "
                          f"resume={posixpath.dirname(loc)!r} takes the latest complete one there")
    if checkpoint_step(loc) is not None or storage.exists(storage.join(loc, STATE)):
        verdict = verify_checkpoint(loc, cache_dir)
        if verdict.faults:
            raise ConfigError(f"resume={resume!r}: the checkpoint is damaged: {'; '.join(verdict.faults)}; "
                              f"resume={posixpath.dirname(loc)!r} takes the newest one there that verifies")
        _say_verified(verdict)
        return loc
    where = run_checkpoint_dir(loc) if _is_run_dir(loc) else loc
    found = complete_checkpoints(where)
    if not found:
        names = storage.list_dirs(where)
        partial = [n for n in names if n.endswith(".partial") or checkpoint_step(n) is not None]
        raise ConfigError(f"resume={resume!r}: no complete checkpoint in {where}"
                          + (f" (only incomplete ones: {', '.join(partial)})" if partial else "")
                          + "; a run writes them with trainer.checkpoint_every=N, `disagg ctl checkpoint` "
                            "or `disagg ctl stop`")
    return newest_verified(resume, found, cache_dir)


def newest_verified(resume: str, found: list[str], cache_dir: str = DEFAULT_CACHE_DIR) -> str:
    """The newest of ``found`` (complete checkpoints, oldest first) whose files match its manifest.
    Each newer one that does not is renamed ``<name>.damaged-<unix time>`` (kept for a look, out of
    the way of the resumed run's own checkpoints and of pruning), and one WARNING line says which
    and why. A ConfigError naming every checkpoint and its faults when none verifies."""
    skipped: list[Verdict] = []
    for ckpt in reversed(found):
        verdict = verify_checkpoint(ckpt, cache_dir)
        if verdict.faults:
            skipped.append(verdict)
            continue
        if skipped:
            moved = [posixpath.basename(storage.move_aside(v.checkpoint, f"damaged-{int(time.time())}"))
                     for v in skipped]
            log.warning("skipped the damaged checkpoint%s %s, moved to %s; resuming from %s",
                        "s" if len(skipped) > 1 else "", ", ".join(v.says() for v in skipped), ", ".join(moved),
                        verdict.name)
        _say_verified(verdict)
        return ckpt
    raise ConfigError(f"resume={resume!r}: no checkpoint in {posixpath.dirname(found[0])} verifies: "
                      + ", ".join(v.says() for v in skipped))


def _say_verified(verdict: Verdict) -> None:
    if verdict.verified:
        log.info("checkpoint %s verified: every file matches its %s", verdict.name, MANIFEST)
    else:
        log.warning("checkpoint %s has no %s (written before disagg recorded checkpoint digests): loaded "
                    "unverified", verdict.name, MANIFEST)


@dataclass(frozen=True)
class ResumePoint:
    """What a resumed run continues from (``state.json`` of the checkpoint)."""

    checkpoint: str
    """The checkpoint: a path or an fsspec URL (each process loads it from its node's copy)."""
    checkpoint_dir: str
    """The directory holding it and the run's other checkpoints."""
    run_dir: Path | None
    """The run directory to continue in; None: not on this machine (a new one holds what follows)."""
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


def _resumed_run_dir(resume: str, ckpt: str, state: dict) -> Path | None:
    """The run directory a resume continues in: the one ``resume`` names; else the one the
    checkpoint's ``state.json`` records, if it is a directory here (None if not); for a checkpoint
    written before ``state.json`` recorded it, the run directory of ``<run_dir>/checkpoints/``."""
    target = storage.normalize(resume)
    if _is_run_dir(target):
        return Path(target)
    if "run_dir" in state:
        return Path(state["run_dir"]) if os.path.isdir(state["run_dir"]) else None
    if not storage.is_url(ckpt) and posixpath.basename(posixpath.dirname(ckpt)) == CHECKPOINTS:
        return Path(ckpt).parent.parent
    return None


def load_resume(cfg: Config) -> ResumePoint:
    """The checkpoint ``cfg.resume`` names and the checks that ``cfg`` can continue from it."""
    assert cfg.resume is not None
    ckpt = find_checkpoint(cfg.resume, cfg.model.cache_dir)
    ckpt_dir = posixpath.dirname(ckpt)
    if not storage.exists(storage.join(ckpt, STATE)):
        raise ConfigError(f"resume={cfg.resume!r}: {ckpt} has no {STATE} (an incomplete checkpoint, or not a disagg "
                          "checkpoint)")
    state = json.loads(storage.read_text(storage.join(ckpt, STATE)))
    run_dir = _resumed_run_dir(cfg.resume, ckpt, state)
    if cfg.run_dir is not None and run_dir is not None and \
            os.path.realpath(os.path.expanduser(cfg.run_dir)) != os.path.realpath(run_dir):
        raise ConfigError(f"resume={cfg.resume!r} continues the run in {run_dir}, but run_dir={cfg.run_dir!r}: "
                          "leave run_dir unset")
    later = [posixpath.basename(p) for p in complete_checkpoints(ckpt_dir)
             if checkpoint_step(p) > checkpoint_step(ckpt)]
    if later:
        raise ConfigError(f"resume={cfg.resume!r}: {posixpath.basename(ckpt)} is not the run's latest checkpoint "
                          f"(later: {', '.join(later)}) and resuming would rewind the run over them: delete them "
                          f"first, or resume={ckpt_dir!r} for the latest")
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
    return ResumePoint(ckpt, ckpt_dir, run_dir, step, version, int(state["data_cursor"]),
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


def prune_checkpoints(checkpoint_dir: str, keep: int, protect: str | None = None) -> list[str]:
    """Delete all but the newest ``keep`` complete checkpoints under ``checkpoint_dir`` (never
    ``protect``) and every incomplete one (``.partial``, or ``step_<N>`` without ``state.json``);
    returns what was deleted. ``keep=0`` deletes nothing. Call only between checkpoint writes: an
    incomplete checkpoint then is a dead writer's."""
    if keep == 0:
        return []
    complete = complete_checkpoints(checkpoint_dir)
    gone = [p for p in complete[:-keep] if p != protect]
    gone += [storage.join(checkpoint_dir, n) for n in storage.list_dirs(checkpoint_dir)
             if n.endswith(".partial") or (checkpoint_step(n) is not None
                                           and storage.join(checkpoint_dir, n) not in complete)]
    for p in gone:
        storage.remove(p)
    if gone:
        log.info("deleted checkpoints %s (trainer.keep_checkpoints=%d)", ", ".join(posixpath.basename(p) for p in gone),
                 keep)
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

