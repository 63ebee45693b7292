"""The engine seam (``disagg.rollout.backend.EngineBackend``): every backend implements the whole
protocol with its signatures, and the engine actor's own logic runs against any backend that keeps
the protocol's contract. A fake backend here (no vLLM: the real one is proven by the integration
tests and the GPU suite) checks what the actor does with an engine's outputs: the gate holds a
request until weights are loaded, each sample's tokens carry the version that served them, a piece a
sync aborted is continued on the new weights with its KV kept, and the engine's own labels are
checked against the versions the actor knows."""

from __future__ import annotations

import asyncio
import inspect

import pytest

from disagg.config.schema import RolloutConfig
from disagg.errors import RolloutError
from disagg.rollout.backend import EngineBackend
from disagg.rollout.engine import EngineActor
from disagg.rollout.types import EngineOutput, GenRequest, SampleOutput, SamplingSpec


def _protocol_methods() -> dict[str, inspect.Signature]:
    return {name: inspect.signature(fn) for name, fn in vars(EngineBackend).items()
            if callable(fn) and not name.startswith("_")}


def test_the_vllm_backend_implements_the_whole_protocol_with_its_signatures():
    from disagg.rollout.vllm.backend import VllmBackend

    missing, differ = [], []
    for name, sig in _protocol_methods().items():
        impl = getattr(VllmBackend, name, None)
        if impl is None:
            missing.append(name)
            continue
        want = [p.name for p in sig.parameters.values()]
        got = [p.name for p in inspect.signature(impl).parameters.values()]
        if inspect.iscoroutinefunction(impl) != inspect.iscoroutinefunction(getattr(EngineBackend, name)) or (
                got != want and "kw" not in got):
            differ.append(f"{name}{inspect.signature(impl)} vs {sig}")
    assert not missing and not differ, f"missing {missing}; differ {differ}"


class FakeBackend:
    """Samples the token 7 + version, one per call, and finishes at ``max_tokens``; a request still
    running when ``abort`` comes finishes with 'abort' after the tokens it had; labels tokens with
    the version loaded (like vLLM 0.32) when ``labels``."""

    name = "fake"

    def __init__(self, labels: bool = True) -> None:
        self.loaded = 1
        self.labels = labels
        self.requests: dict[str, dict] = {}
        self.aborted: set[str] = set()
        self.submitted: list[tuple[str, list[int], str]] = []

    def start_report(self):
        return {}

    async def token_version_sources(self):
        return ["labels"] if self.labels else []

    def sampling(self, *, n, max_tokens, temperature, top_p, seed, ignore_eos):
        return {"n": n, "max_tokens": max_tokens}

    async def submit(self, request_id, prompt_ids, params, cache_salt):
        self.submitted.append((request_id, list(prompt_ids), cache_salt))
        self.requests[request_id] = {"params": params, "tokens": [], "versions": [], "done": asyncio.Event()}
        return request_id

    async def final_output(self, handle):
        req = self.requests[handle]
        while len(req["tokens"]) < req["params"]["max_tokens"] and handle not in self.aborted:
            await asyncio.sleep(0.01)
            if handle not in self.aborted:
                req["tokens"].append(7 + self.loaded)
                req["versions"].append(self.loaded)
        reason = "abort" if handle in self.aborted else "length"
        return EngineOutput([SampleOutput(0, list(req["tokens"]), [-0.5] * len(req["tokens"]), reason,
                                          list(req["versions"]) if self.labels else None)],
                            cached_tokens=4 if handle.endswith(".1") else 0)

    async def abort(self, request_ids):
        self.aborted.update(request_ids)

    def num_unfinished(self):
        return sum(1 for r in self.requests if r not in self.aborted)


def _actor(backend: FakeBackend, mode: str = "resubmit") -> EngineActor:
    actor = EngineActor(0, "/nonexistent", RolloutConfig(weights_wait_timeout_s=30.0, max_model_len=64), None,
                        rpc_timeout_s=5.0)
    actor._engine = backend
    actor._mode = mode
    return actor


def _request(max_tokens: int) -> GenRequest:
    return GenRequest("r", [1, 2, 3], SamplingSpec(max_tokens=max_tokens, temperature=1.0, n=1))


def test_a_request_waits_for_weights_and_its_tokens_carry_the_version_that_served_them():
    backend = FakeBackend()
    actor = _actor(backend)

    async def main():
        task = asyncio.ensure_future(actor._run_sample(_request(3), 0))
        await asyncio.sleep(0.1)
        assert not backend.submitted, "a request reached the engine before any weights"
        actor.version = 1
        actor._weights_loaded.set()
        return await asyncio.wait_for(task, 10)

    comp = asyncio.run(main())
    assert comp.response_ids == [8, 8, 8] and comp.token_versions == [1, 1, 1] and comp.finish_reason == "length"
    assert backend.submitted == [("r/0", [1, 2, 3], "v1")]


def test_a_piece_a_sync_aborted_goes_on_from_its_tokens_on_the_new_weights_with_its_kv_kept():
    backend = FakeBackend()
    actor = _actor(backend)
    actor.version = 1
    actor._weights_loaded.set()

    async def main():
        task = asyncio.ensure_future(actor._run_sample(_request(6), 0))
        while len(backend.requests.get("r/0", {}).get("tokens", [])) < 2:
            await asyncio.sleep(0.005)
        # what a resubmit-mode sync does (EngineSync._quiesce, then the load)
        actor._not_loading.clear()
        actor._aborted_by_sync.update(["r/0"])
        await backend.abort(["r/0"])
        await asyncio.sleep(0.05)
        backend.loaded = actor.version = 2
        actor._not_loading.set()
        return await asyncio.wait_for(task, 10)

    comp = asyncio.run(main())
    first = comp.token_versions.count(1)
    assert first >= 2 and comp.token_versions == [1] * first + [2] * (6 - first)
    assert comp.response_ids == [8] * first + [9] * (6 - first)
    cont = backend.submitted[1]
    assert cont[0] == "r/0.1" and cont[1] == [1, 2, 3] + [8] * first and cont[2] == "v1"  # its chain's salt
    assert comp.pieces == [(first, 4)] and actor.stats["resubmits"] == 1


def test_an_engine_label_that_disagrees_with_the_actors_version_is_an_error():
    backend = FakeBackend()
    actor = _actor(backend)
    actor.version = 3  # the actor serves version 3, the engine labels its tokens 1
    actor._weights_loaded.set()
    with pytest.raises(RolloutError, match="served as version 3 but the engine labels its tokens"):
        asyncio.run(actor._run_sample(_request(2), 0))
