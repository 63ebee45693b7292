"""``disagg bench soak``: a long `disagg train` run that meets an operator and a crash.

The job runs as a user runs it (``disagg train`` in a subprocess, the default task
with ``max_staleness=1`` and two engines). While it runs, this process
- samples the resident memory (RSS) of the driver, the trainer, the engines (their
  vLLM model processes included) and everything else the job started, every
  ``--sample-s`` seconds;
- pauses the rollout through ``disagg ctl pause`` and resumes it ``--pause-s`` later;
- kills one engine's process with SIGKILL (the job must notice, requeue its groups and
  start a replacement);
- stops the job with ``disagg ctl stop`` at the end.
It then reports RSS growth (the mean over the last ``--window-min`` minutes against the
mean over the first window after warm-up), the fault counts from ``metrics.jsonl``
(prompts lost, samples trained beyond the staleness limit, requests answered on dummy
weights, engine deaths and replacements) and the event timeline from the coordinator,
and draws RSS over time with the events marked.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def _ctl(run_dir: Path, *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "disagg", "ctl", args[0], "--run-dir", str(run_dir), *args[1:]],
                         capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"disagg ctl {' '.join(args)} failed ({out.returncode}): {out.stderr.strip()[-2000:]}")
    return out.stdout


def _status(run_dir: Path) -> dict:
    return json.loads(_ctl(run_dir, "status", "--json"))


def _classify(proc) -> str:
    """Which part of the job a process is."""
    try:
        cmd = " ".join(proc.cmdline())
    except Exception:  # noqa: BLE001 - gone meanwhile
        return "other"
    if "EngineActor" in cmd or "EngineCore" in cmd:  # Ray's and vLLM's process titles
        return "engines"
    if "TrainerWorker" in cmd:
        return "trainer"
    return "other"


def _rss(driver_pid: int) -> dict[str, float]:
    """RSS in MiB of the driver and its process tree, by part."""
    import psutil

    try:
        root = psutil.Process(driver_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    out = {"driver": 0.0, "trainer": 0.0, "engines": 0.0, "other": 0.0}
    for p in procs:
        try:
            rss = p.memory_info().rss / 2**20
        except psutil.Error:
            continue
        part = "driver" if p.pid == driver_pid else _classify(p)
        out[part] += rss
    out["total"] = sum(out.values())
    return out


def _engine_pid(run_dir: Path) -> int:
    """The pid of the lowest-numbered live engine, from the coordinator."""
    live = [e for e in _status(run_dir)["engines"] if e["state"] not in ("DEAD", "DRAINING")]
    return int(min(live, key=lambda e: e["engine_id"])["pid"])


def run(args) -> dict:
    run_dir = Path(args.run_dir).resolve()
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    overrides = ["trainer.total_steps=1000000", "algorithm.max_staleness=1", "rollout.num_engines=2",
                 f"rollout.health_timeout_s={args.health_timeout_s}", "logging.progress=false",
                 f"hydra.run.dir={run_dir}", *args.overrides]
    log_path = run_dir.parent / f"{run_dir.name}.log"
    logf = open(log_path, "w")
    job = subprocess.Popen([sys.executable, "-m", "disagg", "train", *overrides], stdout=logf, stderr=subprocess.STDOUT,
                           env={**os.environ, "PYTHONUNBUFFERED": "1"})
    t0 = time.time()
    samples: list[dict] = []
    events: list[tuple[float, str]] = []
    duration = args.minutes * 60
    plan = [(0.4 * duration, "pause"), (0.4 * duration + args.pause_s, "resume"), (0.6 * duration, "kill")]
    print(f"soak: `disagg train {' '.join(overrides)}` for {args.minutes:g} min (log {log_path})", flush=True)
    try:
        while not _last_record(run_dir):  # up: engines started, first step done
            if job.poll() is not None:
                raise RuntimeError(f"disagg train exited with {job.returncode} before its first step; see {log_path}")
            if time.time() - t0 > 900:
                raise RuntimeError(f"no first step within 900 s; see {log_path}")
            time.sleep(2)
        t_up = time.time()
        events.append((t_up - t0, "first step"))
        next_sample = 0.0
        last_print = 0.0
        while time.time() - t_up < duration:
            if job.poll() is not None:
                raise RuntimeError(f"disagg train exited with {job.returncode} during the soak; see {log_path}")
            now = time.time() - t_up
            if now >= next_sample:
                samples.append({"t_s": time.time() - t0, **_rss(job.pid)})
                next_sample = now + args.sample_s
            while plan and now >= plan[0][0]:
                _, what = plan.pop(0)
                if what in ("pause", "resume"):
                    _ctl(run_dir, what, "--reason", "soak")
                else:
                    pid = _engine_pid(run_dir)
                    os.kill(pid, signal.SIGKILL)
                    what = f"kill -9 engine pid {pid}"
                events.append((time.time() - t0, what))
                print(f"soak: {now / 60:5.1f} min  {what}", flush=True)
            if now - last_print >= 60:
                last = samples[-1]
                step = _last_record(run_dir).get("step", 0)
                print(f"soak: {now / 60:5.1f} min  step {step}  RSS total {last['total']:.0f} MiB (driver "
                      f"{last['driver']:.0f}, trainer {last['trainer']:.0f}, engines {last['engines']:.0f})", flush=True)
                last_print = now
            time.sleep(1.0)
        status = _status(run_dir)
        _ctl(run_dir, "stop", "--reason", "soak done")
        events.append((time.time() - t0, "stop"))
        job.wait(timeout=600)
    finally:
        if job.poll() is None:
            job.send_signal(signal.SIGINT)
            try:
                job.wait(timeout=60)
            except subprocess.TimeoutExpired:
                job.kill()
        logf.close()
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return _report(args, records, samples, events, status, job.returncode, t_up - t0, t0)


def _last_record(run_dir: Path) -> dict:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return json.loads(lines[-1]) if lines else {}
    except (OSError, ValueError):
        return {}


def _mean(xs: list[float]) -> float:
    return sum(xs) / max(len(xs), 1)


def _report(args, records, samples, events, status, exit_code, t_up, t0) -> dict:
    warm = t_up + args.warmup_min * 60
    first = [s for s in samples if warm <= s["t_s"] < warm + args.window_min * 60]
    end = samples[-1]["t_s"] if samples else 0.0
    last = [s for s in samples if s["t_s"] >= end - args.window_min * 60]
    growth = {part: _mean([s[part] for s in last]) / max(_mean([s[part] for s in first]), 1e-9) - 1
              for part in ("total", "driver", "trainer", "engines")}
    final = records[-1]
    counts = {
        "steps": final["step"],
        "prompts_lost_max": max(r["rollout/prompts_lost"] for r in records),
        "trained_beyond_staleness": final["samples/trained_beyond_staleness"],
        "dummy_served": final["rollout/dummy_served"],
        "engine_deaths": final["rollout/engine_deaths"],
        "engines_replaced": final["rollout/engines_replaced"],
        "groups_requeued": final["rollout/groups_requeued"],
        "sync_failures": final["transport/sync_failures"],
        "reward_first_10pct": _mean([r["reward/mean"] for r in records[: max(1, len(records) // 10)]]),
        "reward_last_10pct": _mean([r["reward/mean"] for r in records[-max(1, len(records) // 10):]]),
    }
    report = {"minutes": args.minutes, "exit_code": exit_code, "rss_growth": growth,
              "rss_first_window_mib": _mean([s["total"] for s in first]),
              "rss_last_window_mib": _mean([s["total"] for s in last]), "counts": counts,
              "bench_events": [{"t_s": t, "what": w} for t, w in events],
              "job_events": status.get("events", []), "rss_samples": samples}
    print("\nsoak report")
    print(f"  duration            {args.minutes:g} min after the first step, {counts['steps']} steps, exit code {exit_code}")
    print(f"  RSS total           {report['rss_first_window_mib']:.0f} MiB -> {report['rss_last_window_mib']:.0f} MiB "
          f"({growth['total']:+.1%}; driver {growth['driver']:+.1%}, trainer {growth['trainer']:+.1%}, "
          f"engines {growth['engines']:+.1%})")
    for k, v in counts.items():
        print(f"  {k:<24} {v:.3f}" if isinstance(v, float) else f"  {k:<24} {v}")
    print("  timeline (s since launch):")
    for t, w in events:
        print(f"    {t:7.1f}  bench: {w}")
    for e in status.get("events", []):
        print(f"    {e['unix_s'] - t0:7.1f}  job:   {e['kind']}: {e['message'][:160]}")
    if args.plot:
        _plot(samples, events, args.plot)
        print(f"  plot: {args.plot}")
    return report


def _plot(samples, events, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    t = [s["t_s"] / 60 for s in samples]
    for part in ("total", "engines", "trainer", "driver", "other"):
        ax.plot(t, [s[part] for s in samples], label=part)
    for te, what in events:
        ax.axvline(te / 60, color="grey", ls="--", lw=0.8)
        ax.text(te / 60, ax.get_ylim()[1] * 0.98, what.split(" pid")[0], rotation=90, va="top", fontsize=7)
    ax.set_xlabel("minutes since launch")
    ax.set_ylabel("RSS (MiB)")
    ax.set_title("disagg bench soak: resident memory of the job's processes")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="disagg bench soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0, help="soak length after the first step (default 30)")
    p.add_argument("--sample-s", type=float, default=10.0, help="RSS sampling period (default 10 s)")
    p.add_argument("--pause-s", type=float, default=30.0, help="how long the rollout stays paused (default 30 s)")
    p.add_argument("--warmup-min", type=float, default=3.0, help="minutes before the first RSS window (default 3)")
    p.add_argument("--window-min", type=float, default=3.0, help="RSS windows compared, in minutes (default 3)")
    p.add_argument("--health-timeout-s", type=float, default=30.0, help="rollout.health_timeout_s of the job")
    p.add_argument("--run-dir", default="runs/bench-soak", help="the job's run directory")
    p.add_argument("--plot", default=None, metavar="PNG", help="draw RSS over time with the events")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the report as JSON")
    p.add_argument("overrides", nargs="*", help="more `disagg train` overrides (key=value)")
    args = p.parse_args(argv)
    report = run(args)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"  json: {args.json}")
    return 0 if report["exit_code"] == 0 else 1
