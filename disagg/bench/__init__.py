"""Benchmarks run as ``disagg bench <name>``: each prints ratios measured in one run.

``transport``: the weight sync against a raw broadcast, one broadcast per
parameter and Ray's object store (``disagg/bench/transport.py``).
``pipeline``: stream vs batch scheduling on a long tail, rewards overlapped with
generation vs after it, asynchronous vs synchronous training (``disagg/bench/pipeline.py``).
``vllm-sync``: a sync into a real vLLM engine phase by phase, against a raw broadcast
over the same group, per ``transport.load`` mode (``disagg/bench/vllm_sync.py``).
``delta``: delta syncs (``transport.delta``) against dense ones step by step, while a model
trains at a learning rate of your choosing (``disagg/bench/delta.py``).
``peers``: one GRPO job in disagg, verl and TRL on the same GPUs, side by side
(``disagg/bench/peers/``).
``digest``: checking a checkpoint against its manifest against reading its bytes
(``disagg/bench/digest.py``).
``soak``: a long ``disagg train`` with a pause/resume and an engine kill, RSS over
time and the fault counts (``disagg/bench/soak.py``; not in CI).
"""

from __future__ import annotations

import sys

BENCHMARKS = {"transport": "weight sync vs raw broadcast, per-parameter broadcast and Ray's object store",
              "pipeline": "stream vs batch on a long tail, reward overlap, async vs sync (CPU or --device cuda)",
              "vllm-sync": "a sync into a real vLLM engine, phase by phase, vs a raw broadcast over the same group",
              "delta": "delta syncs vs dense ones while a model trains: changed fraction, bytes, seconds",
              "peers": "one GRPO job in disagg, verl and TRL on this machine: tokens/s, step time, time to reward 0.9",
              "digest": "checking a checkpoint's digests vs reading its bytes (cold and warm page cache)",
              "soak": "a long `disagg train` with a pause/resume and an engine kill: RSS over time, nothing lost"}


def main(argv: list[str]) -> int:
    """Dispatch ``disagg bench <name> [flags]``."""
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHMARKS:
        lines = "\n".join(f"  {name:<12} {what}" for name, what in BENCHMARKS.items())
        print(f"usage: disagg bench <name> [flags]   (disagg bench <name> --help)\n\nbenchmarks:\n{lines}",
              file=sys.stdout if argv and argv[0] in ("-h", "--help") else sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    if argv[0] == "soak":
        from disagg.bench.soak import main as soak_main

        return soak_main(argv[1:])
    if argv[0] == "digest":
        from disagg.bench.digest import main as digest_main

        return digest_main(argv[1:])
    if argv[0] == "peers":
        from disagg.bench.peers.bench import main as peers_main

        return peers_main(argv[1:])
    if argv[0] == "delta":
        from disagg.bench.delta import main as delta_main

        return delta_main(argv[1:])
    if argv[0] == "vllm-sync":
        from disagg.bench.vllm_sync import main as vllm_sync_main

        return vllm_sync_main(argv[1:])
    if argv[0] == "pipeline":
        from disagg.bench.pipeline import main as pipeline_main

        return pipeline_main(argv[1:])
    from disagg.bench.transport import main as transport_main

    return transport_main(argv[1:])
