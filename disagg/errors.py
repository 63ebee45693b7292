"""Error types shared by every disagg component.

User mistakes are ``ConfigError``; recoverable per-sample trouble is
``RolloutError``; ``EngineDeadError`` and ``TransportError`` are fatal for the
engine or the weight-sync group they name, as vLLM splits them.
"""


class DisaggError(Exception):
    """Base class for disagg's own errors."""


class ConfigError(DisaggError, ValueError):
    """A configuration value is invalid; the message names the key and the value."""


class RolloutError(DisaggError):
    """One sample could not be produced; drop or retry it, the run goes on."""


class EngineDeadError(DisaggError):
    """A rollout engine died or stopped answering."""


class TransportError(DisaggError):
    """A weight-sync rendezvous or collective failed or timed out."""


class ControlError(DisaggError):
    """A control-plane (gRPC) call failed; the message names the call and peer."""


class CheckpointDamaged(DisaggError):
    """A checkpoint's files do not match its manifest (``disagg.digests``): the message names the
    checkpoint, and each file with what is wrong with it."""

    def __init__(self, location: str, faults: list[str]):
        super().__init__(f"{location}: {'; '.join(faults)}")
        self.location, self.faults = location, list(faults)


class SandboxError(DisaggError):
    """The code sandbox cannot isolate as asked: a filesystem isolation backend is missing or
    failed on this machine; the message says why."""


class ChecksumError(TransportError):
    """A received bucket's checksum differs from the sender's; the version was not loaded."""


class SyncCancelled(DisaggError):
    """An armed receive was called off by the sender before any byte moved; the weights are unchanged."""


class DeltaRefused(TransportError):
    """A delta sync was made against a version this receiver does not hold. It took the whole sync
    off the wire (the group stays in step) and loaded nothing; it needs a dense sync."""


def brief(e: BaseException) -> str:
    """``e``'s first line (its type's name where it says nothing), at most 400 characters: for a
    message that wraps it."""
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:400]
