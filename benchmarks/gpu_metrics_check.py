"""Scrape a running job's Prometheus endpoints and print what they say (issue 22 on the GPU machines).

    python3 benchmarks/gpu_metrics_check.py RUN_DIR OUT_JSON

Waits for the job in RUN_DIR to run two more steps, scraping the coordinator's ``/metrics`` and
each engine's vLLM ``/metrics`` (the addresses ``disagg ctl status`` shows) before and after;
parses both with prometheus-client's parser, checks that the figures agree with the coordinator's
status and move with the run, and writes the scrapes' key values to OUT_JSON. Exit 1 on a mismatch.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(url, timeout=30) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), float("nan"))


def main() -> int:
    from disagg.control.auth import read_token
    from disagg.control.client import CoordinatorClient

    run_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    deadline = time.time() + 400
    while not ((run_dir / "coordinator.addr").exists() and (run_dir / "control.token").exists()):
        if time.time() > deadline:
            raise SystemExit(f"no coordinator in {run_dir} after 400 s")
        time.sleep(2)
    client = CoordinatorClient((run_dir / "coordinator.addr").read_text().strip(), timeout_s=10,
                               token=read_token(run_dir / "control.token"))
    status = client.status()
    while status.trainer_version < 3:  # the job runs steps (engines up, first syncs done)
        if time.time() > deadline:
            raise SystemExit(f"the job did not reach version 3 in 400 s (phase {status.phase})")
        time.sleep(2)
        status = client.status()
    url = status.metrics_url
    first = scrape(url)
    v0 = value(first, "disagg_trainer_policy_version")
    while client.status().trainer_version < v0 + 2:
        if time.time() > deadline:
            raise SystemExit("the job made no two more steps")
        time.sleep(1)
    status = client.status()
    second = scrape(url)
    engines = {e.engine_id: e.vllm_metrics_url for e in status.engines}
    vllm = {eid: scrape(u) for eid, u in engines.items() if u}
    report = {
        "metrics_url": url,
        "trainer_version": [v0, value(second, "disagg_trainer_policy_version")],
        "status_trainer_version": status.trainer_version,
        "weight_sync_seconds_count": [value(first, "disagg_weight_sync_seconds_count"),
                                      value(second, "disagg_weight_sync_seconds_count")],
        "weight_sync_seconds_sum": value(second, "disagg_weight_sync_seconds_sum"),
        "max_staleness": value(second, "disagg_max_staleness"),
        "dummy_served_groups_total": value(second, "disagg_dummy_served_groups_total"),
        "prompts_lost": value(second, "disagg_prompts_lost"),
        "engine_tokens_per_second": {eid: value(second, "disagg_engine_tokens_per_second", engine_id=str(eid))
                                     for eid in engines},
        "vllm_metrics_urls": engines,
        "vllm_generation_tokens_total": {eid: sum(v for (n, _), v in s.items() if n == "vllm:generation_tokens_total")
                                         for eid, s in vllm.items()},
        "vllm_series": {eid: len({n for n, _ in s}) for eid, s in vllm.items()},
    }
    out.write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps(report, indent=1, default=str))
    ok = (report["trainer_version"][1] >= v0 + 2 and report["weight_sync_seconds_count"][1] > report[
        "weight_sync_seconds_count"][0] and report["dummy_served_groups_total"] == 0 and report["prompts_lost"] == 0
        and all(v > 0 for v in report["vllm_generation_tokens_total"].values()) and bool(vllm))
    print("metrics check:", "ok" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
