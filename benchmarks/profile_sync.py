"""Where a weight sync's time goes, rank by rank: a profiling aid for `disagg bench transport`.

Runs 1 sender and N receivers as plain processes (no Ray) on one NCCL or gloo
group and, after a barrier, times on every rank:

  raw        one broadcast of the manifest's bytes
  raw_split  one broadcast per bucket of the manifest, same sizes, no disagg code
  send       disagg's send_model / receive_model (receivers discard)

then profiles one `send` iteration with torch.profiler and prints, per rank, the
NCCL kernels (start and length, relative to the iteration's start) next to the
host times at which each broadcast was launched and waited for.

    python benchmarks/profile_sync.py --shape qwen2-1.5b --receivers 3 --bucket-mb 1024
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def worker(rank: int, args, port: int, out_dir: str) -> None:
    from disagg.bench.workers import build_model, flat_bytes
    from disagg.transport import group as G
    from disagg.transport.buckets import flatten_parameters
    from disagg.transport.model_transfer import model_manifest, receive_model, send_model
    from disagg.transport.sender import WeightSender

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    model = build_model(args.shape, torch.bfloat16, device, seed=1 + rank)
    if rank == 0:
        flatten_parameters(model)
    manifest = model_manifest(model, args.bucket_mb << 20, policy_version=1)
    group = G.create_group(host="127.0.0.1", port=port, rank=rank, world_size=1 + args.receivers,
                           backend="nccl" if cuda else "gloo", timeout_s=120, group_name="prof", device=device)
    flat = torch.empty(manifest.total_bytes, dtype=torch.uint8, device=device)
    sender = WeightSender(group, 0, args.num_buffers) if rank == 0 else None
    log: list[tuple[str, float]] = []

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    def raw():
        group.broadcast(flat, 0)

    def raw_split():
        ops, off = [], 0
        for plan in manifest.buckets:
            ops.append(group.broadcast_async(flat[off: off + plan.nbytes], 0))
            off += plan.nbytes
        for op in ops:
            op.wait()

    from disagg.transport.buckets import bucket_buffers, contiguous_bucket
    params = dict(model.named_parameters())
    slots = [bucket_buffers(manifest, device) for _ in range(2)]

    def model_split():  # the buckets straight from the model (rank 0) / into receive slots, no disagg loop
        ops = []
        for i, plan in enumerate(manifest.buckets):
            buf = contiguous_bucket(plan, params) if rank == 0 else slots[i % 2][plan.dtype][: plan.numel]
            ops.append(group.broadcast_async(buf, 0))
        for op in ops:
            op.wait()

    def model_split_waits():  # the same, each launch after a stream wait on the op two back (as send does)
        ops = []
        for i, plan in enumerate(manifest.buckets):
            if i >= 2:
                ops[i - 2].wait(host=False)
            buf = contiguous_bucket(plan, params) if rank == 0 else slots[i % 2][plan.dtype][: plan.numel]
            ops.append(group.broadcast_async(buf, 0))
        for op in ops:
            op.wait()

    def send():
        with torch.no_grad():
            if rank == 0:
                send_model(group, model, manifest, source="gather", trainer_rank=0, num_trainer_ranks=1,
                           num_buffers=args.num_buffers, sender=sender, params=params)
            else:
                receive_model([group], manifest, lambda items: None, device=device, source="gather",
                              num_buffers=args.num_buffers)

    results = {}
    for name, fn in (("raw", raw), ("raw_split", raw_split), ("model_split", model_split), ("model_split_waits", model_split_waits), ("send", send)):
        xs = []
        for i in range(args.warmup + args.iters):
            group.barrier()
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            if i >= args.warmup:
                xs.append(time.perf_counter() - t0)
        results[name] = xs

    # One profiled `send`, with host timestamps of every launch and host wait.
    start_async, op_wait = G.TransportGroup.broadcast_async, G.PendingOp.wait

    def traced_start(self, tensor, src, **kw):
        log.append((f"launch {tensor.numel() * tensor.element_size() / 2**20:.0f}MiB", time.perf_counter()))
        return start_async(self, tensor, src, **kw)

    def traced_wait(self, host=True):
        op_wait(self, host)
        log.append((f"waited host={host}", time.perf_counter()))

    G.TransportGroup.broadcast_async, G.PendingOp.wait = traced_start, traced_wait
    kernels = []
    group.barrier()
    sync()
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        group.barrier()
        sync()
        t0 = time.perf_counter()
        with torch.profiler.record_function("disagg_sync_start"):
            pass
        send()
        sync()
        t_end = time.perf_counter()
    G.TransportGroup.broadcast_async, G.PendingOp.wait = start_async, op_wait
    events = prof.events()
    mark = [e for e in events if e.name == "disagg_sync_start"]
    base = mark[0].time_range.start if mark else 0
    for e in events:
        if getattr(e, "device_type", None) is not None and "nccl" in e.name.lower() and str(e.device_type).endswith("CUDA"):
            kernels.append((e.name[:40], (e.time_range.start - base) / 1e3, e.time_range.elapsed_us() / 1e3))
    kernels.sort(key=lambda k: k[1])
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "results": results, "host": [(n, (t - t0) * 1e3) for n, t in log],
                   "total_ms": (t_end - t0) * 1e3, "kernels": kernels,
                   "buckets": [p.nbytes for p in manifest.buckets], "tensors": len(manifest.tensors),
                   "bytes": manifest.total_bytes}, f)
    group.barrier()
    group.destroy()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen2-0.5b")
    p.add_argument("--receivers", type=int, default=1)
    p.add_argument("--bucket-mb", type=int, default=1024)
    p.add_argument("--num-buffers", type=int, default=2)
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    args = p.parse_args()
    out_dir = os.path.join(args.out, f"prof_{args.shape}_{args.receivers}_{args.bucket_mb}")
    os.makedirs(out_dir, exist_ok=True)
    from disagg.transport.group import pick_free_port
    port = pick_free_port("127.0.0.1")
    mp.spawn(worker, args=(args, port, out_dir), nprocs=1 + args.receivers, join=True)
    ranks = [json.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in range(1 + args.receivers)]
    nbytes = ranks[0]["bytes"]
    print(f"== {args.shape}: {nbytes / 1e9:.2f} GB, {ranks[0]['tensors']} tensors, buckets(MiB)="
          f"{[round(b / 2**20) for b in ranks[0]['buckets']]}, 1 -> {args.receivers}")
    for name in ranks[0]["results"]:
        per_rank = [statistics.median(r["results"][name]) for r in ranks]
        slow = max(per_rank)
        print(f"{name:17s} slowest-rank median {slow * 1e3:8.3f} ms  {nbytes / slow / 1e9:7.1f} GB/s  "
              f"per rank ms {[round(x * 1e3, 3) for x in per_rank]}")
    for r in ranks[: min(len(ranks), 3)]:
        print(f"-- rank {r['rank']} profiled send: {r['total_ms']:.3f} ms")
        print("   host:", ", ".join(f"{n}@{t:.3f}" for n, t in r["host"]))
        print("   kernels:", ", ".join(f"{n.split('(')[0][-22:]}@{s:.3f}+{d:.3f}" for n, s, d in r["kernels"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
