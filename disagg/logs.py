"""Logging with the role and rank in every line (``[rollout:2]``), and waits that talk.

Silent hangs are the most common complaint against RL frameworks, so every long
wait goes through ``wait_logged`` / ``await_logged``: a deadline, and a progress
line every few seconds saying what is awaited.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import sys
import time
from typing import Any, Awaitable, Callable, TypeVar

T = TypeVar("T")

_FMT = "%(asctime)s %(levelname)s [%(role)s] %(name)s: %(message)s"
# Libraries that log a line per request at INFO (the agent runners' OpenAI client logs every
# completion through httpx): on the console only their warnings, unless the level is DEBUG.
PER_REQUEST_LOGGERS = ("httpx", "httpx2", "httpcore", "openai", "urllib3")


class _RoleFilter(logging.Filter):
    def __init__(self, role: str):
        super().__init__()
        self.role = role

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "role"):
            record.role = self.role
        return True


def setup_logging(role: str, level: str | int = "INFO", actor: bool = False) -> None:
    """Configure the root logger of this process to tag lines with ``role``; an ``actor`` (a Ray
    worker process) also leaves without the interpreter's teardown report (``quiet_teardown``)."""
    if actor:
        quiet_teardown()
    root = logging.getLogger()
    root.setLevel(level)
    if not root.handlers:
        root.addHandler(logging.StreamHandler())
    for h in root.handlers:
        h.filters = [f for f in h.filters if not isinstance(f, _RoleFilter)]
        h.addFilter(_RoleFilter(role))
        h.setFormatter(logging.Formatter(_FMT, datefmt="%H:%M:%S"))
    logging.getLogger("disagg").setLevel(level)
    quiet = logging.WARNING if logging.getLogger().getEffectiveLevel() > logging.DEBUG else logging.NOTSET
    for name in PER_REQUEST_LOGGERS:
        logging.getLogger(name).setLevel(quiet)


def quiet_teardown() -> None:
    """Once this process's exit handlers start (``atexit``, before the interpreter tears its extension
    modules down), its stderr goes to /dev/null. That teardown is where Triton's nanobind bindings,
    imported with torch or vLLM, report hundreds of "leaked function" lines, which Ray forwards from
    every actor to the driver's console after the run's summary. Anything an actor has to say was said
    by then: its errors reach the driver through Ray, its logs were flushed here. Triton silences its
    own compile workers the same way. Registered once per process."""
    global _TEARDOWN_QUIET
    if not _TEARDOWN_QUIET:
        atexit.register(_stderr_to_devnull)
        _TEARDOWN_QUIET = True


_TEARDOWN_QUIET = False


def flush_std_streams() -> None:
    """Flush stdout and stderr (a process about to leave, or to lose its stderr)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed stream has nothing to flush
            pass


def _stderr_to_devnull() -> None:
    flush_std_streams()
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    os.close(null)


async def await_logged(aw: Awaitable[T], *, what: str, timeout_s: float, log: logging.Logger,
                       interval_s: float = 10.0) -> T:
    """Await ``aw`` with a deadline, logging progress every ``interval_s``."""
    task = asyncio.ensure_future(aw)
    start = time.monotonic()
    while True:
        left = timeout_s - (time.monotonic() - start)
        if left <= 0:
            task.cancel()
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        done, _ = await asyncio.wait({task}, timeout=min(interval_s, left))
        if done:
            return task.result()
        log.info("still waiting for %s (%.0fs of %.0fs)", what, time.monotonic() - start, timeout_s)


def ray_get_logged(refs: Any, *, what: str, timeout_s: float, log: logging.Logger, interval_s: float = 10.0) -> Any:
    """``ray.get`` with a deadline and periodic progress logs; raises ``TimeoutError``."""
    import ray

    single = not isinstance(refs, list)
    pending = [refs] if single else list(refs)
    start = time.monotonic()
    while True:
        left = timeout_s - (time.monotonic() - start)
        try:  # one call when everything comes within the interval (a sync's critical path)
            out = ray.get(pending, timeout=max(0.0, min(interval_s, left)))
            return out[0] if single else out
        except ray.exceptions.GetTimeoutError:
            pass
        ready, not_ready = ray.wait(pending, num_returns=len(pending), timeout=0)
        # Surface an actor failure early instead of waiting on its siblings.
        for r in ready:
            ray.get(r)
        if not not_ready:
            continue
        if time.monotonic() - start >= timeout_s:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what} ({len(not_ready)} of {len(pending)} pending)")
        log.info("still waiting for %s: %d of %d pending after %.0fs", what, len(not_ready), len(pending), time.monotonic() - start)


def traced(path: str | None, cuda: bool, call: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``call()``'s figures; with ``path``, ``call`` runs under ``torch.profiler`` (host activity with
    the Python calls that made it, and the device's where ``cuda``), written to ``path`` as a Chrome
    trace and named in the figures' ``trace`` (the benchmarks' ``--trace``: a sync's push and each
    engine worker's receive). The Python calls show where host time goes between the ops: a sync's
    set-up and its waits are mostly Python."""
    if path is None:
        return call()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []), with_stack=True) as prof:
        out = call()
    prof.export_chrome_trace(path)
    return {**out, "trace": path}
