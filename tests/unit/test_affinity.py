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


def test_freeze_heap_takes_the_live_heap_out_of_full_collections():
    """A full collection walks every tracked object; after freeze_heap the ones alive then are
    skipped (they stalled an engine's actor for 0.48 s a few times a minute)."""
    import gc

    from disagg.cluster import freeze_heap

    class Node:
        pass

    kept = [Node() for _ in range(1000)]
    garbage = Node()
    garbage.self = garbage  # a cycle only a collection frees
    del garbage
    try:
        freeze_heap("test")
        assert gc.get_freeze_count() >= len(kept)
        full = {id(o) for o in gc.get_objects(generation=2)}
        assert not any(id(k) in full for k in kept)  # frozen, not scanned
        cycles = [o for o in gc.get_objects() if isinstance(o, Node) and getattr(o, "self", None) is o]
        assert not cycles  # the garbage was collected before the freeze
    finally:
        gc.unfreeze()
