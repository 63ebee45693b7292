"""``disagg bench delta``: delta syncs (``transport.delta=on``) against dense ones, step by step, in one run.

A trainer process trains a Qwen2 shape (random weights, float32 master weights, AdamW at
``--lr`` on random token batches) and after each step sends the new version to a receiver
process twice over one transport group: dense (``WeightSender.send``) and as the changes since
the version before (``WeightSender.send_delta``), in alternating order so that neither always
goes first. Per step it reports the share of elements that changed in the wire dtype, the bytes
and seconds of each (a sync's seconds: the receiver's, from a barrier to its load done), and the
ratios; at the end, whether the receiver's weights equal the trainer's cast to the wire dtype bit
for bit after all those deltas.

gloo over loopback on CPU; NCCL between two GPUs with ``--device cuda`` (set
``NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1`` to stand in for two nodes). This module never imports
vLLM, Ray or grpc.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

HOST = "127.0.0.1"


@dataclass(frozen=True)
class DeltaOptions:
    shape: str = "tiny"  # a name from disagg.bench.shapes.SHAPES
    steps: int = 10
    lr: float = 1e-6
    device: str = "auto"  # cpu (gloo) | cuda (NCCL, GPUs 0 and 1) | auto
    wire_dtype: str = "bfloat16"
    bucket_mb: int = 64
    batch: int = 2
    seq_len: int = 64
    timeout_s: float = 600.0
    seed: int = 0
    nccl_socket: bool = False  # NCCL over its socket transport (no NVLink, no shared memory): two nodes' stand-in
    one_read: bool = False  # the sender's delta encoding (WeightSender.one_read; its default: off)


def _trainer(o: DeltaOptions, port: int, device: str, out) -> None:
    import torch

    from disagg.bench.workers import build_model
    from disagg.transport.buckets import bucket_checksum, pack_bucket, torch_dtype
    from disagg.transport.delta import DeltaImage, estimate
    from disagg.transport.group import create_group
    from disagg.transport.sender import WeightSender, build_manifest

    dev = torch.device(device)
    model = build_model(o.shape, torch.float32, dev, o.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr)
    params = dict(model.named_parameters())
    manifest = build_manifest(params.items(), o.bucket_mb << 20, 0, o.wire_dtype)
    group = create_group(host=HOST, port=port, rank=0, world_size=2, backend="nccl" if dev.type == "cuda" else "gloo",
                         timeout_s=o.timeout_s, group_name="bench-delta", device=dev)
    sender, image, steps = WeightSender(group, device=dev, one_read=o.one_read), DeltaImage(dev), []
    numel = sum(p.numel for p in manifest.buckets)
    gen = torch.Generator(device=dev).manual_seed(o.seed + 1)
    vocab = model.config.vocab_size
    sender.send_delta(manifest.with_version(1), image, params)  # version 1: dense, fills both images
    for v in range(2, o.steps + 2):
        t0 = time.perf_counter()
        tokens = torch.randint(0, vocab, (o.batch, o.seq_len), generator=gen, device=dev)
        model(input_ids=tokens, labels=tokens).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        train_s = time.perf_counter() - t0
        m, row = manifest.with_version(v), {"version": v, "train_s": train_s}
        with torch.no_grad():  # what auto's estimate would say: the first bucket encoded against the image (v - 1)
            first = pack_bucket(manifest.buckets[0], params)
            row["estimate_s"], row["estimate_share"] = estimate(first, image.buckets(m)[0], numel, sender.one_read)
        for kind in (("delta", "dense") if v % 2 else ("dense", "delta")):
            group.barrier()
            s = sender.send_delta(m, image, params) if kind == "delta" else sender.send(m, params)
            row[f"{kind}_bytes"], row[f"{kind}_send_s"] = s.bytes, s.seconds
            if kind == "delta":
                row["changed_fraction"] = s.changed_fraction
        steps.append(row)
    wire = torch_dtype(o.wire_dtype)
    sums = {n: bucket_checksum(p.detach().to(wire).reshape(-1)).tolist() for n, p in params.items()}
    group.barrier()
    group.destroy()
    out.put(("trainer", {"steps": steps, "checksums": sums, "bytes": manifest.total_bytes,
                         "num_buckets": len(manifest.buckets), "one_read": sender.one_read}))


def _receiver(o: DeltaOptions, port: int, device: str, out) -> None:
    import torch

    from disagg.bench.workers import build_model
    from disagg.transport.buckets import bucket_checksum, torch_dtype
    from disagg.transport.delta import DeltaImage
    from disagg.transport.group import create_group
    from disagg.transport.receiver import TorchModelReceiver, receive_delta, receive_weights
    from disagg.transport.sender import build_manifest

    dev = torch.device(device)
    model = build_model(o.shape, torch_dtype(o.wire_dtype), dev, o.seed + 7)  # other values until the first sync
    params = dict(model.named_parameters())
    manifest = build_manifest(params.items(), o.bucket_mb << 20, 0, o.wire_dtype)
    load = TorchModelReceiver.load_into_module(model)
    group = create_group(host=HOST, port=port, rank=1, world_size=2, backend="nccl" if dev.type == "cuda" else "gloo",
                         timeout_s=o.timeout_s, group_name="bench-delta", device=dev)
    image, times = DeltaImage(dev), []
    receive_delta(group, manifest.with_version(1), load, image, dev)
    for v in range(2, o.steps + 2):
        row = {}
        for kind in (("delta", "dense") if v % 2 else ("dense", "delta")):
            group.barrier()
            t0 = time.perf_counter()
            m = manifest.with_version(v)
            st = receive_delta(group, m, load, image, dev) if kind == "delta" else receive_weights(group, m, load, dev)
            row[f"{kind}_s"], row[f"{kind}_received"] = time.perf_counter() - t0, st.bytes
        times.append(row)
    sums = {n: bucket_checksum(p.detach().reshape(-1)).tolist() for n, p in params.items()}
    group.barrier()
    group.destroy()
    out.put(("receiver", {"times": times, "checksums": sums}))


def _child(role: str, o: DeltaOptions, port: int, device: str, out) -> None:
    import os

    if o.nccl_socket:
        os.environ.update(NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1")
    try:
        (_trainer if role == "trainer" else _receiver)(o, port, device, out)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        out.put((role, {"error": f"{type(e).__name__}: {e}"}))
        raise


def run(o: DeltaOptions) -> dict[str, Any]:
    """Both processes, their reports joined: per step and the medians of the ratios."""
    import multiprocessing as mp
    import queue

    from disagg.bench.common import bench_device, machine, visible_gpus
    from disagg.bench.shapes import qwen2_config
    from disagg.transport.group import pick_free_port

    qwen2_config(o.shape)  # a ValueError naming the shapes for an unknown one
    if o.steps < 1 or o.lr <= 0 or o.bucket_mb < 1:
        raise ValueError(f"--steps, --lr and --bucket-mb must be positive (got {o.steps}, {o.lr}, {o.bucket_mb})")
    device = bench_device(o.device, visible_gpus())
    if device == "cuda" and visible_gpus() < 2:
        raise ValueError("--device cuda needs two GPUs (one per process: NCCL)")
    ctx, port = mp.get_context("spawn"), pick_free_port(HOST)
    out = ctx.Queue()
    devices = ("cuda:0", "cuda:1") if device == "cuda" else ("cpu", "cpu")
    procs = [ctx.Process(target=_child, args=(role, o, port, d, out), daemon=True)
             for role, d in zip(("trainer", "receiver"), devices)]
    for p in procs:
        p.start()
    reports: dict[str, dict] = {}
    deadline = time.monotonic() + o.timeout_s + 60 * o.steps
    try:
        while len(reports) < 2:
            try:
                role, rep = out.get(timeout=max(1.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"bench delta: no report from {sorted({'trainer', 'receiver'} - set(reports))} "
                                   f"in time") from None
            if "error" in rep:
                raise RuntimeError(f"bench delta: the {role} failed: {rep['error']}")
            reports[role] = rep
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    rows = [{**a, **b} for a, b in zip(reports["trainer"]["steps"], reports["receiver"]["times"])]
    for r in rows:
        r["bytes_ratio"] = r["dense_bytes"] / max(1, r["delta_bytes"])
        r["speedup"] = r["dense_s"] / r["delta_s"] if r["delta_s"] > 0 else None
    return {"options": asdict(o), "machine": machine(device), "device": device, "bytes": reports["trainer"]["bytes"],
            "num_buckets": reports["trainer"]["num_buckets"], "one_read": reports["trainer"]["one_read"],
            "steps": rows, "auto": replay_auto(rows),
            "median_changed_fraction": statistics.median(r["changed_fraction"] for r in rows),
            "median_bytes_ratio": statistics.median(r["bytes_ratio"] for r in rows),
            "median_speedup": statistics.median(r["speedup"] for r in rows if r["speedup"] is not None),
            "exact": reports["trainer"]["checksums"] == reports["receiver"]["checksums"],
            "unix_s": time.time()}


def replay_auto(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """``transport.delta=auto`` on these versions: its chooser fed each version's measured send
    seconds and bytes and, where it asks for one, the version's encoding estimate (what the trainer
    feeds it), the sync times of what it chose summed against all-dense and all-delta. Its first
    dense stands for a run's first sync (which is dense anyway)."""
    from disagg.transport.delta import DeltaChooser

    chooser, kinds, auto_s = DeltaChooser(), [], 0.0
    for r in rows:
        delta = chooser.delta_next()
        kinds.append("delta" if delta else "dense")
        guess = (r["estimate_s"], r["estimate_share"]) if chooser.estimating and "estimate_s" in r else None
        chooser.record(delta, r["delta_send_s"] if delta else r["dense_send_s"],
                       r["delta_bytes"] / r["dense_bytes"] if delta else 1.0, estimate=guess)
        auto_s += r["delta_s"] if delta else r["dense_s"]
    dense_s, delta_s = sum(r["dense_s"] for r in rows), sum(r["delta_s"] for r in rows)
    return {"choices": kinds, "seconds": auto_s, "dense_seconds": dense_s, "delta_seconds": delta_s,
            "dense_vs_auto": dense_s / auto_s if auto_s > 0 else None}


def render(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    o = report["options"]
    link = (", NCCL over sockets" if o["nccl_socket"] else "") + (
        ", deltas compared in one pass" if report.get("one_read") else ", deltas compared bucket by bucket")
    t = Table(title=f"disagg bench delta: {o['shape']} ({report['bytes'] / 1e6:.1f} MB in {o['wire_dtype']}), "
                    f"AdamW lr {o['lr']:g}, {report['machine']}{link}")
    for col in ("version", "changed", "dense MB", "delta MB", "bytes ratio", "dense s", "delta s", "speedup"):
        t.add_column(col, justify="right")
    for r in report["steps"]:
        t.add_row(str(r["version"]), f"{r['changed_fraction']:.4f}", f"{r['dense_bytes'] / 1e6:.2f}",
                  f"{r['delta_bytes'] / 1e6:.3f}", f"{r['bytes_ratio']:.1f}x", f"{r['dense_s']:.4f}",
                  f"{r['delta_s']:.4f}", f"{r['speedup']:.2f}x" if r["speedup"] else "-")
    console = Console()
    console.print(t)
    console.print(f"median: changed {report['median_changed_fraction']:.4f}, bytes {report['median_bytes_ratio']:.1f}x "
                  f"fewer, sync {report['median_speedup']:.2f}x faster; receiver equals the trainer's "
                  f"{o['wire_dtype']} cast bit for bit after {len(report['steps'])} deltas: "
                  f"{'yes' if report['exact'] else 'NO'}")
    a = report["auto"]
    runs = [f"{k} x{len(list(g))}" for k, g in itertools.groupby(a["choices"])]
    console.print(f"auto (its chooser replayed on these times): {', '.join(runs)}: {a['seconds']:.3f} s against "
                  f"{a['dense_seconds']:.3f} s all dense "
                  f"({a['dense_vs_auto']:.2f}x) and {a['delta_seconds']:.3f} s all delta")


def parse_args(argv: list[str]) -> tuple[DeltaOptions, str | None]:
    d = DeltaOptions()
    p = argparse.ArgumentParser(prog="disagg bench delta", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default=d.shape, help=f"a model shape (default {d.shape})")
    p.add_argument("--steps", type=int, default=d.steps, help=f"train steps, each synced both ways (default {d.steps})")
    p.add_argument("--lr", type=float, default=d.lr, help=f"AdamW learning rate (default {d.lr:g})")
    p.add_argument("--device", default=d.device, help="cpu (gloo over loopback), cuda (NCCL, 2 GPUs) or auto")
    p.add_argument("--wire-dtype", default=d.wire_dtype, help=f"dtype on the wire (default {d.wire_dtype})")
    p.add_argument("--bucket-mb", type=int, default=d.bucket_mb, help=f"bucket size in MiB (default {d.bucket_mb})")
    p.add_argument("--batch", type=int, default=d.batch, help="sequences per train step")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per sequence")
    p.add_argument("--timeout", type=float, default=d.timeout_s, help="seconds for the group and each collective")
    p.add_argument("--nccl-socket", action="store_true",
                   help="NCCL over its socket transport (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1): two nodes' stand-in")
    p.add_argument("--one-read", action=argparse.BooleanOptionalAction, default=d.one_read,
                   help="compare every bucket first with one host read, or one bucket at a time (--no-one-read, "
                        "the sender's default)")
    p.add_argument("--json", default=None, help="write the report here")
    a = p.parse_args(argv)
    return DeltaOptions(a.shape, a.steps, a.lr, a.device, a.wire_dtype, a.bucket_mb, a.batch, a.seq_len,
                        a.timeout, nccl_socket=a.nccl_socket, one_read=a.one_read), a.json


def main(argv: list[str]) -> int:
    opts, json_path = parse_args(argv)
    try:
        report = run(opts)
    except ValueError as e:
        print(f"disagg bench delta: {e}", file=sys.stderr)
        return 2
    render(report)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if report["exact"] else 1
