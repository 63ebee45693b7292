"""Pool CPU pinning: every thread of the process moves, later threads inherit, bad cores name the key."""

import os
import subprocess
import sys
import textwrap

import pytest

from disagg.config import load_config
from disagg.errors import ConfigError


def test_pin_process_moves_existing_and_later_threads():
    cores = sorted(os.sched_getaffinity(0))
    target = cores[-1]
    # A fresh process: pinning changes the caller's affinity for good.
    code = textwrap.dedent(f"""
        import os, threading, time
        from disagg.cluster import pin_process
        stop = threading.Event()
        before = [threading.Thread(target=stop.wait) for _ in range(3)]
        for t in before: t.start()
        pin_process(({target},), "test")
        after = threading.Thread(target=stop.wait); after.start()
        tids = [int(t) for t in os.listdir("/proc/self/task")]
        print(len(tids), sorted({{c for tid in tids for c in os.sched_getaffinity(tid)}}))
        stop.set()
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    n_threads, seen = out.stdout.split(" ", 1)
    assert int(n_threads) >= 5  # main + 3 before + 1 after
    assert seen.strip() == str([target])


def test_cpu_affinity_out_of_range_names_key_and_value():
    n = os.cpu_count()
    with pytest.raises(ConfigError, match=rf"rollout.cpu_affinity=\[{n}\].*this machine has {n}"):
        load_config({"rollout": {"cpu_affinity": [n]}})
    with pytest.raises(ConfigError, match=r"trainer.cpu_affinity=\[\]"):
        load_config({"trainer": {"cpu_affinity": []}})
    cfg = load_config({"rollout": {"cpu_affinity": [0]}, "trainer": {"cpu_affinity": [0]}})
    assert cfg.rollout.cpu_affinity == (0,) and cfg.trainer.cpu_affinity == (0,)
