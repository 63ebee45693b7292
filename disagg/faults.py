"""Fault points: named places where the fault-injection tests make a process fail for real.

A test arms a point inside the process that should fail (``EngineActor.arm_fault`` does it
in an engine); when the code passes that point ``after`` times, the fault fires: ``exit``
ends the process at once (``os._exit``, no cleanup, as a crash or an OOM kill would),
``raise`` raises ``FaultInjected``. Unarmed points cost one dict lookup.

Points: ``receive_bucket`` (a receiver took one more bucket of a weight sync).
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("disagg.faults")

POINTS = ("receive_bucket",)
ACTIONS = ("exit", "raise")
_armed: dict[str, dict] = {}


class FaultInjected(RuntimeError):
    """Raised by a point armed with ``action="raise"``."""


def arm(point: str, action: str = "exit", after: int = 1) -> None:
    if point not in POINTS:
        raise ValueError(f"unknown fault point {point!r}; known: {POINTS}")
    if action not in ACTIONS:
        raise ValueError(f"unknown fault action {action!r}; known: {ACTIONS}")
    if after < 1:
        raise ValueError(f"fault point {point}: after must be >= 1, got {after}")
    _armed[point] = {"action": action, "after": after, "hits": 0}
    log.warning("fault point %s armed: %s after %d hit(s)", point, action, after)


def hit(point: str) -> None:
    spec = _armed.get(point)
    if spec is None:
        return
    spec["hits"] += 1
    if spec["hits"] < spec["after"]:
        return
    del _armed[point]
    log.error("fault point %s fired (%s) after %d hit(s)", point, spec["action"], spec["hits"])
    if spec["action"] == "exit":
        os._exit(70)
    raise FaultInjected(f"fault injected at {point}")
