"""SGLang behind the engine seam, without SGLang (it publishes no CPU build; the GPU suite runs the real
one: ``tests/gpu/test_sglang_engine.py``): the key that picks it and what it refuses, the registry that
gives the engine actor its backend and environment, the backend's shape and its reading of SGLang's
outputs, and the weight path - disagg's scheduler methods (``rollout/sglang/hook.py``) on a stand-in of
SGLang's scheduler whose model runner holds a small torch model, taking a real sync from a trainer
over a real gloo group into the live parameters, bit for bit."""

from __future__ import annotations

import asyncio
import inspect
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType, SimpleNamespace

import pytest
import torch

from disagg.config import load_config, resolve_device
from disagg.errors import ConfigError, RolloutError
from disagg.rollout import engines
from disagg.rollout.backend import EngineBackend
from disagg.rollout.sglang.backend import SglangBackend, engine_args, engine_output
from disagg.rollout.sglang.hook import DisaggScheduler, reply_path
from disagg.transport.buckets import bucket_checksum
from disagg.transport.group import create_group, pick_free_port
from disagg.transport.sender import WeightSender, build_manifest

HOST = "127.0.0.1"
TIMEOUT_S = 30.0
GPU_SGLANG = {"cluster": {"device": "cuda"}, "rollout": {"engine": "sglang"}}  # the one key that switches


# ---- the key ---------------------------------------------------------------------------------------
def test_sglang_on_gpus_with_its_refusals_respected_is_a_valid_config():
    cfg = load_config(GPU_SGLANG)
    assert cfg.rollout.engine == "sglang" and load_config({}).rollout.engine == "vllm"
    # rollout.openai_api left null: on where the engine serves one behind the gate (vLLM), off for SGLang
    assert cfg.rollout.openai_api is False and load_config({}).rollout.openai_api is True
    assert load_config({"rollout": {"openai_api": False}}).rollout.openai_api is False


@pytest.mark.parametrize("extra, names", [
    ({"cluster": {"device": "cpu"}}, "cluster.device='cpu'"),
    ({"rollout": {"in_flight_at_sync": "keep"}}, "rollout.in_flight_at_sync='keep'"),
    ({"rollout": {"openai_api": True}}, "rollout.openai_api=true"),
    ({"rollout": {"tensor_parallel_size": 2}}, "rollout.tensor_parallel_size=2"),
    ({"transport": {"load": "layerwise"}}, "transport.load='layerwise'"),
])
def test_what_sglang_cannot_honour_is_refused_naming_the_option(extra, names):
    data = {k: {**GPU_SGLANG.get(k, {}), **extra.get(k, {})} for k in {*GPU_SGLANG, *extra}}
    with pytest.raises(ConfigError) as e:
        load_config(data)
    assert names in str(e.value) and "rollout.engine='sglang'" in str(e.value)
    # the same options with vLLM are not refused for being vLLM's
    data["rollout"]["engine"] = "vllm"
    try:
        load_config(data)
    except ConfigError as other:
        assert "sglang" not in str(other)


def test_sglang_on_a_machine_whose_auto_device_is_the_cpu_is_refused_before_ray(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = load_config({"rollout": {"engine": "sglang"}})  # cluster.device=auto
    with pytest.raises(ConfigError, match="rollout.engine='sglang' with cluster.device='auto' resolved to 'cpu'"):
        resolve_device(cfg)
    assert resolve_device(load_config({})) == "cpu"  # vLLM runs there


# ---- the registry ----------------------------------------------------------------------------------
def test_the_registry_gives_each_engine_its_backend_and_its_actors_environment():
    from disagg.rollout.vllm.backend import VllmBackend

    assert engines.backend_class("vllm") is VllmBackend and engines.backend_class("sglang") is SglangBackend
    vllm = load_config({"rollout": {"vllm_log_level": "WARNING"}}).rollout
    env = engines.actor_env(vllm, "cpu", [3])
    assert env["VLLM_LOGGING_LEVEL"] == "WARNING" and env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    tp = load_config({"cluster": {"device": "cuda"}, "rollout": {"tensor_parallel_size": 2}}).rollout
    assert engines.actor_env(tp, "cuda", [3, 4])["VLLM_RAY_BUNDLE_INDICES"] == "3,4"
    sgl = load_config(GPU_SGLANG).rollout
    assert not [k for k in engines.actor_env(sgl, "cuda", [0]) if k.startswith("VLLM_")]


def test_the_engines_arguments_carry_disaggs_options_under_sglangs_names():
    cfg = load_config({**GPU_SGLANG, "rollout": {**GPU_SGLANG["rollout"], "enforce_eager": False,
                                                  "max_cudagraph_capture_size": 96, "max_num_seqs": 48,
                                                  "gpu_memory_utilization": 0.4, "vllm_log_level": "INFO"}}).rollout
    args = engine_args(cfg, "/m", seed=7)
    assert (args["disable_cuda_graph"], args["cuda_graph_max_bs_decode"], args["max_running_requests"]) == (False, 96, 48)
    assert (args["mem_fraction_static"], args["log_level"], args["random_seed"]) == (0.4, "info", 7)
    assert args["load_format"] == "dummy" and args["skip_tokenizer_init"] and args["context_length"] == cfg.max_model_len
    eager = engine_args(load_config(GPU_SGLANG).rollout, "/m", seed=0)
    assert eager["disable_cuda_graph"] and "cuda_graph_max_bs_decode" not in eager
    assert "enable_torch_compile" not in args and "enable_torch_compile" not in eager  # null: SGLang's default, none
    compiled = load_config({**GPU_SGLANG, "rollout": {**GPU_SGLANG["rollout"], "compile": True}}).rollout
    assert engine_args(compiled, "/m", seed=0)["enable_torch_compile"] is True


# ---- the backend -----------------------------------------------------------------------------------
def test_the_sglang_backend_implements_the_whole_protocol_with_its_signatures():
    protocol = {name: fn for name, fn in vars(EngineBackend).items() if callable(fn) and not name.startswith("_")}
    differ = []
    for name, fn in protocol.items():
        impl = getattr(SglangBackend, name, None)
        want = [p.name for p in inspect.signature(fn).parameters.values()]
        got = impl and [p.name for p in inspect.signature(impl).parameters.values()]
        if impl is None or inspect.iscoroutinefunction(impl) != inspect.iscoroutinefunction(fn) or (
                got != want and "kw" not in got):
            differ.append(name)
    assert not differ, differ


def _out(ids, lps, reason, cached=0, lp_ids=None):
    return {"output_ids": ids, "meta_info": {"id": "0:r", "finish_reason": reason, "cached_tokens": cached,
                                             "output_token_logprobs": [(lp, t, None) for lp, t in
                                                                       zip(lps, lp_ids or ids)]}}


def test_sglangs_outputs_become_the_actors_samples():
    out = engine_output(_out([5, 9, 2], [-0.5, -1.25, -0.125], {"type": "length", "length": 3}, cached=12))
    (s,) = out.samples
    assert (s.token_ids, s.logprobs, s.finish_reason, s.labels, out.cached_tokens) == (
        [5, 9, 2], [-0.5, -1.25, -0.125], "length", None, 12)
    aborted = engine_output(_out([5], [-0.5], {"type": "abort", "message": "Aborted", "status_code": None}))
    assert aborted.samples[0].finish_reason == "abort" and aborted.samples[0].token_ids == [5]
    assert engine_output(None).samples[0].finish_reason == "abort"  # aborted before its scheduler had it
    many = engine_output([_out([1], [-0.1], {"type": "stop", "matched": 1}), _out([2, 3], [-0.2, -0.3], None)])
    assert [(s.index, s.token_ids, s.finish_reason) for s in many.samples] == [(0, [1], "stop"), (1, [2, 3], "")]
    with pytest.raises(RolloutError, match="log-probs of tokens"):
        engine_output(_out([5, 9], [-0.5, -1.0], None, lp_ids=[5, 8]))


# ---- the weight path into SGLang's scheduler -------------------------------------------------------
class _Model(torch.nn.Module):
    """q and k fused into one ``qk`` parameter by its own ``load_weights``, as SGLang's models do."""

    def __init__(self) -> None:
        super().__init__()
        self.qk = torch.nn.Parameter(torch.zeros(8, 16))
        self.embed = torch.nn.Parameter(torch.zeros(40, 16))

    @torch.no_grad()
    def load_weights(self, weights) -> None:
        for name, t in weights:
            if name in ("q.weight", "k.weight"):
                row = 0 if name == "q.weight" else 4
                self.qk[row:row + 4].copy_(t)
            else:
                self.embed.copy_(t)


class _Scheduler(DisaggScheduler):
    """What disagg's methods read of SGLang's scheduler: ``tp_worker.model_runner``'s model, device,
    GPU id, quantisation and parallel state."""

    def __init__(self, model: torch.nn.Module) -> None:
        runner = SimpleNamespace(model=model, device="cpu", gpu_id=0, ps=SimpleNamespace(tp_rank=0),
                                 model_config=SimpleNamespace(quantization=None))
        self.tp_worker = SimpleNamespace(model_runner=runner)


def _call(sched: _Scheduler, tmp_path, method: str, *args):
    """One call as SGLang's RPC makes it (flat string parameters) and the answer as the backend reads it."""
    reply = str(tmp_path / f"{method}.{len(list(tmp_path.iterdir()))}")
    sched.disagg_call(method=method, args=json.dumps(args), reply=reply)
    with open(reply_path(reply, 0), encoding="utf-8") as f:
        return json.load(f)


def _trainer(version: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(version)
    return {"q.weight": torch.randn(4, 16, generator=gen), "k.weight": torch.randn(4, 16, generator=gen),
            "embed.weight": torch.randn(40, 16, generator=gen)}


def test_a_sync_through_the_schedulers_methods_lands_in_the_live_model_bit_for_bit(tmp_path):
    model = _Model()
    sched = _Scheduler(model)
    live = model.qk.data_ptr(), model.embed.data_ptr()
    port = pick_free_port(HOST)
    info = {"groups": [[HOST, port, "weights"]], "world_size": 2, "rank_offset": 1, "backend": "gloo",
            "timeout_s": TIMEOUT_S, "load": "auto"}
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(create_group, host=HOST, port=port, rank=0, world_size=2, backend="gloo",
                             timeout_s=TIMEOUT_S, group_name="weights")
        assert _call(sched, tmp_path, "disagg_join", info) is None
        group = joined.result(timeout=TIMEOUT_S)
        try:
            sender = WeightSender(group)
            for version in (1, 2):
                w = _trainer(version)
                m = build_manifest(w.items(), 512, policy_version=version)  # several buckets
                sent = pool.submit(sender.send, m, w)
                stats = _call(sched, tmp_path, "disagg_sync", {"manifest": m.to_dict(), "policy_version": version})
                sent.result(timeout=TIMEOUT_S)
                assert stats["policy_version"] == version and stats["load_mode"] == "direct"
                assert stats["num_buckets"] == len(m.buckets) > 1 and stats["bytes"] > 0
                assert torch.equal(model.qk, torch.cat([w["q.weight"], w["k.weight"]]))
                assert torch.equal(model.embed, w["embed.weight"])
            sums = _call(sched, tmp_path, "disagg_param_checksums")
            assert sums["embed"] == bucket_checksum(w["embed.weight"].reshape(-1)).tolist()
            assert _call(sched, tmp_path, "disagg_transfer_stats")["policy_version"] == 2
            assert stats["copy_plan"] == "replayed by bucket"  # the second sync replayed the first's copies
        finally:
            sched._disagg_receiver().shutdown()
            group.destroy()
    assert (model.qk.data_ptr(), model.embed.data_ptr()) == live  # loaded in place: what SGLang's kernels read


def test_the_scheduler_refuses_an_unknown_call_and_a_layerwise_load(tmp_path):
    sched = _Scheduler(_Model())
    with pytest.raises(ValueError, match="no scheduler call 'shutdown'"):
        sched.disagg_call(method="shutdown", args="[]", reply=str(tmp_path / "x"))
    assert _call(sched, tmp_path, "disagg_set_load_mode", "auto") == "direct"
    with pytest.raises(ValueError, match="SGLang does not have"):
        sched.disagg_call(method="disagg_set_load_mode", args=json.dumps(["layerwise"]), reply=str(tmp_path / "y"))


# ---- requests through a stand-in of SGLang's tokenizer manager ------------------------------------
class _TokenizerManager:
    """What the backend uses of SGLang's tokenizer manager, with its scheduler's abort rule: an abort
    names a prefix (``req.rid.startswith``, scheduler.py:4457), and a running request ends at its next
    step with that step's token, sampled by the weights loaded then (``weights``)."""

    def __init__(self) -> None:
        self.rid_to_state: dict[str, dict] = {}
        self.weights = 1

    async def generate_request(self, obj, request):
        state = self.rid_to_state[obj.rid] = {"aborted": False}
        ids = []
        while True:
            await asyncio.sleep(0.005)
            ids.append(self.weights)
            if state["aborted"] or len(ids) == obj.sampling_params["max_new_tokens"]:
                break
        del self.rid_to_state[obj.rid]
        reason = {"type": "abort"} if state["aborted"] else {"type": "length"}
        yield _out(ids, [-0.5] * len(ids), reason)

    def abort_request(self, rid: str) -> None:
        for name, state in self.rid_to_state.items():
            if name.startswith(rid):
                state["aborted"] = True


@pytest.fixture
def sglang_stand_in(monkeypatch):
    """SGLang's request types, as the backend imports them, without SGLang."""
    io = ModuleType("sglang.srt.managers.io_struct")
    io.GenerateReqInput = lambda **kw: SimpleNamespace(**kw)
    tm = ModuleType("sglang.srt.managers.tokenizer_manager")
    tm.RequestAbortedError = type("RequestAbortedError", (ValueError,), {})
    for name, module in (("sglang", ModuleType("sglang")), ("sglang.srt", ModuleType("sglang.srt")),
                         ("sglang.srt.managers", ModuleType("sglang.srt.managers")),
                         ("sglang.srt.managers.io_struct", io), ("sglang.srt.managers.tokenizer_manager", tm)):
        monkeypatch.setitem(sys.modules, name, module)


def test_an_abort_ends_only_its_request_and_returns_once_its_last_token_is_sampled(sglang_stand_in):
    tm = _TokenizerManager()
    backend = SglangBackend(SimpleNamespace(tokenizer_manager=tm), "stand-in", load_config(GPU_SGLANG).rollout)
    params = backend.sampling(n=1, max_tokens=40, temperature=1.0, top_p=1.0, seed=None, ignore_eos=True)

    async def main():
        # "gen-1" is a prefix of "gen-10": SGLang's abort of the one must not reach the other
        one = await backend.submit("gen-1", [1, 2], params, "v1")
        ten = await backend.submit("gen-10", [1, 2], params, "v1")
        await asyncio.sleep(0.05)
        await backend.abort(["gen-1"])
        tm.weights = 2  # what a sync loads right after the abort returned
        return await backend.final_output(one), await backend.final_output(ten)

    aborted, other = asyncio.run(main())
    (a,), (o,) = aborted.samples, other.samples
    assert a.finish_reason == "abort" and a.token_ids and set(a.token_ids) == {1}, a.token_ids
    assert o.finish_reason == "length" and len(o.token_ids) == 40 and 2 in o.token_ids
    assert backend.num_unfinished() == 0 and backend.sample_of("0:gen-1", {"gen-1"}) == ("gen-1", 0)


def test_the_plugin_entry_point_puts_disaggs_calls_on_sglangs_scheduler(monkeypatch):
    """pyproject's ``sglang.srt.plugins`` entry point names the hook SGLang's loader runs in each
    scheduler process; run against a stand-in ``Scheduler`` class, it gives that class ``disagg_call``
    and every call it dispatches to."""
    import importlib
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    module, _, name = project["entry-points"]["sglang.srt.plugins"]["disagg"].partition(":")
    scheduler = ModuleType("sglang.srt.managers.scheduler")
    scheduler.Scheduler = type("Scheduler", (), {})
    for mod_name in ("sglang", "sglang.srt", "sglang.srt.managers"):
        monkeypatch.setitem(sys.modules, mod_name, ModuleType(mod_name))
    monkeypatch.setitem(sys.modules, "sglang.srt.managers.scheduler", scheduler)
    getattr(importlib.import_module(module), name)()
    from disagg.rollout.sglang.hook import CALLS

    assert all(callable(getattr(scheduler.Scheduler, m, None)) for m in ("disagg_call", *CALLS))
