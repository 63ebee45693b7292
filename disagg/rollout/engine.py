"""The rollout engine: one Ray actor running an inference engine (``rollout.engine``: vLLM's
AsyncLLM, or SGLang's Engine) behind the engine seam (``rollout/backend.py``).

The engine starts on dummy weights and must never answer a request with them:
every generation waits on ``_weights_loaded``, an event only a completed weight
sync sets (or, in standalone ``load_format=auto`` mode, the real checkpoint
load). Weight syncs go through vLLM's native weight-transfer API with the
``disagg`` backend (``vllm/transfer.py``); the manifest comes from the
coordinator, and the engine acknowledges each version it then serves.

What a sync does with requests in flight is ``rollout.in_flight_at_sync``:
'keep' freezes them (vLLM's pause, keep mode) and they continue on the new
weights, each response cut where the engine core counted its tokens at the pause
(``cut_versions``; where vLLM labels each token with the version that sampled it,
the labels must agree); 'resubmit' aborts this actor's requests and continues each
on the new weights from the tokens it had, so that each piece of a response comes
from one version the actor knows. 'auto' keeps where vLLM labels tokens
(``resolve_in_flight_mode``) and resubmits where it does not. A resubmitted piece carries its
request's cache salt, so vLLM's prefix cache gives back the KV its earlier pieces
computed (each full block's KV from the weights that fed it, as in keep mode) and
the new weights prefill only the last, partial block; each ``Completion.pieces``
says how much KV a piece took over.

The engine is reached only through its ``EngineBackend``, whose class ``disagg.rollout.engines``
names (vLLM's in ``disagg.rollout.vllm``, SGLang's in ``disagg.rollout.sglang``); this module and
its part ``engine_receive`` (the weight receive) import no engine. The benchmarks' routes are a
subclass's, ``disagg.bench.actors.BenchEngineActor``; a training run's engine has none.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from disagg.cluster import freeze_heap, pin_process
from disagg.config import RolloutConfig, TransportConfig
from disagg.errors import ConfigError, EngineDeadError, RolloutError
from disagg.logs import await_logged, setup_logging
from disagg.rollout.engine_receive import EngineSync
from disagg.rollout.types import Completion, GenRequest, GenResult, SamplingSpec
from disagg.storage import local_copy
from disagg.transport.manifest import ManifestCache

log = logging.getLogger("disagg.rollout")



def model_tensor_specs(model_path: str) -> tuple:
    """The parameters of ``model_path``'s architecture as a trainer names them (HF), built on the
    meta device (no memory, no weights read). The coordinator refuses a version whose manifest
    disagrees, before any byte is sent. Empty (not checked) if transformers cannot build it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from disagg.transport.manifest import TensorSpec

    try:
        config = AutoConfig.from_pretrained(model_path)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as e:  # noqa: BLE001 - an architecture HF cannot build here: the check is skipped, said once
        log.warning("cannot build %s on the meta device (%s): weight manifests are not checked against it",
                    model_path, e)
        return ()
    return tuple(TensorSpec(n, tuple(p.shape), str(p.dtype).removeprefix("torch.")) for n, p in model.named_parameters())


def cut_versions(request_id: str, start: int, cuts: list[tuple[int, int]], num_tokens: int) -> list[int]:
    """Each of a kept response's ``num_tokens`` tokens' version: ``start`` (the version it started on)
    until the first cut, where each cut is (its tokens when a sync paused it, the version that sync
    loaded). Pure."""
    versions: list[int] = []
    version = start
    for count, loaded in cuts:
        if not len(versions) <= count <= num_tokens:
            raise RolloutError(f"request {request_id}: paused at {count} tokens after {len(versions)}, "
                               f"ended with {num_tokens} (cuts {cuts})")
        versions += [version] * (count - len(versions))
        version = loaded
    return versions + [version] * (num_tokens - len(versions))


def resolve_in_flight_mode(requested: str, labels: bool, counts: bool) -> str:
    """``rollout.in_flight_at_sync`` for this engine: 'keep' or 'resubmit' (pure). Keep needs either
    vLLM's token labels or the engine core's counts (``output_counts``: responses cut at the pauses);
    'auto' keeps where it has one of them (every engine with disagg's vLLM plugin: 0.26 and 0.32),
    and resubmits where it has neither; an explicit 'keep' there is a configuration error."""
    if requested == "auto":
        return "keep" if labels or counts else "resubmit"
    if requested == "keep" and not (labels or counts):
        raise ConfigError("rollout.in_flight_at_sync='keep' needs token versions: this vLLM labels no token and "
                          "its engine core lacks disagg's output counts (the disagg vLLM plugin is not loaded "
                          "there: is it left out of VLLM_PLUGINS?); use 'resubmit' or 'auto'")
    return requested


class EngineActor(EngineSync):
    """A vLLM engine behind a weights-loaded gate. Wrapped with ``ray.remote`` by the pool. Its weight
    receive is ``EngineSync``'s (``rollout/engine_receive.py``).
    Over 400 lines on purpose: a request's life in vLLM (submitted, kept or resubmitted across syncs,
    cut into versions) is one concern, and its methods share the request state kept here."""

    def __init__(self, engine_id: int, model_path: str, cfg: RolloutConfig, coordinator: Any,
                 rpc_timeout_s: float, seed: int = 0, log_level: str = "INFO",
                 transport_cfg: TransportConfig | None = None, cache_dir: str = "~/.cache/disagg",
                 api_key: str | None = None):
        setup_logging(f"rollout:{engine_id}", log_level, actor=True)
        pin_process(cfg.cpu_affinity, f"engine {engine_id}")
        self.engine_id = engine_id
        # A local model directory, or a checkpoint at an fsspec URL: this node's copy of it.
        self.model_path = str(local_copy(model_path, cache_dir))
        self.cfg = cfg
        self.api_key = api_key  # the OpenAI API asks it of requests off loopback
        self.transport_cfg = transport_cfg or TransportConfig()
        self.seed = seed
        self.version = 0  # 0 = dummy weights, never served
        self._weights_loaded = asyncio.Event()
        # Cleared while a sync loads: new requests wait, so an engine with nothing in flight
        # loads without pausing vLLM (a pause and resume cost two round trips to its engine core).
        self._not_loading = asyncio.Event()
        self._not_loading.set()
        self._active = 0  # requests of this actor past the gate and not finished
        self._paused = False  # vLLM's scheduler paused (keep) by a sync, until one completes
        # Requests past the gate whose add to vLLM has not returned yet: a sync waits for them, so
        # that every request it must pause or abort is in vLLM's front end by then.
        self._submitting = 0
        self._submitted = asyncio.Event()
        self._submitted.set()
        self._mode = "keep"  # rollout.in_flight_at_sync as resolved for this vLLM (start())
        self._version_sources: list[str] = []  # where tokens' versions come from here: labels, counts (start())
        self._live: set[str] = set()  # this actor's request ids in vLLM
        self._aborted_by_sync: set[str] = set()  # resubmit mode: of those, the ones a sync aborted (to continue)
        # keep mode: (request id, sample) -> (its tokens when a sync paused it, the version loaded then)
        self._cuts: dict[tuple[str, int], list[tuple[int, int]]] = {}
        self._pause_counts: dict[str, int] | None = None  # the engine core's counts at this sync's pause
        # Requests that may be dropped once stale (GenRequest.stale_drop): request id -> its task, the
        # version each started on (keep mode), its oldest token's version where known, and the ones a
        # sync stopped: request id -> (oldest token's version, the version loaded then).
        self._droppable: dict[str, asyncio.Task] = {}
        self._started: dict[str, int] = {}
        self._oldest: dict[str, int] = {}
        self._stale: dict[str, tuple[int, int]] = {}
        self._engine = None
        self._manifest_cache = ManifestCache()  # the last manifest received (a sync of its layout may name it)
        self._worker_layout: str | None = None  # the layout digest vLLM's worker holds the manifest of
        self._http_at_reset = 0  # stats["http_requests"] when vLLM's prefix cache was last reset
        self._coord = None
        self._registered = False
        # gRPC to the coordinator from one thread, in order: state reports need no wait (the
        # actor's event loop goes on generating), acks are awaited without blocking it.
        self._control = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"control-{engine_id}")
        self._draining = False  # scaled down: finishing its groups, takes no new ones
        if coordinator is not None:  # a CoordinatorClient (address, token, TLS root), or "host:port"
            from disagg.control.client import CoordinatorClient

            self._coord = (coordinator if isinstance(coordinator, CoordinatorClient)
                           else CoordinatorClient(coordinator, timeout_s=rpc_timeout_s))
        self.stats = {"requests": 0, "dropped_prompt_too_long": 0, "tokens_generated": 0, "pauses": 0, "streams": 0,
                      "resubmits": 0, "resubmit_kv_kept_tokens": 0, "resubmit_prefill_tokens": 0,
                      "requests_cancelled": 0, "http_requests": 0, "http_inflight": 0, "http_waiting": 0,
                      "counted_cuts": 0, "dropped_stale_in_flight": 0}
        self.address = ""  # the OpenAI API's base address (http://host:port), once serving
        self._http = None  # (uvicorn server, its task, its WeightsGate)

    # ---- lifecycle -------------------------------------------------------------------
    async def start(self) -> dict[str, Any]:
        """Start the engine (``rollout.engine``; dummy weights unless load_format=auto). Returns start info."""
        import ray

        from disagg.rollout.engines import backend_class

        t0 = time.perf_counter()
        self._engine = backend_class(self.cfg.engine).start(self.cfg, self.model_path, self.seed)
        # Where each token's weight version can come from (the engine's labels, its counts at each
        # pause); keep mode needs one of them.
        self._version_sources = await self._engine.token_version_sources()
        self._mode = self._resolve_in_flight_mode(self.cfg.in_flight_at_sync)
        node = ray.util.get_node_ip_address()
        if self.cfg.openai_api:
            await self._start_http(node)
        start_s = time.perf_counter() - t0
        if self.cfg.load_format == "auto":
            self.version = 1
            await self._engine.set_served_version(1)
            self._weights_loaded.set()
            self._report_state("READY")
        else:
            self._report_state("WAITING_FOR_WEIGHTS")
        if self._coord is not None:
            from disagg.control.types import EngineInfo, EngineState

            state = EngineState.READY if self._weights_loaded.is_set() else EngineState.WAITING_FOR_WEIGHTS
            self._coord.register_engine(EngineInfo(self.engine_id, node, os.getpid(), self.address, state,
                                                   model_tensor_specs(self.model_path)))
            self._registered = True
        freeze_heap(f"engine {self.engine_id}")
        report = self._engine.start_report()
        import torch._dynamo

        dynamo = "off" if torch._dynamo.config.disable else "on"  # (the pool's engine environment)
        log.info("engine started in %.1fs (%s, load_format=%s, in-flight requests at a sync: %s, "
                 "engine core %s, torch dynamo %s)", start_s, self._engine.name, self.cfg.load_format,
                 self._mode, report.get("engine_core_start") or "elsewhere", dynamo)
        return {"engine_id": self.engine_id, "start_s": start_s, "node_ip": node, "pid": os.getpid(),
                "address": self.address, "node_id": ray.get_runtime_context().get_node_id(),
                "in_flight_at_sync": self._mode, "token_version_sources": self._version_sources, "dynamo": dynamo,
                **report}

    def _resolve_in_flight_mode(self, requested: str) -> str:
        """``requested`` resolved for this engine's token-version sources (found once, at start)."""
        return resolve_in_flight_mode(requested, "labels" in self._version_sources, "counts" in self._version_sources)

    async def _start_http(self, node_ip: str) -> None:
        """Serve vLLM's OpenAI API from this actor, behind the weights-loaded gate."""
        from disagg.rollout.openai_server import ServerAccess, start_openai_server

        c = self.cfg
        access = ServerAccess(node_ip if c.api_host == "node" else c.api_host,
                              c.api_port_base + self.engine_id if c.api_port_base else 0, self.api_key,
                              c.api_tls_cert and os.path.expanduser(c.api_tls_cert),
                              c.api_tls_key and os.path.expanduser(c.api_tls_key))
        # Ready (``/health``) while real weights are loaded: a sync in progress keeps it ready (its
        # requests wait at the gate a moment), a failed one that leaves part of a version does not.
        app = await self._engine.openai_app(c.served_model_name, c.tool_call_parser)
        server, task, self.address, gate = await start_openai_server(
            app, served_model_name=c.served_model_name, access=access,
            tool_call_parser=c.tool_call_parser, wait_weights=self._wait_weights,
            ready=self._weights_loaded.is_set, version=lambda: self.version, counters=self.stats)
        self._http = (server, task, gate)

    def _servable(self) -> bool:
        return self._weights_loaded.is_set() and self._not_loading.is_set()

    async def _wait_weights(self, what: str) -> None:
        """Block until real weights are loaded (the guard against serving dummy weights) and no sync
        is loading. Callers count their request as in flight right after, with no await between:
        this returns only from a check of the gate made in the caller's task. (The logged wait runs
        in a task of its own, and a sync can start between that task's end and the caller's turn: a
        request let through then was submitted during the sync, missed by its abort or its count,
        and its tokens of the new weights were tagged with the old version.)"""
        async def opened() -> None:
            await self._weights_loaded.wait()
            await self._not_loading.wait()

        deadline = time.monotonic() + self.cfg.weights_wait_timeout_s
        while not self._servable():  # a sync may have closed it again before this task's turn
            await await_logged(opened(), what=what, timeout_s=max(0.0, deadline - time.monotonic()),
                               log=log, interval_s=self.cfg.wait_log_interval_s)

    async def shutdown(self) -> None:
        if self._http is not None:
            server, task, _ = self._http
            server.should_exit = True
            await asyncio.wait({task}, timeout=5.0)
            self._http = None
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
        self._control.shutdown(wait=False)

    async def set_draining(self, draining: bool, reason: str) -> None:
        """The driver stopped (or resumed) giving this engine prompts: while draining it reports
        DRAINING until it leaves the pool."""
        self._draining = draining
        if self._weights_loaded.is_set():
            await self._report_state("DRAINING" if draining else "READY", reason)

    def _report_state(self, state: str, message: str = "") -> asyncio.Future:
        """Tell the coordinator this engine's state (from the control thread, in order with acks).
        Await the result to know it arrived; a report nobody awaits that fails is logged."""
        if self._coord is None or not self._registered:
            done = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done
        from disagg.control.types import EngineState

        if self._draining and state in ("READY", "SYNCING"):  # still synced while a member; still leaving
            state = "DRAINING"
        fut = self._control_call(self._coord.update_engine_state, self.engine_id, EngineState(state), message)

        def failed(f: asyncio.Future) -> None:
            if not f.cancelled() and f.exception() is not None:
                log.warning("engine state report %s failed: %s", state, f.exception())

        fut.add_done_callback(failed)
        return fut

    def _control_call(self, fn, *args) -> asyncio.Future:
        return asyncio.wrap_future(self._control.submit(fn, *args))

    # ---- weight sync -----------------------------------------------------------------
    async def init_transport(self, *, groups: list[list], world_size: int, rank_offset: int, backend: str,
                             timeout_s: float, signals: str = "store") -> None:
        """Join the transport groups ([host, port, name] each; run concurrently with the trainer's join);
        ``signals``: how their words travel (``transport.signals``, as the driver says)."""
        info = dict(groups=groups, world_size=world_size, rank_offset=rank_offset, backend=backend,
                    timeout_s=timeout_s, source=self.transport_cfg.source,
                    num_buffers=self.transport_cfg.num_buffers, verify=self.transport_cfg.verify,
                    load=self.transport_cfg.load, delta=self.transport_cfg.delta != "off",
                    high_priority=self.transport_cfg.nccl_high_priority, signals=signals)
        await self._engine.join_transport(info)

    async def ping(self) -> dict[str, Any]:
        """The driver's health check: vLLM's own (raises once its engine core died) and what it serves."""
        if self._engine is None:
            raise EngineDeadError(f"engine {self.engine_id} is not running")
        await self._engine.check_health()
        return {"policy_version": self.version, "tokens_generated": self.stats["tokens_generated"]}

    async def arm_fault(self, point: str, action: str = "exit", after: int = 1) -> None:
        """Fault-injection tests: make this engine's model worker fail for real at ``point``
        (``disagg.faults``; armed in the worker's process, wherever vLLM runs it)."""
        await self._engine.worker_call("disagg_arm_fault", point, action, after)

    async def get_version(self) -> dict[str, Any]:
        served = await self._engine.served_version() if self._engine is not None else None
        return {"policy_version": self.version, "vllm_weight_version": served, "loaded": self._weights_loaded.is_set()}

    # ---- generation ------------------------------------------------------------------
    async def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        """Serve a list of prompts concurrently; each waits for real weights first."""
        return list(await asyncio.gather(*(self._generate_one(r) for r in requests)))

    async def generate_stream(self, requests: list[GenRequest]):
        """Serve a wave of prompts concurrently and yield each one's result as it completes.

        The driver calls this once per engine per admission wave, as a Ray streaming call
        (``num_returns="streaming"``): one call delivers a step's groups together, so vLLM
        schedules them in one batch instead of as they trickle in one actor call at a time,
        and finished groups still reach the driver at once (long tails). If one request
        fails the stream ends with its error and the others are aborted.
        """
        self.stats["streams"] += 1
        tasks = [asyncio.ensure_future(self._generate_one(r)) for r in requests]
        try:
            for done in asyncio.as_completed(tasks):
                yield await done
        finally:
            for t in tasks:
                t.cancel()

    async def _generate_one(self, req: GenRequest) -> GenResult:
        self.stats["requests"] += 1
        if len(req.prompt_ids) >= self.cfg.max_model_len:
            self.stats["dropped_prompt_too_long"] += 1
            detail = f"prompt of {len(req.prompt_ids)} tokens >= rollout.max_model_len={self.cfg.max_model_len}"
            log.warning("dropping request %s: %s", req.request_id, detail)
            return GenResult(req.request_id, self.engine_id, list(req.prompt_ids), dropped="prompt_too_long", detail=detail)
        s = req.sampling
        if req.stale_drop:
            self._droppable[req.request_id] = asyncio.current_task()
        try:
            if self._mode == "keep":
                ordered = await self._generate_kept(req)
            else:  # one vLLM request per sample: each continues alone after a sync
                ordered = list(await asyncio.gather(*(self._run_sample(req, i) for i in range(s.n))))
        except asyncio.CancelledError:  # its caller cancelled it (a run that ended): aborted in vLLM
            if req.request_id in self._stale:  # stopped by a sync (_drop_stale): aborted in vLLM too
                asyncio.current_task().uncancel()
                oldest, loaded = self._stale[req.request_id]
                return GenResult(req.request_id, self.engine_id, list(req.prompt_ids), [], oldest, loaded,
                                 dropped="stale", detail=f"its oldest token is version {oldest}, version {loaded} "
                                 "is loaded: no step can train it within the staleness limit")
            self.stats["requests_cancelled"] += 1
            raise
        except ValueError as e:  # vLLM's own input validation
            self.stats["dropped_invalid_prompt"] = self.stats.get("dropped_invalid_prompt", 0) + 1
            log.warning("dropping request %s: %s", req.request_id, e)
            return GenResult(req.request_id, self.engine_id, list(req.prompt_ids), dropped="invalid_prompt", detail=str(e))
        finally:
            for book in (self._droppable, self._started, self._oldest, self._stale):
                book.pop(req.request_id, None)
        for c in ordered:
            if len(c.logprobs) != len(c.response_ids):
                raise RolloutError(f"request {req.request_id}: {len(c.response_ids)} tokens but "
                                   f"{len(c.logprobs)} log-probs from the engine")
            self.stats["tokens_generated"] += len(c.response_ids)
        versions = [v for c in ordered for v in c.token_versions]
        low = min(versions, default=self.version)
        return GenResult(req.request_id, self.engine_id, list(req.prompt_ids), ordered, low, max(versions, default=low))

    def _params(self, s: SamplingSpec, n: int, max_tokens: int, seed: int | None):
        return self._engine.sampling(n=n, max_tokens=max_tokens, temperature=0.0 if s.greedy else s.temperature,
                                        top_p=1.0 if s.greedy else s.top_p, seed=seed, ignore_eos=s.ignore_eos)

    async def _run(self, request_id: str, prompt_ids: list[int], params, what: str, salt: int | None = None,
                   start: bool = False):
        """Wait for servable weights, submit, and return vLLM's final output. Returns with
        ``self.version`` as it was when the request passed the gate (a version its tokens keep
        in resubmit mode, where a sync aborts the request before loading another). ``salt``: the
        version whose prefix-cache chain the request continues (default: the one it passes with).
        ``start``: a kept request that may be dropped once stale: its start version is noted for the
        syncs' cuts (``_drop_stale``)."""
        # Guard against dummy weights: nothing is submitted to vLLM before a sync lands.
        await self._wait_weights(what)
        version = self.version
        if start:
            self._started[request_id] = version
        # No await between the gate and these counts: a sync starting from here on waits for the
        # submission, then pauses vLLM (keep) or aborts the request (resubmit).
        self._active += 1
        self._submitting += 1
        self._submitted.clear()
        try:
            try:
                # Salted by version: a new request never reuses KV that other weights computed, even
                # where vLLM could not empty its prefix cache at the sync.
                handle = await self._engine.submit(request_id, prompt_ids, params,
                                               f"v{version if salt is None else salt}")
            finally:
                self._submitting -= 1
                if not self._submitting:
                    self._submitted.set()
            self._live.add(request_id)
            try:
                return await self._engine.final_output(handle), version
            finally:
                self._live.discard(request_id)
        finally:
            self._active -= 1

    async def _await_submissions(self) -> None:
        await await_logged(self._submitted.wait(), what="requests being added to vLLM", log=log,
                           timeout_s=self.cfg.weights_wait_timeout_s, interval_s=self.cfg.wait_log_interval_s)

    async def _generate_kept(self, req: GenRequest) -> list[Completion]:
        """All samples in one vLLM request, paused (not aborted) across syncs. Each token's version:
        the one the request started on up to the engine core's count of its tokens at the first
        sync's pause, then the version that sync loaded, and so on (``_cuts``); where vLLM labels
        tokens with their versions too, the two must agree."""
        s = req.sampling
        try:
            out, version = await self._run(req.request_id, list(req.prompt_ids),
                                           self._params(s, s.n, s.max_tokens, s.seed),
                                           f"first weights (request {req.request_id})", start=req.stale_drop)
            cuts = {i: self._cuts.get((req.request_id, i), []) for i in range(s.n)}
        finally:
            for i in range(s.n):
                self._cuts.pop((req.request_id, i), None)
        comps: dict[int, Completion] = {}
        for o in out.samples:
            versions = cut_versions(req.request_id, version, cuts.get(o.index, []), len(o.token_ids))
            if o.labels is not None and o.labels != versions:
                raise RolloutError(f"request {req.request_id} sample {o.index}: the engine labels its tokens "
                                   f"{o.labels}, its pauses cut it into {versions}")
            comps[o.index] = Completion(list(o.token_ids), list(o.logprobs), o.finish_reason, versions)
        if len(comps) != s.n:
            raise EngineDeadError(f"engine {self.engine_id} returned {len(comps)} of {s.n} samples for {req.request_id}")
        return [comps[i] for i in sorted(comps)]

    async def _run_sample(self, req: GenRequest, index: int) -> Completion:
        """Sample ``index`` of ``req`` in resubmit mode: a sync aborts it and it continues on the new
        weights from its tokens so far. Every piece's tokens carry the version that served the piece.

        A continuation keeps its request's cache salt (the version its KV chain started with): vLLM's
        prefix cache then holds the full blocks of the prompt and tokens so far as the weights that
        fed them computed them, and the new weights prefill only the rest (vLLM recomputes at least
        the last token). That is keep mode's rule for the KV of every full block (the partial one is
        the new weights'), at the cost of a partial block per sync instead of the whole context;
        a continuation whose context ends at a block's end computes that block again, and a later one
        takes whichever copy vLLM cached first (docs/design.md, "resubmit"). A
        piece that made no token starts a fresh chain on the new weights (its own prefill may have
        stopped half way). ``Completion.pieces``: for each continuation, (the response tokens it
        started from, the prompt + response positions whose KV it took over; 0 for a fresh chain, and
        for a piece aborted before vLLM scheduled it)."""
        s = req.sampling
        ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        pieces: list[tuple[int, int]] = []
        piece = 0
        chain: int | None = None  # the salt (a version) of the KV chain this sample continues
        while True:
            budget = s.max_tokens - len(ids)
            if piece and (budget <= 0 or len(req.prompt_ids) + len(ids) >= self.cfg.max_model_len):
                return Completion(ids, logprobs, "length", versions, pieces=pieces)  # full when the sync stopped it
            rid = f"{req.request_id}/{index}" + (f".{piece}" if piece else "")
            seed = None if s.seed is None else s.seed + 7919 * index + piece
            out, version = await self._run(rid, list(req.prompt_ids) + ids, self._params(s, 1, budget, seed),
                                           f"weights (request {rid})", salt=chain)
            (o,) = out.samples
            new = list(o.token_ids)
            if piece:
                kept = out.cached_tokens if chain is not None else 0
                pieces.append((len(ids), kept))
                if new:  # its prefill completed (one aborted before a token may not have been scheduled at all)
                    self.stats["resubmit_kv_kept_tokens"] += kept
                    self.stats["resubmit_prefill_tokens"] += len(req.prompt_ids) + len(ids) - kept
            if o.labels is not None and any(v != version for v in o.labels):  # the engine's own, where it has them
                raise RolloutError(f"request {rid}: served as version {version} but the engine labels its tokens "
                                   f"{o.labels}")
            # A piece that made tokens completed its prefill: its chain holds every block before them.
            chain = (version if chain is None else chain) if new else None
            if new and req.stale_drop:  # this sample's oldest token, for the syncs (_drop_stale)
                self._oldest[req.request_id] = min(self._oldest.get(req.request_id, version), version)
            ids += new
            logprobs += o.logprobs
            versions += [version] * len(new)
            if o.finish_reason == "abort" and rid in self._aborted_by_sync:
                self._aborted_by_sync.discard(rid)
                self.stats["resubmits"] += 1
                piece += 1
                continue
            self._aborted_by_sync.discard(rid)
            return Completion(ids, logprobs, o.finish_reason, versions, pieces=pieces)

    async def get_transfer_stats(self) -> dict[str, Any]:
        """What the receiver in the model's process counted for the last sync."""
        return (await self._engine.worker_call("disagg_transfer_stats"))[0]

    async def placement_group_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_placement_group_id()

    async def get_stats(self) -> dict[str, Any]:
        import gc

        made = self._engine.tokens_generated() if self._engine else None
        return dict(self.stats, policy_version=self.version, address=self.address,
                    gc_frozen_objects=gc.get_freeze_count(),
                    unfinished_requests=self._engine.num_unfinished() if self._engine else 0,
                    # vLLM's count: every token sampled, where tokens_generated counts finished responses'
                    **({"vllm_generation_tokens": made} if made is not None else {}))

    async def get_address(self) -> str:
        """The OpenAI API base address (``http(s)://host:port``; append ``/v1``), empty if not serving."""
        return self.address

    async def get_http_routes(self) -> list[dict[str, Any]]:
        """Every route of the OpenAI server as built and what its gate does with each (``openai_server``)."""
        if self._http is None:
            raise RolloutError(f"engine {self.engine_id} serves no OpenAI API (rollout.openai_api=false)")
        return self._http[2].routes()
