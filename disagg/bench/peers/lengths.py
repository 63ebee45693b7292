"""The peers job's response lengths and engine step trace, without vLLM (pure, or nearly: a file append).

``vllm_lengths.PeersLengths`` applies them inside every framework's vLLM. Here: which length a prompt
gets (``target_length``: a hash of its token ids, so the same prompt gets the same length in every
framework), what that does to a batch's logits (``force_lengths``), and the trace of sampling steps
the bench reads the engines' idle share from (``StepTrace``).
"""

from __future__ import annotations

import os
import time
import zlib
from dataclasses import dataclass

LENGTHS_ENV = "DISAGG_PEERS_LENGTHS"
TRACE_ENV = "DISAGG_PEERS_TRACE"


@dataclass(frozen=True)
class Lengths:
    """The heavy tail: ``fraction`` of prompts get ``long`` tokens, the rest ``short``; ``eos`` ends them."""

    short: int
    long: int
    fraction: float
    eos: int

    @classmethod
    def parse(cls, spec: str) -> "Lengths":
        """From ``short=N,long=N,fraction=F,eos=ID`` (``DISAGG_PEERS_LENGTHS``); ValueError naming the spec."""
        try:
            fields = dict(part.split("=", 1) for part in spec.split(",") if part)
            out = cls(short=int(fields["short"]), long=int(fields["long"]), fraction=float(fields["fraction"]),
                      eos=int(fields["eos"]))
        except (KeyError, ValueError) as e:
            raise ValueError(f"{LENGTHS_ENV}={spec!r}: expected short=N,long=N,fraction=F,eos=ID ({e})") from e
        if not (0 < out.short and 0 < out.long and 0.0 <= out.fraction <= 1.0):
            raise ValueError(f"{LENGTHS_ENV}={spec!r}: lengths must be > 0 and fraction in [0, 1]")
        return out

    def spec(self) -> str:
        return f"short={self.short},long={self.long},fraction={self.fraction},eos={self.eos}"


def target_length(prompt_ids, lengths: Lengths) -> int:
    """The response length of a prompt, its end-of-sequence token included: a hash of its token ids
    picks long (with probability ``fraction``) or short."""
    h = zlib.crc32(",".join(str(int(t)) for t in prompt_ids).encode()) / 2**32
    return lengths.long if h < lengths.fraction else lengths.short


def force_lengths(logits, reqs: dict[int, tuple[int, list[int], tuple[int, ...]]], eos: int):
    """``logits`` [batch, vocab] with each request of ``reqs`` (batch row -> (target, its output ids so
    far, the ids that would stop it)) held to its target: every stopping id banned while the next token
    is not the last, and ``eos`` the only choice when it is (keeping its logit, or 0 where it was banned).
    Rows not in ``reqs`` are untouched."""
    import torch

    ban_rows, ban_ids, force = [], [], []
    for row, (target, out, stops) in reqs.items():
        if row >= logits.shape[0]:
            continue
        if len(out) >= target - 1:
            force.append(row)
        else:
            for t in {eos, *stops}:
                ban_rows.append(row)
                ban_ids.append(t)
    if ban_rows:
        rows = torch.tensor(ban_rows, device=logits.device)
        logits[rows, torch.tensor(ban_ids, device=logits.device)] = float("-inf")
    if force:
        rows = torch.tensor(force, device=logits.device)
        keep = logits[rows, eos].clone()
        logits[rows] = float("-inf")
        logits[rows, eos] = torch.where(torch.isfinite(keep), keep, torch.zeros_like(keep))
    return logits


class StepTrace:
    """One line per sampling step, ``<unix time> <requests in the batch>``, appended to
    ``<folder>/steps-<pid>.txt``. Each line is written as it is made (a line-buffered file: one small
    write per step, microseconds against a decode step's milliseconds), so a framework stopped with a
    kill leaves its whole trace behind."""

    def __init__(self, folder: str) -> None:
        self.path = os.path.join(folder, f"steps-{os.getpid()}.txt")
        self._f = open(self.path, "a", buffering=1)

    def record(self, batch: int) -> None:
        self._f.write(f"{time.time():.6f} {batch}\n")

    def close(self) -> None:
        self._f.close()
