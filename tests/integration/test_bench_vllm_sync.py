"""``disagg bench vllm-sync`` on CPU: a real job (vLLM engine, trainer, coordinator, gloo group), the raw
broadcast over the job's own group, and each sync's phases as the engine and its worker saw them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from disagg.bench.vllm_sync import SEQUENTIAL, parse_sizes, resolve_options, summarise
from disagg.rollout.types import TIMELINE, SyncReport, sync_timeline


def test_options_pick_both_load_modes_and_a_gpu_preset_on_cuda_and_refuse_direct_on_cpu():
    cuda = resolve_options({"device": "auto"}, gpus=1)
    assert cuda.device == "cuda" and cuda.loads == ("direct", "layerwise")
    assert cuda.overrides == ("cluster=one_gpu", "shape=qwen2.5-0.5b")
    assert resolve_options({"device": "cuda", "overrides": ("cluster=gpu",)}, gpus=2).overrides == (
        "shape=qwen2.5-0.5b", "cluster=gpu")
    cpu = resolve_options({}, gpus=0)
    assert cpu.device == "cpu" and cpu.loads == ("layerwise",) and cpu.overrides == ()
    with pytest.raises(ValueError, match="--loads direct needs --device cuda"):
        resolve_options({"device": "cpu", "loads": ("direct",)}, gpus=0)
    with pytest.raises(ValueError, match=r"--loads: unknown modes \['fast'\]"):
        resolve_options({"device": "cpu", "loads": ("fast",)}, gpus=0)
    assert resolve_options({"device": "cuda", "peer": "vllm-nccl"}, gpus=2).peer == "vllm-nccl"
    with pytest.raises(ValueError, match="--peer vllm-nccl needs --device cuda"):
        resolve_options({"device": "cpu", "peer": "vllm-nccl"}, gpus=0)
    assert resolve_options({"device": "cuda", "nccl_socket": True}, gpus=2).nccl_socket
    with pytest.raises(ValueError, match="--nccl-socket needs --device cuda"):
        resolve_options({"device": "cpu", "nccl_socket": True}, gpus=0)


def test_first_bucket_sizes_read_binary_units_and_a_bad_one_is_named():
    assert parse_sizes("0,32M,512K,1G,300") == (0, 32 << 20, 512 << 10, 1 << 30, 300)
    with pytest.raises(ValueError, match="'32MB' is not a byte count"):
        parse_sizes("0,32MB")
    with pytest.raises(ValueError, match="names a size twice"):
        parse_sizes("32M,33554432")


def test_summary_takes_medians_and_the_driver_share_is_what_no_engine_phase_covers():
    runs = [{"seconds": s, "send_s": 0.1, "phases": {"update_s": u, "quiesce_s": 0.1, "worker_load_s": 0.05,
                                                     "rpc_in_s": 0.2}}
            for s, u in ((1.0, 0.6), (2.0, 0.7), (1.2, 0.5))]
    out = summarise([0.5, 0.4, 0.6], {"layerwise": runs})
    m = out["modes"]["layerwise"]
    assert out["raw_s"] == 0.5 and m["seconds"] == 1.2 and m["raw_vs_sync"] == pytest.approx(0.5 / 1.2)
    assert m["fixed_s"] == pytest.approx(0.7) and m["phases"]["update_s"] == 0.6
    # medians of 0.3, 1.2, 0.6: the worker's phases and the call's ends (rpc_in_s) lie inside update_s
    assert m["driver_s"] == pytest.approx(0.6)
    assert list(m["phases"]) == ["quiesce_s", "update_s", "rpc_in_s", "worker_load_s"]  # in the order of a sync
    assert "peer" not in out


def test_a_syncs_timeline_places_each_partys_clock_readings_after_the_announce_latest_party_first():
    sent = [{"trainer_in_unix_s": 100.002, "trainer_header_unix_s": 100.0045, "trainer_out_unix_s": 100.020},
            {"trainer_in_unix_s": 100.004, "trainer_planned_unix_s": 100.0041, "trainer_out_unix_s": 100.018}]
    received = [SyncReport(0, 3, 1, 1, 1, 0.0, 0.0, stamps={"engine_in": 100.001, "wire_start": 100.006}),
                SyncReport(1, 3, 1, 1, 1, 0.0, 0.0, stamps={"engine_in": 100.003, "wire_start": 100.005})]
    t = sync_timeline(100.0, 0.025, sent, received)
    assert list(t) == ["trainer_in", "engine_in", "trainer_planned", "trainer_header", "wire_start", "trainer_out",
                       "done"]  # TIMELINE's order
    assert t == pytest.approx({"trainer_in": 0.004, "engine_in": 0.003, "trainer_planned": 0.0041,
                               "trainer_header": 0.0045, "wire_start": 0.006, "trainer_out": 0.020, "done": 0.025})
    assert sync_timeline(100.0, 0.01, [{}], []) == {"done": 0.01}  # nothing stamped: only the driver's


def test_summary_puts_the_peer_against_the_fastest_mode():
    runs = {mode: [{"seconds": s, "send_s": 0.0, "phases": {}} for s in secs]
            for mode, secs in (("direct", (0.02, 0.01, 0.03)), ("layerwise", (0.2, 0.3, 0.25)))}
    out = summarise([0.008, 0.009, 0.01], runs, peer_s=[0.08, 0.07, 0.09])
    assert out["peer"]["seconds"] == 0.08 and out["peer"]["disagg_speedup"] == pytest.approx(0.08 / 0.02)
    assert out["peer"]["raw_vs_peer"] == pytest.approx(0.009 / 0.08)


@pytest.mark.timeout(600)
def test_bench_vllm_sync_times_a_raw_broadcast_and_each_syncs_phases(tmp_path):
    out = tmp_path / "vs.json"
    cmd = [sys.executable, "-m", "disagg", "bench", "vllm-sync", "--device", "cpu", "--repeats", "2",
           "--run-dir", str(tmp_path / "run"), "--json", str(out), "--trace", str(tmp_path / "push.trace.json"),
           "--delta", "--delta-lr", "1e-5", "transport.dtype=bfloat16", "rollout.gpu_memory_utilization=0.06"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["backend"] == "gloo" and r["engine_workers"] == 1 and r["bytes"] > 0
    # beside each timed sync of 3 blocks (layerwise, armed, from a snapshot), then --delta's dense and delta syncs
    assert len(r["raw_all_s"]) == 6 + 4 and all(s > 0 for s in r["raw_all_s"])
    runs = r["syncs"]["layerwise"]
    assert len(runs) == 2 and r["resolved_loads"] == {"layerwise": "layerwise"}
    for run in runs:
        p = run["phases"]
        # the worker's receive loop runs inside the update RPC; the actor's phases inside the driver's sync
        assert 0 < p["worker_receive_s"] <= p["update_s"], p
        assert 0 < p["worker_load_s"] <= p["worker_receive_s"], p
        assert p["worker_reload_init_s"] > 0 and p["worker_finalize_s"] > 0  # layerwise: vLLM's reload ran
        assert sum(p.get(k, 0.0) for k in SEQUENTIAL) <= run["seconds"], run
        # the update call's ends, stamped by the worker, lie inside it
        assert 0 <= p["rpc_in_s"] + p["worker_receive_s"] + p["rpc_out_s"] <= p["update_s"] + 0.002, p
        # every party's events on the driver's timeline, in the order a sync makes them (one host's clock)
        t = run["timeline"]
        order = [t[k] for k in ("engine_in", "update_call", "worker_in", "wire_start", "wire_end", "loaded",
                                "worker_out", "update_return", "engine_out", "done")]
        assert order == sorted(order) and order[0] > 0, t
        assert t["trainer_in"] <= t["wire_start"] + 0.002 and t["wire_start"] < t["trainer_out"] <= t["done"], t
        assert t["trainer_in"] < t["trainer_header"] < t["trainer_out"], t  # the send's set-up, then the wire
        # the set-up step by step
        setup = [t[k] for k in ("trainer_in", "trainer_send", "trainer_planned", "trainer_header_copied",
                                "trainer_header")]
        assert setup == sorted(setup), t
    for run in r["syncs"]["layerwise, armed"]:  # the engine waited on the group before the announce
        p, t = run["phases"], run["timeline"]
        assert p["armed_wait_s"] >= 0.2 and p["update_s"] < run["seconds"], p  # the wait is not in the sync
        # a delta job's push (--delta): its header follows the word, as its table needs the buckets compared
        assert t["worker_in"] < 0 < t["trainer_in"] < t["trainer_header"] < t["trainer_first"] < t["worker_out"], t
        assert 0 < t["worker_word"] < t["wire_start"] < t["worker_out"] < t["done"], t
    m = r["modes"]["layerwise"]
    assert m["raw_vs_sync"] == pytest.approx(r["raw_s"] / m["seconds"])
    assert list(m["timeline"]) == [k for k in TIMELINE if k in m["timeline"]] and m["timeline"]["done"] == m["seconds"]
    assert "raw broadcast, same group" in proc.stdout and "load=layerwise" in proc.stdout and "wire_start" in proc.stdout
    armed = r["modes"]["layerwise, armed"]
    assert 0 < armed["push_to_serving_s"] < armed["announce_to_serving_s"] < armed["seconds"]
    assert armed["raw_vs_serving"] == pytest.approx(r["raw_s"] / armed["announce_to_serving_s"])
    assert armed["announce_to_serving_s"] == armed["timeline"]["worker_out"]
    assert "load=layerwise, armed" in proc.stdout and "announce -> the last engine serving" in proc.stdout
    # pushed from a snapshot the trainer took before (not in the sync): the wire's bytes, laid out as its buckets
    assert len(r["syncs"]["layerwise, from a snapshot"]) == 2
    # --trace: one more (armed) push under the profiler, as a Chrome trace with the send's broadcasts in it
    assert r["trace"] == str(tmp_path / "push.trace.json")
    events = json.loads((tmp_path / "push.trace.json").read_text())["traceEvents"]
    assert any("broadcast" in str(e.get("name", "")) for e in events), sorted({e.get("name") for e in events})[:40]
    # and the engine worker's receive of that sync, in a file of its own: its broadcasts, its loads
    assert r["engine_traces"] == [str(tmp_path / "push.trace.engine0.w0.json")]
    names = {str(e.get("name", "")) for e in json.loads(Path(r["engine_traces"][0]).read_text())["traceEvents"]}
    assert any("broadcast" in n for n in names) and any("copy_" in n or "load" in n for n in names), sorted(names)[:40]
    assert r["snapshot"]["bytes"] == r["bytes"] and r["snapshot"]["seconds"] > 0
    snap = r["modes"]["layerwise, from a snapshot"]
    assert snap["raw_vs_sync"] == pytest.approx(r["raw_s"] / snap["seconds"])
    assert "load=layerwise, from a snapshot" in proc.stdout and "copy + cast" in proc.stdout
    # --delta: a job with transport.delta=on; its blocks above sent every byte (the weights did not change)
    blocks = ("layerwise", "layerwise, armed", "layerwise, from a snapshot")
    assert all(run["wire_bytes"] == run["bytes"] == r["bytes"] and run["changed_fraction"] is None
               for label in blocks for run in r["syncs"][label])
    # then versions made by real AdamW steps, by turns dense and as a delta against the version before
    dense, delta = r["syncs"]["layerwise, dense after a step"], r["syncs"]["layerwise, delta after a step"]
    assert len(dense) == len(delta) == 2
    assert all(run["wire_bytes"] == run["bytes"] and run["changed_fraction"] is None for run in dense)
    assert all(0 < run["wire_bytes"] < run["bytes"] and 0 < run["changed_fraction"] < 1 for run in delta), delta
    d = r["delta"]
    assert d["delta_speedup"] == pytest.approx(d["dense_s"] / d["delta_s"])
    assert d["wire_share"] == pytest.approx(sum(run["wire_bytes"] / run["bytes"] for run in delta) / 2)  # median of 2
    assert d["delta_serving_speedup"] == pytest.approx(d["dense_serving_s"] / d["delta_serving_s"])
    assert "delta after a step vs dense after a step" in proc.stdout


@pytest.mark.timeout(500)
def test_the_bench_runs_its_blocks_once_per_bucket_layout_and_per_way_of_the_words_side_by_side(tmp_path):
    """--first-buckets 0,32K: the trainer re-plans its buckets between the passes (all full, then ramping
    from 32 KiB to the 256 KiB buckets and back); the engine takes each new layout at its next sync.
    --signals store,socket: each layout's passes once with the words through the groups' stores, then
    over sockets (the transport rebuilt between them); the armed words compared side by side."""
    out = tmp_path / "vs.json"
    cmd = [sys.executable, "-m", "disagg", "bench", "vllm-sync", "--device", "cpu", "--repeats", "1", "--warmup", "1",
           "--no-snapshot", "--first-buckets", "0,32K", "--signals", "store,socket", "--run-dir", str(tmp_path / "run"),
           "--json", str(out), "transport.dtype=bfloat16", "transport.bucket_bytes=262144",
           "rollout.gpu_memory_utilization=0.06"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=460)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    full, ramp = "buckets all full", "buckets ramp from 32 KiB"
    assert set(r["layouts"]) == {full, ramp} and r["layouts"][ramp] > r["layouts"][full] >= 2, r["layouts"]
    for way in ("store", "socket"):
        words = f"words via {way}"
        for layout in (full, ramp):
            for block in ("layerwise", "layerwise, armed"):
                runs = r["syncs"][f"{block}, {layout}, {words}"]
                # every byte of the version went, in that layout's buckets, over groups whose words went that way
                assert len(runs) == 1 and [x["num_buckets"] for x in runs] == [r["layouts"][layout]], runs
                assert runs[0]["bytes"] == r["bytes"] and runs[0]["signals"] == way, runs
                assert r["modes"][f"{block}, {layout}, {words}"]["seconds"] > 0
            # armed (bf16 on the wire: packed, dense): the run-up's step end packed the push's first buckets
            # (EarlyPack), after its set-up and before the announce; the dispatched push packs at its start
            t = r["syncs"][f"layerwise, armed, {layout}, {words}"][0]["timeline"]
            assert t["trainer_header_copied"] <= t["trainer_header"] < t["trainer_early_packed"] < 0, t
            assert "trainer_early_packed" not in r["syncs"][f"layerwise, {layout}, {words}"][0]["timeline"]
            # the driver's word after the announce reached the push and the engine's worker, then their buckets
            assert 0 < t["trainer_in"] < t["trainer_first"] and 0 < t["worker_word"] < t["worker_posted"], t
            w = r["words"][f"layerwise, armed, {layout}"][words]
            assert w["trainer_in"] == r["modes"][f"layerwise, armed, {layout}, {words}"]["timeline"]["trainer_in"]
    assert f"layout: {ramp} ({r['layouts'][ramp]} buckets)" in proc.stdout
    assert "the words, seconds after the announce" in proc.stdout and "words via socket: trainer_in" in proc.stdout
