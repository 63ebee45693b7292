"""The engine fleet: which rollout engines serve, drain, start and join; their load and health;
engine deaths and the elastic pool (``Ops.ScaleRollout``).

Membership, by engine id:

- ``serving``: members taking new prompt groups;
- ``draining``: members finishing their groups; they leave at a sync once nothing uses them;
- ``launching``: starting (a scale-up or a replacement), not members yet;
- ``joining``: started on dummy weights; they join the transport group at the next sync;
- ``joined``: joined at a sync that has not landed yet; they take groups once it has;
- ``died``: declared dead; members of the transport group until its next rebuild.

An engine is dead when a call to it fails and so does a health check, or when it leaves a health
check unanswered for ``rollout.health_timeout_s``. It is killed at once, its prompt groups go back
to the queue (before any new prompt), and a replacement starts (``rollout.replace_dead_engines``).
"""

from __future__ import annotations

import logging
import re
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

log = logging.getLogger("disagg.pipeline")


class AgentRunners:
    """The agent runners (multi-turn groups against the engines' OpenAI API) and the engines they
    route sessions to."""

    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self.handles: list[Any] = []
        self.routed: set[int] = set()  # engines the runners route to

    def start(self, job) -> None:
        import ray

        from disagg.agent.client import EngineAuth
        from disagg.agent.runner import AgentRunner
        from disagg.errors import ConfigError

        addresses = {int(i["engine_id"]): i.get("address", "") for i in job.rollout.start_info}
        if not all(addresses.values()):
            raise ConfigError("agent tasks talk to the engines' OpenAI API: set rollout.openai_api=true")
        roll = self.cfg.rollout
        cls = ray.remote(AgentRunner).options(num_cpus=0, max_concurrency=1000)
        self.handles = [cls.remote(self.cfg.agent, str(job.model_path), addresses, roll.served_model_name,
                                   roll.tool_call_parser or "hermes", roll.max_model_len, self.cfg.logging.level,
                                   self.cfg.model.cache_dir, self.cfg.reward.require_sandbox_isolation,
                                   EngineAuth(job.api_key, roll.api_tls_ca or roll.api_tls_cert))
                        for _ in range(self.cfg.agent.num_runners)]
        self.routed = set(addresses)

    def call(self, method: str, calls: list[tuple], wait: bool = True) -> list:
        """``method(*args)`` on every runner for each ``args`` in ``calls``; their results, in order."""
        import ray

        refs = [getattr(r, method).remote(*args) for args in calls for r in self.handles]
        if not wait:
            return []
        return ray.get(refs, timeout=self.cfg.cluster.actor_timeout_s)

    def set_health(self, eid: int, health: str) -> None:
        if eid in self.routed:
            self.call("set_engine_health", [(eid, health)], wait=False)

    def add(self, engines: list[tuple[int, str]]) -> None:
        self.call("add_engine", engines)
        self.routed.update(eid for eid, _ in engines)

    def remove(self, eids: list[int]) -> None:
        routed = [(eid,) for eid in eids if eid in self.routed]
        if routed:
            self.call("remove_engine", routed)
            self.routed.difference_update(eids)

    def in_use(self, eid: int) -> int:
        """Sessions of the runners still on engine ``eid``."""
        return sum(self.call("engine_use", [(eid,)])) if eid in self.routed else 0

    def stats(self) -> list[dict]:
        import ray

        return ray.get([r.get_stats.remote() for r in self.handles], timeout=self.cfg.cluster.actor_timeout_s)

    def close(self) -> None:
        import ray

        for r in self.handles:
            ray.kill(r)
        self.handles = []


class EngineFleet:
    """Owns the engines' membership and health, and decides deaths, replacements and scaling.

    ``requeue(gids)`` sends a dead engine's groups back for generation; ``streams_of(eid)`` takes
    the calls in flight to engine ``eid`` off the books and returns their gids (both from
    ``Generation``); ``generating(eid)`` is how many groups engine ``eid`` generates now (the
    scheduler's count, which placement and draining go by). All three are given when the fleet is
    built: the fleet calls them, never the other way.
    ``more_steps`` is set by the loop: no engine is started for a run that ends.
    """

    def __init__(self, cfg, job, state, runners: AgentRunners, agent: bool = False, *,
                 requeue: Callable[[list[int]], None], streams_of: Callable[[int], list[int]],
                 generating: Callable[[int], int]) -> None:
        self.cfg, self.job, self.pool, self.state = cfg, job, job.rollout, state
        self.counts: Counter = Counter()  # its own events: engines launched, started, dead, replaced, left, joined
        self.runners, self.agent = runners, agent
        self.serving: list[int] = []
        self.draining: set[int] = set()
        self.launching: dict[Any, tuple[int, Any, float]] = {}  # start ref -> (engine id, handle, t0)
        self.joining: dict[int, Any] = {}
        self.joined: list[int] = []
        self.died: set[int] = set()
        self.addresses: dict[int, str] = {}  # engine id -> OpenAI address, of engines added by a scale-up
        self.join_version: dict[int, int] = {}  # engine id -> the version whose sync it joined at (scale-up)
        self.more_steps = True
        self._pings: dict[int, tuple[Any, float]] = {}  # engine id -> (health check ref, sent at)
        self._last_ping: dict[int, float] = {}
        self._rr = 0
        self.requeue, self.streams_of, self.generating = requeue, streams_of, generating

    def start(self) -> None:
        """The run starts: every engine of the pool serves."""
        self.serving = list(self.pool.engine_ids)

    def shutdown(self) -> None:
        """Engines that never became members are not the job's to shut down."""
        for eid, handle, _ in list(self.launching.values()):
            self.pool.retire(eid, handle)
        for eid, handle in self.joining.items():
            self.pool.retire(eid, handle)
        self.launching, self.joining = {}, {}

    def active(self) -> int:
        """Engines the pool will have once the ones starting have joined and the draining ones left."""
        return len(self.serving) + len(self.joined) + len(self.joining) + len(self.launching)

    def can_receive(self) -> bool:
        """Some engine would be in the transport group at a sync now (a member, or started to join)."""
        return bool(self.serving or self.joined or self.draining or self.joining)

    def all_replacing(self) -> bool:
        """Every member died and only replacements are coming: they join at once, not at the next step."""
        return bool(self.joining) and not self.serving and not self.joined

    # ---- placement -----------------------------------------------------------------------------
    def place(self) -> int:
        """The serving engine for the next group: the fewest groups generating (the scheduler counts the
        group once it is submitted there), round-robin among equals."""
        serving, generating = self.serving, self.generating
        k = min(range(len(serving)), key=lambda i: (generating(serving[i]), (i - self._rr) % len(serving)))
        self._rr += 1
        return serving[k]

    @property
    def load(self) -> dict[int, int]:
        """Member engine id -> its groups generating (asked of the scheduler, which counts them)."""
        return {eid: self.generating(eid) for eid in [*self.serving, *sorted(self.draining), *self.joined]}

    # ---- the elastic pool ----------------------------------------------------------------------
    def scale_check(self, num_engines: int) -> str | None:
        """Why ``num_engines`` engines cannot run, or None (called from a gRPC thread)."""
        import ray

        more = num_engines - self.active() - len(self.draining)  # draining ones are taken back first
        if more <= 0:
            return None
        pool = self.pool
        need = {k: v * pool.tp for k, v in self.job.pools.rollout_bundle.items() if v > 0}
        avail = ray.available_resources()
        fits = min(int(avail.get(k, 0.0) // v) for k, v in need.items()) if need else more
        room = pool.free_bundles() + fits
        if more > room:
            have = ", ".join(f"{k} {avail.get(k, 0.0):g}" for k in need)
            return (f"the cluster has room for {room} more engine(s), {num_engines} engines need {more} more: each "
                    f"needs {', '.join(f'{k} {v:g}' for k, v in need.items())} and the cluster has {have} "
                    f"available; add nodes or ask for fewer")
        return None

    def apply_scale(self, more_steps: bool) -> None:
        """Move towards the operator's target: launch or take back engines, or drain the newest ones."""
        self.more_steps = more_steps
        target = self.state.scale_target()
        limit = self.cfg.cluster.placement_timeout_s + self.cfg.rollout.start_timeout_s
        for ref, (eid, handle, t0) in list(self.launching.items()):
            if time.perf_counter() - t0 > limit:
                del self.launching[ref]
                self._launch_failed(eid, handle, f"not started after {limit:.0f} s "
                                    "(cluster.placement_timeout_s + rollout.start_timeout_s)")
        if target is None or not more_steps:
            return
        active = self.active()
        while active < target:
            if self.draining:  # it has the weights and is still a member: just give it groups again
                eid = max(self.draining)
                self.draining.discard(eid)
                self.serving.append(eid)
                self.pool.handle(eid).set_draining.remote(False, "taken back: the pool scaled up again")
                self.runners.set_health(eid, "healthy")
                log.info("engine %d taken back from draining", eid)
            else:
                self._launch()
            active += 1
        while active > target:
            if self.launching:  # not serving yet: cancel the newest first
                eid, handle, _ = self.launching.pop(next(reversed(self.launching)))
                self._drop(eid, handle)
            elif self.joining:
                eid = max(self.joining)
                self._drop(eid, self.joining.pop(eid))
            elif self.joined:  # a member already, waiting for its first sync to land: drain it like the others
                self._drain(self.joined.pop(), "scaled down before it took groups")
            else:
                eid = max(self.serving)
                self.serving.remove(eid)
                self._drain(eid, f"scaled down to {target}: finishing its groups")
            active -= 1

    def _launch(self) -> int:
        eid, handle, ref = self.pool.launch()
        self.launching[ref] = (eid, handle, time.perf_counter())
        self.counts["engines_launched"] += 1
        return eid

    def _drain(self, eid: int, reason: str) -> None:
        """No new groups (or agent sessions) for ``eid``; it leaves at a sync once nothing uses it."""
        self.draining.add(eid)
        self.pool.handle(eid).set_draining.remote(True, reason)
        self.runners.set_health(eid, "draining")  # sessions on it finish there; new ones go elsewhere
        log.info("engine %d draining: %s", eid, reason)

    def _drop(self, eid: int, handle) -> None:
        """Retire an engine that never became a member of the transport group (in the background)."""
        self.state.remove_engine(eid)
        self.pool.retire(eid, handle, background=True)

    def launched(self, ref) -> None:
        """An engine launched by a scale-up is up on dummy weights (or failed to start)."""
        import ray

        eid, handle, t0 = self.launching.pop(ref)
        try:
            self.addresses[eid] = ray.get(ref).get("address", "")
        except Exception as e:  # noqa: BLE001 - a failed start lowers the target; the run goes on
            self._launch_failed(eid, handle, f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}")
            return
        self.joining[eid] = handle
        log.info("engine %d started in %.1f s: joins the transport group at the next weight sync", eid,
                 time.perf_counter() - t0)

    def _launch_failed(self, eid: int, handle, why: str) -> None:
        log.error("engine %d could not start (%s): the rollout pool stays at %d engines", eid, why, self.active())
        self._drop(eid, handle)
        self.counts["engine_start_failures"] += 1
        self.state.set_scale_target(self.active(), f"engine {eid} failed to start: {why}")

    # ---- health and death ----------------------------------------------------------------------
    def check_health(self) -> None:
        """Ask every member and joining engine whether it is alive (every rollout.health_interval_s);
        one that fails the check, or leaves it unanswered for rollout.health_timeout_s, is dead.
        Engines answer while they generate and while they load weights."""
        import ray

        roll, now = self.cfg.rollout, time.perf_counter()
        watched = {eid: h for eid, h in zip(self.pool.engine_ids, self.pool.engines) if eid not in self.died}
        watched.update(self.joining)
        for eid, handle in watched.items():
            if eid not in self._pings and now - self._last_ping.get(eid, -1e9) >= roll.health_interval_s:
                self._pings[eid] = (handle.ping.remote(), now)
                self._last_ping[eid] = now
        for eid, (ref, t0) in list(self._pings.items()):
            if eid not in watched:
                del self._pings[eid]
            elif is_done(ref):
                del self._pings[eid]
                try:
                    ray.get(ref)
                except Exception as e:  # noqa: BLE001 - the engine is declared dead with the reason
                    self.died_now(eid, f"health check failed: {brief(e)}")
            elif now - t0 > roll.health_timeout_s:
                del self._pings[eid]
                self.died_now(eid, f"stuck: no answer to a health check for {roll.health_timeout_s:g} s "
                              "(rollout.health_timeout_s)")

    def failure(self, eid: int, error: BaseException) -> str | None:
        """Why a call to engine ``eid`` failed if the engine is dead, or None if it is healthy."""
        import ray

        if isinstance(error, ray.exceptions.RayActorError):
            return f"the actor died: {brief(error)}"
        try:
            ray.get(self.pool.handle(eid).ping.remote(), timeout=self.cfg.rollout.health_timeout_s)
        except Exception as e:  # noqa: BLE001 - dead: both reasons go into the report
            return f"{brief(error)}; health check: {brief(e)}"
        return None

    def died_now(self, eid: int, why: str, gids: list[int] | None = None) -> None:
        """Where an engine death is handled: kill it, requeue its groups (and ``gids``), start a replacement."""
        again = list(gids or [])
        if eid in self.died:
            self.requeue(again)
            return
        self.died.add(eid)
        handle = self.pool.handle(eid) if eid in self.pool.engine_ids else self.joining.pop(eid, None)
        again += self.streams_of(eid)
        self.requeue(again)
        if eid in self.serving:
            self.serving.remove(eid)
        if eid in self.joined:
            self.joined.remove(eid)
        self.draining.discard(eid)
        self._pings.pop(eid, None)
        if handle is not None:
            self.pool.discard(eid, handle)
        self.counts["engine_deaths"] += 1
        self.state.engine_died(eid, f"{why}; {len(again)} prompt group(s) back in the queue")
        self.runners.set_health(eid, "dead")
        if self.cfg.rollout.replace_dead_engines and self.more_steps:
            new = self._launch()
            self.counts["engines_replaced"] += 1
            self.state.record_event("engine_replaced", f"engine {new} starts in place of engine {eid}")
        elif self.state.scale_target() is not None:
            self.state.set_scale_target(self.active(), f"engine {eid} died and is not replaced")

    # ---- membership changes at a sync ------------------------------------------------------------
    def changes_pending(self) -> bool:
        """Whether the next sync may change the members (engines to join, draining or dead ones)."""
        return bool(self.joining or self.draining or any(eid in self.died for eid in self.pool.engine_ids))

    def change_at_sync(self, version: int, rebuild: bool) -> None:
        """At this point between syncs, before the sync of ``version``: started engines join the
        transport group and drained ones leave it (one rebuild, a new epoch); ``rebuild``: the last
        sync failed, so the group is built again even if nobody comes or goes."""
        if self.agent:  # groups run on the runners: ask them what still uses each draining engine
            leaving = [eid for eid in sorted(self.draining) if self.runners.in_use(eid) == 0]
        else:
            leaving = [eid for eid in self.draining if self.generating(eid) == 0]
        pool = self.pool
        dead = [eid for eid in pool.engine_ids if eid in self.died]  # members until this rebuild
        if not (self.joining or leaving or dead or rebuild):
            return
        gone = {eid: pool.handle(eid) for eid in leaving}
        members = [(eid, h) for eid, h in zip(pool.engine_ids, pool.engines)
                   if eid not in gone and eid not in self.died]
        members += list(self.joining.items())
        t0 = time.perf_counter()
        joined = {eid for eid, _ in self._change_engines(members)}
        self.joining = {eid: h for eid, h in self.joining.items() if eid in joined}
        self.runners.remove([*gone, *dead])
        for eid, handle in gone.items():
            self.state.remove_engine(eid)
            pool.retire(eid, handle, background=True)
            self.draining.discard(eid)
            self.counts["engines_left"] += 1
        for eid in self.joining:
            self.state.record_event("engine_joined", f"engine {eid} joined the transport group "
                                    f"(epoch {self.job.transport_epoch}) with version {version}")
            self.join_version[eid] = version
            self.counts["engines_joined"] += 1
        self.joined += list(self.joining)
        self.joining = {}
        log.info("rollout pool rebuilt in %.2f s: engines %s (%s joined, %s left, %s dead)", time.perf_counter() - t0,
                 pool.engine_ids, self.joined or "none", sorted(gone) or "none", dead or "none")

    def _change_engines(self, members: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
        """``Job.change_engines``; a member that makes the rendezvous fail and then fails its health
        check is taken out and the group built again. Returns the members that joined."""
        from disagg.errors import RolloutError, TransportError

        err: Exception | None = None
        for _ in range(self.cfg.transport.max_sync_retries + 1):
            try:
                self.job.change_engines(members)
                return members
            except TransportError as e:
                err = e
            self.state.record_event("rebuild_failed", str(err)[:600])
            alive = []
            for eid, handle in members:
                if (why := self.failure(eid, err)) is None:
                    alive.append((eid, handle))
                else:
                    self.died_now(eid, f"failed to join the transport group: {why}")
            members = alive
        raise RolloutError(f"the transport group could not be rebuilt "
                           f"({self.cfg.transport.max_sync_retries + 1} tries, transport.max_sync_retries): {err}")

    def synced(self, version: int) -> None:
        """A sync landed: the engines that joined at it serve ``version`` and take groups now."""
        if not self.joined:
            return
        log.info("engines %s serve version %d: taking prompt groups", self.joined, version)
        if self.agent:  # the runners route sessions to them from now on
            self.runners.add([(e, self.addresses[e]) for e in self.joined])
        self.serving += self.joined
        self.joined = []


def brief(e: BaseException) -> str:
    """The first line of an error, for logs and events (Ray's own errors run to pages, in colour)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300] if text else ''}"


def is_done(ref) -> bool:
    import ray

    return bool(ray.wait([ref], num_returns=1, timeout=0)[0])


def all_done(refs, ready: list) -> bool:
    """Every one of ``refs`` finished: in ``ready`` (the loop's last wait) or before."""
    return all(r in ready or is_done(r) for r in refs)


class SeenRefs:
    """The refs of a call on several actors (a train step's ranks, a sync's parties) that the loop's
    wait returned while a sibling still runs: they stay out of the next wait, which would return
    them at once (the driver would spin, stealing a core, until the siblings finish)."""

    def __init__(self) -> None:
        self._seen: set = set()

    def waiting(self, refs) -> list:
        """``refs`` the loop still waits on."""
        return [r for r in refs if r not in self._seen]

    def noticed(self, refs, ready: list) -> None:
        """``ready`` came back from the loop's wait: those of ``refs`` among them are finished."""
        mine = set(refs)
        self._seen.update(r for r in ready if r in mine)

    def clear(self) -> None:
        self._seen.clear()
