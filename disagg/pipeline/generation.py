"""Generation: prompt groups out to the engines (or the agent runners) and their results back.

Each admission wave goes to each engine in one Ray streaming call, which yields every group's
result as it completes. One call per group made vLLM batch a step's groups as they trickled in,
one actor call at a time: measured, a third of the engine's time per step.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sized
from typing import Any

from disagg.pipeline.scheduler import Group, GroupScheduler
from disagg.rollout.types import GenRequest, SamplingSpec

log = logging.getLogger("disagg.pipeline")


class Generation:
    """Owns the calls in flight to the engines and runners (call -> request id -> gid), the prompt
    source, and the queue of groups to generate again (their engine died)."""

    def __init__(self, job, sched: GroupScheduler, source: Iterator, encode: Callable[[str], tuple[int, ...]],
                 sampling: SamplingSpec, sampling_for: Callable[[dict], SamplingSpec] | None,
                 runners=None) -> None:
        self.job, self.sched, self.source, self.encode = job, sched, source, encode
        self.counts: Counter = Counter()  # its own events (groups_requeued)
        self.sampling, self.sampling_for = sampling, sampling_for
        self.runners = runners  # AgentRunners when groups are agent sessions, else None
        self.calls: dict[Any, dict[str, int]] = {}  # engine stream (or runner call) -> request id -> gid, still to come
        self.again: deque[int] = deque()  # gids to generate again, before any new prompt
        self.retries: Counter = Counter()  # gid -> agent groups run again after an unreachable engine
        self.next_gid = 0  # groups drawn from the source so far
        self.dummy_served = 0  # groups with a token generated on dummy weights (version 0): must stay 0
        self._again_ids = itertools.count()

    def inflight(self) -> int:
        return _count(self.calls)

    def submit(self, fleet, engine_version: int, new: int) -> None:
        """The groups to generate again, then ``new`` prompts' groups, placed by ``fleet``, in one wave."""
        wave = [self._group(fleet, engine_version, self.again.popleft()) for _ in range(len(self.again))]
        wave += [self._group(fleet, engine_version) for _ in range(new)]
        per_engine: dict[int, dict[str, tuple[Any, int]]] = {}
        for e, what, gid in wave:
            if e < 0:
                self.calls[what] = {"": gid}
            else:
                per_engine.setdefault(e, {})[what.request_id] = (what, gid)
        for e, reqs in per_engine.items():
            stream = (self.job.rollout.handle(e).generate_stream.options(num_returns="streaming")
                      .remote([req for req, _ in reqs.values()]))
            self.calls[stream] = {rid: gid for rid, (_, gid) in reqs.items()}

    def _group(self, fleet, engine_version: int, again: int | None = None):
        """The next prompt's group (or group ``again``): (engine id, its request, gid); an agent group
        is sent to its runner at once: (-1, the call, gid)."""
        if again is None:
            row = next(self.source)
            gid = self.next_gid
            self.next_gid += 1
            rowd = row.row
            if self.runners is not None and "messages" not in rowd:
                raise ValueError(f"agent task row {row.index} has no 'messages' (keys: {sorted(rowd)})")
            prompt = () if self.runners is not None else self.encode(row.prompt)
        else:
            gid, rowd, prompt = again, self.sched.inflight[again].row, self.sched.inflight[again].prompt_ids
        sampling = self.sampling_for(rowd) if self.sampling_for else self.sampling
        if self.runners is not None:
            self.sched.submitted(Group(gid, rowd, prompt, -1, engine_version, time.perf_counter()))
            runner = self.runners.handles[gid % len(self.runners.handles)]
            return -1, runner.run_group.remote(gid, rowd["messages"], sampling), gid
        e = fleet.place()
        self.sched.submitted(Group(gid, rowd, prompt, e, engine_version, time.perf_counter()))
        rid = f"g{gid}" if again is None else f"g{gid}-again{next(self._again_ids)}"
        return e, GenRequest(rid, prompt, sampling, stale_drop=True), gid

    def requeue(self, gids: list[int]) -> None:
        """Groups whose engine died: submitted again (before any new prompt), counted."""
        self.again.extend(gids)
        self.counts["groups_requeued"] += len(gids)

    def run_again(self, gid: int, result) -> bool:
        """An agent group whose session lost its engine (``engine_unreachable``) runs again, at most
        3 times: True if it was requeued."""
        if result.dropped != "engine_unreachable" or self.retries[gid] >= 3:
            return False
        self.retries[gid] += 1
        self.requeue([gid])
        return True

    def served(self, result) -> None:
        """Count a returned group with a token generated on dummy weights (must never happen)."""
        if any(v < 1 for c in result.completions for v in c.token_versions):
            self.dummy_served += 1

    def streams_of(self, eid: int) -> list[int]:
        """The calls in flight to engine ``eid``, taken off the books: the gids they still owed (no
        longer generating there, for the scheduler)."""
        out: list[int] = []
        for ref, pending in list(self.calls.items()):
            mine = [g for g in pending.values() if self.sched.inflight[g].engine == eid]
            if mine:  # a stream carries one engine's groups
                del self.calls[ref]
                out += mine
        self.sched.off_engine(out)
        return out

    def cancel(self) -> None:
        """The run ended: every call still in flight is cancelled, so its engine aborts the groups'
        requests in vLLM instead of generating them for no step (a bench's next run on the same
        engines would queue behind them)."""
        import ray

        for ref in self.calls:
            try:
                ray.cancel(ref)
            except Exception as e:  # noqa: BLE001 - its engine or runner died meanwhile: nothing to stop
                log.debug("cancelling a call at the run's end: %s", e)
        self.calls.clear()

    def take(self, ref) -> list[tuple[list[int], Any]]:
        """What the ready ``ref`` has now: ([its gid], the GenResult) each, all of a stream's that are
        ready (groups finished together are scored together), ending with (every gid the call still
        owed, the error) if it failed, or if an engine's stream ended with groups unanswered."""
        return _take(self.calls, ref)


def _count(calls: dict[Any, Sized]) -> int:
    """Groups in flight across calls that each carry several."""
    return sum(len(g) for g in calls.values())


def _take(gen: dict[Any, dict[str, int]], ref) -> list[tuple[list[int], Any]]:
    """``Generation.take`` on the calls ``gen`` (ray's streaming generators, or an agent runner's call)."""
    import ray

    from disagg.errors import RolloutError

    pending = gen[ref]
    if not isinstance(ref, ray.ObjectRefGenerator):  # an agent runner's call: one group
        del gen[ref]
        try:
            return [(list(pending.values()), ray.get(ref)[0])]
        except Exception as e:  # noqa: BLE001 - the caller tells a dead runner or engine from an error
            return [(list(pending.values()), e)]
    out: list[tuple[list[int], Any]] = []
    while True:
        try:
            result = ray.get(next(ref))
        except StopIteration:
            result = RolloutError(f"an engine's stream ended with {len(pending)} group(s) unanswered "
                                  f"(requests {sorted(pending)[:5]})")
        except Exception as e:  # noqa: BLE001 - as above
            result = e
        if isinstance(result, BaseException):
            del gen[ref]
            return [*out, (list(pending.values()), result)]
        out.append(([pending.pop(result.request_id)], result))
        if not pending:  # nothing more to come: the stream's end is not waited for
            del gen[ref]
            return out
        if not ref.next_ready():
            return out
