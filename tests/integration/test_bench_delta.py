"""``disagg bench delta`` on CPU: a tiny shape trains 50 steps at a small learning rate and each
version goes to a receiver process dense and as a delta over one gloo group; after the 50 deltas
the receiver's every parameter equals the trainer's bf16 cast bit for bit (a checksum each)."""

from __future__ import annotations

import json

from disagg.bench.delta import main


def test_bench_delta_reports_each_steps_bytes_and_seconds_both_ways_and_an_exact_receiver_after_50(tmp_path, capsys):
    out = tmp_path / "delta.json"
    # --one-read: every bucket compared first, one host read, each encoded as it goes (not the default)
    assert main(["--steps", "50", "--lr", "1e-5", "--bucket-mb", "1", "--one-read", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["exact"] is True and report["one_read"] is True  # after 50 deltas: the trainer's bf16 cast
    rows = report["steps"]
    assert [r["version"] for r in rows] == list(range(2, 52))
    for r in rows:
        assert r["dense_bytes"] == r["dense_received"] == report["bytes"]
        assert 0 < r["delta_bytes"] == r["delta_received"] < r["dense_bytes"]  # what went is what came
        assert 0 < r["changed_fraction"] < 0.5
        assert r["bytes_ratio"] == r["dense_bytes"] / r["delta_bytes"]
        assert r["dense_s"] > 0 and r["delta_s"] > 0 and r["speedup"] == r["dense_s"] / r["delta_s"]
        assert r["estimate_s"] > 0 and 0 < r["estimate_share"] <= 1  # auto's estimate, from the first bucket
    assert len(report["auto"]["choices"]) == 50
    printed = capsys.readouterr().out
    assert "bit for bit after 50 deltas: yes" in printed and "fewer" in printed
