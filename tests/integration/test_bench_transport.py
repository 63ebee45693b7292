"""``disagg bench transport`` on CPU: real Ray actors, real gloo groups, the tiny shape.

The benchmark runs in this process (on the session's Ray cluster) and its JSON
report is checked: every key scripts rely on, positive rates, ratios that are
the ratios of the reported rates, the byte count of the shape (tied embedding
counted once), and receivers that ended bit-identical to the trainer.
"""

from __future__ import annotations

import json

import pytest

from disagg.bench.shapes import num_parameters
from disagg.bench.transport import RATIOS, main, object_store_subset, summarise

REQUIRED_KEYS = (
    "raw_gb_per_s", "send_gb_per_s", "send_load_gb_per_s", "per_param_gb_per_s", "object_store_gb_per_s",
    "send_vs_raw", "send_load_vs_raw", "send_vs_per_param", "send_vs_object_store",
    "shape", "bytes", "ranks", "receivers", "device", "backend", "source", "peak_extra_bytes_rank0",
)


def test_object_store_subset_takes_what_fits_in_order():
    sizes = [("a", 4), ("b", 8), ("c", 2), ("d", 1)]
    assert object_store_subset(sizes, 100) == ["a", "b", "c", "d"]
    assert object_store_subset(sizes, 7) == ["a", "c", "d"]
    assert object_store_subset(sizes, 0) == []


def test_summarise_rates_and_ratios():
    out = summarise({"raw": 1.0, "send": 2.0, "send_load": 4.0, "per_param": 8.0}, total_bytes=4_000_000_000,
                    object_store_bytes=1_000_000_000)
    assert out["raw_gb_per_s"] == 4.0 and out["send_gb_per_s"] == 2.0 and out["per_param_gb_per_s"] == 0.5
    assert out["send_vs_raw"] == 0.5 and out["send_load_vs_raw"] == 0.25 and out["send_vs_per_param"] == 4.0
    assert out["object_store_gb_per_s"] is None and out["send_vs_object_store"] is None


def _run(tmp_path, *flags: str) -> dict:
    path = tmp_path / "report.json"
    rc = main(["--shape", "tiny", "--device", "cpu", "--repeats", "2", "--check", "--timeout-s", "60",
               "--json", str(path), *flags])
    report = json.loads(path.read_text())
    assert rc == 0, report["check"]
    return report


def _assert_report(report: dict, ranks: int, receivers: int, source: str, skipped: tuple[str, ...] = ()) -> None:
    for key in REQUIRED_KEYS:
        assert key in report, key
    assert (report["shape"], report["ranks"], report["receivers"], report["source"]) == ("tiny", ranks, receivers,
                                                                                         source)
    assert (report["device"], report["backend"]) == ("cpu", "gloo")
    assert report["bytes"] == 2 * num_parameters("tiny")  # bf16, tied lm_head sent once
    assert report["object_store_bytes"] == report["bytes"]  # the tiny shape is under the cap
    for kind in ("raw", "send", "send_load", "per_param", "object_store"):
        if kind in skipped:
            assert report[f"{kind}_gb_per_s"] is None, kind
        else:
            assert report[f"{kind}_gb_per_s"] > 0, kind
    for key, (num, den) in RATIOS.items():
        if den in skipped:
            assert report[key] is None, key
        else:
            assert report[key] == pytest.approx(report[f"{num}_gb_per_s"] / report[f"{den}_gb_per_s"]), key
    assert report["check"]["passed"], report["check"]["problems"]
    assert report["check"]["num_tensors"] == report["num_tensors"] > 0
    assert report["peak_extra_bytes_rank0"] is None  # CUDA only


def test_bench_one_trainer_two_receivers(ray_session, tmp_path):
    report = _run(tmp_path, "--receivers", "2")
    _assert_report(report, ranks=1, receivers=2, source="gather")


@pytest.mark.parametrize("source", ["gather", "shards"])
def test_bench_two_fsdp_ranks(ray_session, tmp_path, source):
    report = _run(tmp_path, "--trainer-ranks", "2", "--receivers", "2", "--source", source, "--skip", "d")
    _assert_report(report, ranks=2, receivers=2, source=source, skipped=("per_param",))
