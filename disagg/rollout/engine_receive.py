"""The engine actor's side of a weight sync: take a version off the wire into vLLM's worker.

``receive_weights`` closes the actor's gate (new requests wait), finds the manifest (held by its
layout digest, else the coordinator's), quiesces the requests in flight (aborted to be resubmitted,
or frozen), calls the update into vLLM's worker (armed or dispatched; the prefix-cache reset beside
it where an OpenAI request came), then serves the version and reports the sync's phases and clock
readings (``SyncReport``). A failed update leaves the engine closed until a sync completes; a
version whose checksums failed is rejected with the previous one still serving. A part of
``EngineActor``, which holds the engine, the gate and the counters it reads."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from disagg.errors import ChecksumError, RolloutError
from disagg.rollout.types import SyncReport

if TYPE_CHECKING:
    from disagg.transport.model_transfer import Arm

log = logging.getLogger("disagg.rollout")


def first_token_version(start: int, cuts: list[tuple[int, int]]) -> int | None:
    """The version of a kept response's first token, from the version it started on and its cuts so
    far (each: its tokens when a sync paused it, the version loaded then; ``engine.cut_versions``);
    None while it has no token from before its last cut. Pure."""
    version = start
    for count, loaded in cuts:
        if count:
            return version
        version = loaded
    return None


class EngineSync:
    """``EngineActor``'s weight receive (gate, manifest, quiesce, the update call, resume)."""

    async def receive_weights(self, policy_version: int, manifest: dict | None = None, digest: str | None = None,
                              ack: bool = True, max_staleness: int | None = None,
                              arm: Arm | None = None) -> SyncReport:
        """Take ``policy_version`` off the wire (concurrently with the trainer's send).

        The manifest: ``manifest`` if given, else the one this engine holds when its layout digest is
        ``digest``, else the coordinator's. New requests wait until the load is done; requests in
        flight are frozen (vLLM's pause keep) or resubmitted, and continue on the new weights. An
        engine with nothing in flight loads without pausing vLLM: a pause and resume cost two round
        trips to the engine core, on every step's critical path. No KV the old weights computed is
        reused: this actor's requests are salted by version, and vLLM's prefix cache is cleared when
        requests through the OpenAI server (not salted) came since it last was. ``ack``: tell the
        coordinator this engine serves the version (a driver in the coordinator's process acks from
        the report instead, sparing a call). ``max_staleness``: the run's limit; once the version
        serves, the requests that may be dropped and that no step can train any more stop
        (``_drop_stale``). ``arm`` (``WeightSync.arm``): an armed receive, made before the trainer has
        the version: the worker waits on the transport group, ready, until its word comes (within
        ``arm.timeout_s``), so the sync then costs the wire and nothing of Ray's or vLLM's dispatch;
        called off, it returns a report with ``cancelled`` set. With ``arm.push_waits`` (the trainer's
        push is armed too) the worker takes the push's header before the word, so that after it only
        buckets are posted.
        """
        t0 = time.perf_counter()
        stamps = {"engine_in": time.time()}
        phases: dict[str, float] = {}
        self._not_loading.clear()  # before the first await: a request arriving from now on waits
        try:
            m, recv_s, stats = await self._load(policy_version, manifest, digest, phases, stamps, arm)
        finally:
            self._not_loading.set()
        self._report_state("READY")
        cancelled = str(stats.get("cancelled") or "")
        if max_staleness is not None and not cancelled:
            self._drop_stale(policy_version, max_staleness)
        if ack and self._coord is not None and not cancelled:
            t1 = time.perf_counter()
            await self._control_call(self._coord.ack_version, self.engine_id, policy_version, m.layout_digest())
            phases["ack_s"] = time.perf_counter() - t1
        waited = float(stats.get("armed_wait_s", 0.0))  # an armed receive's wait came before the announce
        before_go = 0.0  # seconds of this call before the trainer's word (armed)
        if waited:
            # Everything up to the trainer's word happened before the announce: the manifest, the
            # quiesce, the call into the worker and its set-up (armed_setup_s), then the wait; the
            # sync's part of the update starts at the word.
            go = float(stats.get("armed_go_unix_s", stamps["update_call"] + waited))
            phases["armed_setup_s"] = max(0.0, phases.get("manifest_s", 0.0) + phases.get("quiesce_s", 0.0)
                                          + go - stamps["update_call"] - waited)
            phases["armed_wait_s"] = waited
            phases["manifest_s"] = phases["quiesce_s"] = 0.0
            phases["update_s"] = max(0.0, stamps["update_return"] - go)
            stamps["worker_word"] = go
            before_go = max(0.0, go - stamps["engine_in"])
            recv_s = phases["update_s"]
        for key in ("load_s", "reload_init_s", "finalize_s"):  # the worker's own split of the update
            if key in stats:
                phases[f"worker_{key}"] = float(stats[key])
        if "seconds" in stats:
            phases["worker_receive_s"] = float(stats["seconds"])
        for key in ("worker_in", "wire_start", "worker_posted", "wire_end", "loaded", "worker_out"):  # the worker's clock
            if f"{key}_unix_s" in stats:
                stamps[key] = float(stats[f"{key}_unix_s"])
        stamps["engine_out"] = time.time()
        return SyncReport(self.engine_id, policy_version, int(stats.get("bytes", 0)), int(stats.get("num_buckets", 0)),
                          int(stats.get("num_tensors", 0)), recv_s, time.perf_counter() - t0 - before_go, phases,
                          m.layout_digest(), str(stats.get("copy_plan", "")), stamps, cancelled)

    async def _manifest_for(self, policy_version: int, manifest: dict | None, digest: str | None):
        """``manifest`` if given, else the one held when its layout digest is ``digest``, else the
        coordinator's; held for the next sync (``ManifestCache``)."""
        from disagg.transport.manifest import Manifest

        if manifest is not None:
            return self._manifest_cache.hold(Manifest.from_dict(manifest))
        held = self._manifest_cache.by_digest(digest, policy_version)
        if held is not None:
            return held
        if self._coord is None:
            raise RolloutError("receive_weights without a manifest needs a coordinator")
        return self._manifest_cache.hold(await self._control_call(self._coord.get_manifest, policy_version))

    async def _load(self, policy_version: int, manifest: dict | None, digest: str | None, phases: dict[str, float],
                    stamps: dict[str, float], arm: Arm | None = None):
        """``receive_weights`` behind the closed gate: (the manifest, seconds on the wire, the worker's
        figures); the seconds of each phase go into ``phases``, the update call's clock readings
        into ``stamps``. ``arm`` reaches the worker as a plain dict (``DisaggUpdateInfo.arm``)."""
        t = time.perf_counter()

        def lap(name: str) -> None:
            nonlocal t
            now = time.perf_counter()
            phases[name] = phases.get(name, 0.0) + now - t
            t = now

        m = await self._manifest_for(policy_version, manifest, digest)
        lap("manifest_s")
        self._report_state("SYNCING")
        eng = self._engine
        await self._quiesce()
        lap("quiesce_s")  # requests added, aborted (resubmit) or frozen (keep)
        # The worker gets the manifest only when its layout is new to it.
        key = m.layout_digest()
        info = ({"digest": key, "policy_version": policy_version} if key == self._worker_layout
                else {"manifest": m.to_dict()})
        if arm is not None:
            info["arm"] = arm.as_dict()
        self._worker_layout = None  # until this update went through
        try:
            # The cache reset, where one is needed, is queued in the engine core ahead of the update,
            # which blocks its loop: no step runs between the two (nothing is in flight, or it is
            # paused), so no block the old weights computed survives.
            called = stamps["update_call"] = time.time()

            async def reset_cache() -> bool:
                # Only a request through the OpenAI server can meet blocks another version computed:
                # this actor's own requests are salted by version. vLLM's reset walks every KV block
                # in Python, whatever the cache holds (its cost grows with the pool, not with what is
                # cached), so it runs only when such a request came since the last one.
                if self.stats["http_requests"] == self._http_at_reset:
                    return True
                self._http_at_reset = self.stats["http_requests"]
                out = await eng.reset_prefix_cache()
                phases["reset_cache_s"] = time.time() - called  # beside the update, not after it
                return out

            reset, stats = await asyncio.gather(reset_cache(), eng.load_weights(info, policy_version))
            returned = stamps["update_return"] = time.time()
            recv_s = time.perf_counter() - t
            lap("update_s")
            # The update call's ends, as the worker stamped them: getting into the worker (the engine
            # core's loop picking the call up) and the answer coming back.
            if "worker_in_unix_s" in stats:
                phases["rpc_in_s"] = max(0.0, stats["worker_in_unix_s"] - called)
                phases["rpc_out_s"] = max(0.0, returned - stats["worker_out_unix_s"])
            if reset is False:  # blocks still held (requests frozen in keep mode)
                log.info("version %d: vLLM kept its prefix cache (blocks in use); requests are salted by "
                         "version, so none reuses another version's KV", policy_version)
        except BaseException as e:
            await self._update_failed(e, policy_version, key)
            raise
        self._worker_layout = key
        if stats.get("cancelled"):  # an armed receive called off before any byte moved: nothing changed
            await self._resume()
            lap("resume_s")
            return m, recv_s, stats
        self.version = policy_version  # before resuming: every token from here on is this version's
        self._cut_at_pause(policy_version)
        self._weights_loaded.set()
        await self._resume()
        lap("resume_s")
        return m, recv_s, stats

    async def _quiesce(self) -> None:
        """Before a load: this actor's submissions are in, its requests aborted (resubmit mode) and the
        rest frozen where any are in flight."""
        eng = self._engine
        await self._await_submissions()
        if self._mode == "resubmit" and self._live:
            # Each aborted request ends with the tokens vLLM's front end holds, all sampled by the
            # version being replaced; its task continues it on the new weights (_run_sample).
            rids = list(self._live)
            self._aborted_by_sync.update(rids)
            await eng.abort(rids)
        # Requests still in flight freeze (keep mode; in resubmit mode only the OpenAI server's,
        # whose responses carry version bounds). AsyncLLM.pause_generation is this call plus a
        # 20 ms sleep that only lets outputs of aborted or drained requests arrive first (vLLM:
        # "not required for correctness"); the sleep was a fifth of a long-tail step's time.
        if not self._paused and (self.stats["http_inflight"] or eng.num_unfinished()
                                 or (self._mode == "keep" and self._active)):
            await eng.pause_in_place()
            self._paused = True
            self.stats["pauses"] += 1
        # Keep mode: how many tokens each frozen request holds, all sampled by the weights being
        # replaced (vLLM completes a keep pause only with its engine core idle, every step's output
        # sent); each response is cut there once the load went through (_cut_at_pause).
        self._pause_counts = (await eng.output_counts() if self._mode == "keep" and self._paused
                              and self._live else None)

    def _cut_at_pause(self, policy_version: int) -> None:
        """Keep mode, ``policy_version`` loaded: every response frozen for it continues on it from its
        count at the pause."""
        counts, self._pause_counts = self._pause_counts, None
        for internal_id, count in (counts or {}).items():
            sample = self._engine.sample_of(internal_id, self._live)
            if sample is not None:  # not the OpenAI server's
                cuts = self._cuts.setdefault(sample, [])
                cuts.append((count, policy_version))
                self.stats["counted_cuts"] += 1
                rid = sample[0]
                if rid in self._started:  # may be dropped once stale: its oldest token, for _drop_stale
                    first = first_token_version(self._started[rid], cuts)
                    if first is not None:
                        self._oldest[rid] = min(self._oldest.get(rid, first), first)

    def _drop_stale(self, loaded: int, max_staleness: int) -> int:
        """Version ``loaded`` serves: stop each request that may be dropped (``GenRequest.stale_drop``)
        whose oldest token is more than ``max_staleness`` versions older. No step can train it: every
        step from here on trains ``loaded`` or a later version, and a sample's staleness is that minus
        its oldest token's version; the engine's time goes to groups that can still be trained. Its
        request is aborted in vLLM and answered ``dropped="stale"``. Returns how many."""
        stopped = 0
        for rid, oldest in list(self._oldest.items()):
            task = self._droppable.get(rid)
            if loaded - oldest > max_staleness and task is not None and rid not in self._stale:
                self._stale[rid] = (oldest, loaded)
                task.cancel()
                stopped += 1
        self.stats["dropped_stale_in_flight"] += stopped
        if stopped:
            log.debug("version %d: %d request(s) past max_staleness=%d stopped", loaded, stopped, max_staleness)
        return stopped

    async def _update_failed(self, e: BaseException, policy_version: int, key: str) -> None:
        """The update call into the worker raised ``e``: a version whose checksums failed before anything
        was loaded is rejected (``ChecksumError``; the previous one serves on); otherwise the model may
        hold part of a version, so the gate closes and requests stay paused until a sync completes
        (the caller re-raises ``e``)."""
        rejected = (await self.get_transfer_stats()).get("rejected") if self._engine is not None else None
        if rejected and self._weights_loaded.is_set():
            self._worker_layout = key
            await self._resume()
            await self._report_state("READY", f"rejected version {policy_version}: {rejected}"[:500])
            raise ChecksumError(f"engine {self.engine_id}: {rejected}") from e
        self._weights_loaded.clear()
        await self._report_state("WAITING_FOR_WEIGHTS", f"sync of version {policy_version} failed: {e}"[:500])

    async def _resume(self) -> None:
        if self._paused:
            await self._engine.resume()
            self._paused = False

    async def param_checksums(self) -> dict[str, list[int]]:
        """Worker 0's bit checksum of each parameter the engine holds (``disagg_param_checksums``): the
        check that a sync left every parameter equal to the trainer's, bit for bit (the GPU tests)."""
        return (await self._engine.worker_call("disagg_param_checksums"))[0]
