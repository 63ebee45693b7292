"""``disagg bench digest``: how long checking a checkpoint against its manifest takes, against
reading its bytes and nothing else (the floor: the disk, or the page cache), in one run.

Resume checks the newest checkpoint before anything starts (``disagg.digests``), so the check must
run at the speed of the read itself. This writes a checkpoint-shaped directory (model shards and one
large optimizer file, as a trainer writes them; or takes ``--dir``, a real one), then times, on the
same files: a plain read with the digest's reads and threads, the digest (``digest_files``), and
SHA-256 on one thread (what ``hashlib`` alone would give). ``cold`` rounds drop the files from the
page cache first (``posix_fadvise``; a file system that ignores it reads warm), ``warm`` rounds read
them straight after. It prints GB/s, the digest's share of a plain read's rate, and what a 7B
checkpoint would take at each rate.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from disagg import digests

SEVEN_B_BYTES = 7.6e9 * 4 * 3
"""A 7B trainer checkpoint: fp32 weights and Adam's two fp32 moments (Qwen2.5-7B, 7.6e9 parameters)."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="disagg bench digest", description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=None, help="a checkpoint directory to read (default: write one in --where)")
    p.add_argument("--where", default=tempfile.gettempdir(), help="where the written one goes (its disk is measured)")
    p.add_argument("--size-gb", type=float, default=2.0, help="size of the written checkpoint (default 2)")
    p.add_argument("--threads", type=int, default=None, help="digest threads (default: this process's CPUs, <= 16)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of each measurement; the best is kept (default 2)")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    return p


def _write(root: Path, total_bytes: int) -> list[str]:
    """Four model shards holding a third of the bytes and one optimizer file with the rest."""
    root.mkdir(parents=True, exist_ok=True)
    sizes = {f"model-0000{i + 1}-of-00004.safetensors": total_bytes // 12 for i in range(4)}
    sizes["optimizer.pt"] = total_bytes - sum(sizes.values())
    block = os.urandom(64 << 20)
    for name, size in sizes.items():
        with open(root / name, "wb") as f:
            left = size
            while left > 0:
                left -= f.write(block[:min(len(block), left)])
            f.flush()
            os.fsync(f.fileno())
    return sorted(sizes)


def _evict(root: Path, names: list[str]) -> None:
    for n in names:
        fd = os.open(root / n, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _read_only(root: Path, names: list[str], threads: int) -> None:
    """The digest's reads (its chunks on its threads), without the hash."""
    jobs = digests.chunk_plan(root, names)

    def read(job) -> None:
        name, start, length = job
        buf = memoryview(bytearray(digests.READ_BYTES))
        with open(root / name, "rb", buffering=0) as f:
            f.seek(start)
            while length > 0:
                n = f.readinto(buf[:min(len(buf), length)])
                if not n:
                    break
                length -= n

    with ThreadPoolExecutor(max_workers=threads) as pool:
        list(pool.map(read, jobs))


def _sha256(root: Path, names: list[str]) -> None:
    for n in names:
        h = hashlib.sha256()
        with open(root / n, "rb") as f:
            while chunk := f.read(digests.READ_BYTES):
                h.update(chunk)


def run(opts) -> dict:
    tmp = None
    if opts.dir:
        root = Path(opts.dir)
        names = digests.files_under(root)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="disagg-bench-digest-", dir=opts.where)
        root = Path(tmp.name)
        print(f"writing a {opts.size_gb:g} GB checkpoint-shaped directory in {root} ...", flush=True)
        names = _write(root, int(opts.size_gb * 1e9))
    total = sum((root / n).stat().st_size for n in names)
    threads = opts.threads or digests.default_threads()
    ways = {"read": lambda: _read_only(root, names, threads),
            "digest": lambda: digests.digest_files(root, names, threads),
            "sha256": lambda: _sha256(root, names)}
    rows: dict[str, dict[str, float]] = {}
    try:
        for cache in ("cold", "warm"):
            for way, call in ways.items():
                best = float("inf")
                for _ in range(max(1, opts.rounds)):
                    if cache == "cold":
                        _evict(root, names)
                    else:
                        _read_only(root, names, threads)
                    t0 = time.perf_counter()
                    call()
                    best = min(best, time.perf_counter() - t0)
                rows[f"{way} ({cache})"] = {"seconds": best, "gb_per_s": total / best / 1e9}
    finally:
        if tmp is not None:
            tmp.cleanup()
    return {"bytes": total, "files": len(names), "threads": threads, "rows": rows}


def render(result: dict) -> str:
    lines = [f"{result['files']} files, {result['bytes'] / 1e9:.2f} GB, {result['threads']} threads",
             f"{'':<16}{'s':>8}{'GB/s':>8}{'of read':>9}{'7B ckpt s':>11}"]
    for cache in ("cold", "warm"):
        floor = result["rows"][f"read ({cache})"]["gb_per_s"]
        for way in ("read", "digest", "sha256"):
            r = result["rows"][f"{way} ({cache})"]
            lines.append(f"{way + ' (' + cache + ')':<16}{r['seconds']:>8.2f}{r['gb_per_s']:>8.2f}"
                         f"{r['gb_per_s'] / floor:>9.2f}{SEVEN_B_BYTES / 1e9 / r['gb_per_s']:>11.1f}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    opts = _parser().parse_args(argv)
    if opts.size_gb <= 0:
        print(f"disagg bench digest: --size-gb={opts.size_gb}: must be > 0", file=sys.stderr)
        return 2
    result = run(opts)
    print(render(result))
    if opts.json:
        Path(opts.json).write_text(json.dumps(result, indent=2))
    return 0
