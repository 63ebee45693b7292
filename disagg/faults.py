"""Fault points: named places where the fault-injection tests make a process fail for real.

A test arms a point inside the process that should fail (``EngineActor.arm_fault`` does it
in an engine; ``DISAGG_FAULTS`` in the environment of ``disagg train`` in its driver and its
trainer workers, which get the variable from the driver); when
the code passes that point ``after`` times, the fault fires: ``exit`` ends the process at once
(``os._exit``, no cleanup, as a crash or an OOM kill would), ``raise`` raises
``FaultInjected``, ``stop`` freezes the process (SIGSTOP to itself: alive, silent, until a
test kills or continues it), ``flag`` makes ``hit`` return True once (the point's code then
does the harm it names). Unarmed points cost one dict lookup.

Points: ``receive_bucket`` (a receiver took one more bucket of a weight sync),
``send_bucket`` (a trainer rank put one more bucket of a weight sync on the wire),
``checkpoint_written`` (the driver wrote a checkpoint), ``delta_image_lost`` (a receiver of a
delta sync; ``flag``: it forgets which version its image holds, as a receiver holding another
version would, and refuses the delta).
"""

from __future__ import annotations

import logging
import os
import signal

log = logging.getLogger("disagg.faults")

POINTS = ("receive_bucket", "send_bucket", "checkpoint_written", "delta_image_lost")
ACTIONS = ("exit", "raise", "stop", "flag")
ENV = "DISAGG_FAULTS"  # "point:action:after[,point:action:after...]", read by arm_from_env
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


def arm_from_env() -> None:
    """Arm the points ``DISAGG_FAULTS`` names (``disagg train``'s driver and trainer workers call it)."""
    value = os.environ.get(ENV, "")
    for spec in filter(None, value.split(",")):
        parts = spec.split(":")
        if len(parts) != 3 or not parts[2].isdigit():
            raise ValueError(f"{ENV}={value!r}: each entry is point:action:after, got {spec!r}")
        arm(parts[0], parts[1], int(parts[2]))


def env_vars() -> dict[str, str]:
    """``DISAGG_FAULTS`` as this process has it, for the environment of the actors it starts."""
    return {ENV: os.environ[ENV]} if os.environ.get(ENV) else {}


def hit(point: str) -> bool:
    """Passing ``point``: True only when a ``flag`` fault fires here."""
    spec = _armed.get(point)
    if spec is None:
        return False
    spec["hits"] += 1
    if spec["hits"] < spec["after"]:
        return False
    del _armed[point]
    log.error("fault point %s fired (%s) after %d hit(s)", point, spec["action"], spec["hits"])
    if spec["action"] == "exit":
        os._exit(70)
    if spec["action"] == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
        return False
    if spec["action"] == "flag":
        return True
    raise FaultInjected(f"fault injected at {point}")
