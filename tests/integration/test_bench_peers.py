"""``disagg bench peers`` end to end on CPU: the job written, disagg run through the harness (real Ray,
real vLLM with the bench's logits-processor plugin, a real trainer), its steps summarised.

verl and TRL have no CPU build here; their drivers run on the GPU machines (docs/peers.md). What this
proves on CPU is the harness every framework goes through: the plugin reaches an engine the bench did
not build itself (it is found through the PYTHONPATH the bench gives the framework's process), holds
every response to its prompt's length, and records the engine's sampling steps; the step records,
summary, JSON and plot come out of a real run; a framework that is not there is reported, not run.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from disagg.bench.peers.job import load_job
from disagg.bench.peers.lengths import Lengths, target_length


@pytest.mark.timeout(600)
def test_the_bench_runs_disagg_with_every_response_held_to_its_prompts_length(tmp_path):
    out, report_path, png = tmp_path / "peers", tmp_path / "peers.json", tmp_path / "peers.png"
    empty_site = tmp_path / "no_verl_here"
    empty_site.mkdir()
    cmd = [sys.executable, "-m", "disagg", "bench", "peers", "--device", "cpu", "--runs", "disagg,verl",
           "--verl-site", str(empty_site), "--steps", "4", "--prompts-per-step", "8", "--group-size", "4",
           "--tail", "3,12,0.3", "--out", str(out), "--json", str(report_path), "--plot", str(png)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(report_path.read_text())
    ours, verl = report["runs"]
    assert verl["framework"] == "verl" and str(empty_site) in verl["skipped"]
    for key in ("framework", "mode", "gpus", "card", "shape", "trained_tokens_per_s", "step_s", "sync_blocked_s",
                "seconds_to_reward_0_9", "samples_per_s", "engine_idle_share", "correction", "engine"):
        assert key in ours, key
    assert (ours["framework"], ours["mode"], ours["steps_run"], ours["stopped_by"]) == ("disagg", "sync", 4, "steps")
    assert ours["correction"] == "ppo" and ours["engine"].startswith("vLLM ")
    assert 0.0 <= ours["engine_idle_share"] < 1.0 and ours["engine_processes"] == 1
    assert ours["mismatch_mean"] is not None and ours["trained_tokens_per_s"] > 0
    assert png.stat().st_size > 0 and "disagg:sync" in proc.stdout

    # Every group's responses were exactly its prompt's length (the plugin in disagg's engine): a step's
    # response tokens are short x (short samples) + long x (long samples), whole groups each.
    job = load_job(out / "job")
    lengths = Lengths.parse(job.lengths_spec)
    records = [json.loads(x) for x in (out / "00-disagg-sync" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 4
    for r in records:
        samples = r["samples/trained"]
        tokens = round(r["response/len_mean"] * samples)
        num_long, rest = divmod(tokens - lengths.short * samples, lengths.long - lengths.short)
        assert rest == 0 and 0 <= num_long <= samples and num_long % job.group_size == 0, (r["step"], tokens)
    # ... and the lengths disagg generated are those of the job's prompts (some long, most short)
    from disagg.model.tiny import build_tokenizer
    from disagg.train import encode_prompt

    tok = build_tokenizer()  # the job's model directory is removed after the runs (--keep-files keeps it)
    rows = [json.loads(x) for x in (out / "job" / "train.jsonl").read_text().splitlines()]
    want = [target_length(encode_prompt(tok, r["prompt"], True), lengths) for r in rows[: 4 * job.prompts_per_step]]
    assert {lengths.short, lengths.long} <= set(want)
    assert sum(round(r["response/len_mean"] * r["samples/trained"]) for r in records) == job.group_size * sum(want)
