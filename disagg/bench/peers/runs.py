"""One framework's run of the peers job: launched as its users launch it, watched, stopped, summarised.

Each framework's driver (``disagg_run``, ``trl_run``, ``verl_run``) makes a ``PeerRun``: the command,
its environment and where its per-step records land. Every driver reduces its framework's own
output to the same step records, one JSON object per line in ``steps.jsonl``:

- ``step``, ``t`` (unix time at the step's end), ``step_s`` (its wall time),
- ``samples`` and ``tokens`` (response tokens trained this step), ``reward`` (mean),
- ``sync_s``: the trainer blocked on the weight sync this step,
- optional: ``gen_s`` (generation on the trainer's critical path), ``mismatch_mean`` /
  ``mismatch_max`` (|engine - trainer| log-prob), ``masked_share`` (tokens clipped or masked by the
  mismatch correction).

``summarise`` turns them, with the engines' step trace (``vllm_lengths``), into the bench's entry.
It is pure: the tests drive it with records they make.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

REWARD_TARGET = 0.9
REWARD_WINDOW = 10  # steps in the moving average of the reward
BUSY_GAP_S = 0.25  # sampling steps closer than this: the engine worked between them


@dataclass
class PeerRun:
    """A framework's run of the job: ``cmd`` in ``cwd`` with ``env``; its step records at ``steps``."""

    framework: str
    mode: str
    gpus: int
    correction: str
    """The mismatch correction it ran (its default unless the bench says otherwise)."""
    cmd: list[str]
    env: dict[str, str]
    out: Path
    """The run's folder: log, step records, the engines' step trace."""
    cwd: Path | None = None
    collect: Callable[["PeerRun"], list[dict[str, Any]]] | None = None
    """Reads the framework's own output into step records (None: the run writes ``steps.jsonl`` itself)."""
    path: list[str] = field(default_factory=list)
    """Folders put first on the run's PYTHONPATH (the framework's own site, the bench's plugin)."""
    notes: list[str] = field(default_factory=list)

    @property
    def log_path(self) -> Path:
        return self.out / "run.log"

    @property
    def steps_path(self) -> Path:
        return self.out / "steps.jsonl"

    @property
    def trace_dir(self) -> Path:
        return self.out / "engine_steps"

    def steps(self) -> list[dict[str, Any]]:
        if self.collect is not None:
            return self.collect(self)
        return read_steps(self.steps_path)


def read_steps(path: Path) -> list[dict[str, Any]]:
    """The step records at ``path`` (a line cut off by a kill is skipped)."""
    out = []
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


@dataclass
class RunResult:
    exit_code: int | None
    t_launch: float
    t_end: float
    steps: list[dict[str, Any]]
    stopped_by: str
    """'finished' (it exited by itself), 'steps', 'target' (reward reached and kept), 'budget', 'timeout'."""


def launch(run: PeerRun, *, max_steps: int, budget_s: float, timeout_s: float, stop_after_target: int | None,
           poll_s: float = 1.0) -> RunResult:
    """Run ``run`` until it exits, has ``max_steps`` steps, trained ``budget_s`` seconds after its first
    step, held the reward target for ``stop_after_target`` steps (None: never stop there), or ``timeout_s``
    passed since launch; then stop it with its whole process group. Progress is logged every 30 s."""
    run.out.mkdir(parents=True, exist_ok=True)
    run.trace_dir.mkdir(exist_ok=True)
    pythonpath = os.pathsep.join([*run.path, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env = {**os.environ, **run.env, "PYTHONPATH": pythonpath, "PYTHONUNBUFFERED": "1",
           "DISAGG_PEERS_TRACE": str(run.trace_dir)}
    logf = open(run.log_path, "w")
    t0 = time.time()
    proc = subprocess.Popen(run.cmd, cwd=run.cwd, env=env, stdout=logf, stderr=subprocess.STDOUT,
                            start_new_session=True)
    stopped_by = "finished"
    steps: list[dict[str, Any]] = []
    last_note = t0
    try:
        while proc.poll() is None:
            time.sleep(poll_s)
            now = time.time()
            steps = run.steps()
            why = _stop_reason(steps, now, t0, max_steps=max_steps, budget_s=budget_s, timeout_s=timeout_s,
                               stop_after_target=stop_after_target)
            if why:
                stopped_by = why
                break
            if now - last_note >= 30:
                last = steps[-1] if steps else None
                print(f"peers: {run.framework} {run.mode}: {now - t0:.0f} s, "
                      + (f"step {last['step']}, reward {last['reward']:.3f}" if last else "no step yet"), flush=True)
                last_note = now
    finally:
        if stopped_by == "steps":  # its last step is done: let it shut down by itself first
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        stop_group(proc)
        logf.close()
    t_end = time.time()
    return RunResult(proc.returncode, t0, t_end, run.steps(), stopped_by)


def _stop_reason(steps, now, t0, *, max_steps, budget_s, timeout_s, stop_after_target) -> str | None:
    if now - t0 > timeout_s:
        return "timeout"
    if not steps:
        return None
    if len(steps) >= max_steps:
        return "steps"
    first_start = steps[0]["t"] - steps[0]["step_s"]
    if now - first_start > budget_s:
        return "budget"
    if stop_after_target is not None:
        hit = first_reaching(steps, REWARD_TARGET)
        if hit is not None and len(steps) - 1 - hit >= stop_after_target:
            return "target"
    return None


def stop_group(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGINT the process group (frameworks shut their engines down on it), then SIGKILL what is left."""
    if proc.poll() is None:
        for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGTERM, 10.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # its children too, if the leader already exited
    except (ProcessLookupError, PermissionError):
        pass
    if proc.poll() is None:
        proc.wait(timeout=30)


# ---- summary (pure) ------------------------------------------------------------------------
def moving_average(values: list[float], window: int = REWARD_WINDOW) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def first_reaching(steps: list[dict[str, Any]], target: float, window: int = REWARD_WINDOW) -> int | None:
    """Index of the first step whose moving-average reward (a full window) is >= ``target``."""
    ma = moving_average([s["reward"] for s in steps], window)
    for i, v in enumerate(ma):
        if i + 1 >= window and v >= target:
            return i
    return None


def engine_busy_s(times: list[float], start: float, end: float, gap_s: float = BUSY_GAP_S) -> float:
    """Seconds of [start, end] in which an engine was generating: the spans between consecutive sampling
    steps closer than ``gap_s`` (one engine's sorted step times)."""
    busy = 0.0
    inside = [t for t in times if start <= t <= end]
    for a, b in zip(inside, inside[1:]):
        if b - a < gap_s:
            busy += b - a
    return busy


def read_trace(trace_dir: Path) -> dict[str, list[float]]:
    """Engine process -> its sorted sampling-step times (``vllm_lengths``' trace)."""
    out = {}
    for p in sorted(Path(trace_dir).glob("steps-*.txt")):
        times = []
        for line in p.read_text().splitlines():
            parts = line.split()
            if parts:
                try:
                    times.append(float(parts[0]))
                except ValueError:
                    continue
        if times:
            out[p.stem] = sorted(times)
    return out


def summarise(run: PeerRun, result: RunResult, *, shape: str, card: str, engine: str, warmup_steps: int,
              trace: dict[str, list[float]] | None = None) -> dict[str, Any]:
    """The bench's entry for one run: rates over the steps after ``warmup_steps``, the reward's way to
    0.9 (from launch and from the first step), the engines' idle share over the measured steps."""
    steps = result.steps
    entry: dict[str, Any] = {
        "framework": run.framework, "mode": run.mode, "gpus": run.gpus, "card": card, "shape": shape,
        "engine": engine, "correction": run.correction, "exit_code": result.exit_code, "stopped_by": result.stopped_by,
        "steps_run": len(steps), "warmup_steps": warmup_steps, "notes": list(run.notes),
    }
    if not steps:
        entry["error"] = "no train step completed"
        return entry
    measured = steps[warmup_steps:] if len(steps) > warmup_steps else steps[-1:]
    wall = sum(s["step_s"] for s in measured)
    first_start = steps[0]["t"] - steps[0]["step_s"]
    m_start = measured[0]["t"] - measured[0]["step_s"]
    m_end = measured[-1]["t"]
    entry.update({
        "setup_s": first_start - result.t_launch,
        "measured_steps": len(measured),
        "trained_tokens_per_s": sum(s["tokens"] for s in measured) / wall if wall > 0 else 0.0,
        "samples_per_s": sum(s["samples"] for s in measured) / wall if wall > 0 else 0.0,
        "step_s": statistics.median(s["step_s"] for s in measured),
        "step_s_mean": wall / len(measured),
        "sync_blocked_s": statistics.mean(s["sync_s"] for s in measured),
        "tokens_per_step": statistics.mean(s["tokens"] for s in measured),
        # the job as trained: a run that dropped samples (too stale) or trained other lengths did another job
        "response_tokens_per_sample": sum(s["tokens"] for s in measured) / max(1, sum(s["samples"] for s in measured)),
        "samples_dropped": max(s.get("dropped", 0) for s in steps),
        "reward_first": statistics.mean(s["reward"] for s in steps[: max(1, len(steps) // 10)]),
        "reward_last": statistics.mean(s["reward"] for s in steps[-max(1, len(steps) // 10):]),
    })
    for key in ("gen_s", "mismatch_mean", "mismatch_max", "masked_share"):
        vals = [s[key] for s in measured if s.get(key) is not None]
        if vals:
            entry[key] = max(vals) if key == "mismatch_max" else statistics.mean(vals)
    if trace:
        busy = sum(engine_busy_s(times, m_start, m_end) for times in trace.values())
        entry["engine_idle_share"] = max(0.0, 1.0 - busy / (len(trace) * max(m_end - m_start, 1e-9)))
        entry["engine_processes"] = len(trace)
    hit = first_reaching(steps, REWARD_TARGET)
    entry["seconds_to_reward_0_9"] = None if hit is None else steps[hit]["t"] - result.t_launch
    entry["train_seconds_to_reward_0_9"] = None if hit is None else steps[hit]["t"] - first_start
    entry["samples_to_reward_0_9"] = None if hit is None else sum(s["samples"] for s in steps[: hit + 1])
    entry["curve"] = [{"t": round(s["t"] - result.t_launch, 3), "step": s["step"], "reward": s["reward"],
                       "samples": s["samples"]} for s in steps]
    return entry
