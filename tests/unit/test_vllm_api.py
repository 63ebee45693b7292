"""The vLLM adapter's pure parts: per-token versions from vLLM's spans (where a release labels
tokens) or from the pauses' counts, and the choice of what a sync does with requests in flight."""

import asyncio
from types import SimpleNamespace as NS

import pytest

from disagg.errors import ConfigError, RolloutError
from disagg.rollout.engine import cut_versions
from disagg.rollout.engine import resolve_in_flight_mode
from disagg.rollout.vllm.api import has_output_counts, sample_of, token_versions


def test_token_versions_come_from_the_engine_weight_version_spans():
    spans = [NS(version="4", start=0, end=3), NS(version="5", start=3, end=4), NS(version="7", start=4, end=6)]
    assert token_versions("r", NS(weight_versions=spans), 6) == [4, 4, 4, 5, 7, 7]
    assert token_versions("r", NS(weight_versions=None), 0) == []  # nothing sampled, nothing labelled
    with pytest.raises(RolloutError, match="6 tokens but weight-version spans cover 4"):
        token_versions("r", NS(weight_versions=spans[:2]), 6)
    with pytest.raises(RolloutError, match="6 tokens but weight-version spans cover 0"):
        token_versions("r", NS(weight_versions=None), 6)
    with pytest.raises(RolloutError, match="not contiguous"):
        token_versions("r", NS(weight_versions=[spans[0], spans[2]]), 5)
    with pytest.raises(RolloutError, match="labelled 'default'"):
        token_versions("r", NS(weight_versions=[NS(version="default", start=0, end=2)]), 2)


def test_a_vllm_without_labels_gives_no_token_versions():
    """vLLM 0.26's CompletionOutput has no weight_versions field at all."""
    assert token_versions("r", NS(token_ids=[1, 2]), 2) is None


@pytest.mark.parametrize("requested, labels, counts, mode", [
    ("auto", True, True, "keep"), ("auto", False, True, "keep"),  # 0.26: cut at the pauses by the counts
    ("auto", True, False, "keep"), ("auto", False, False, "resubmit"),  # no plugin in the engine core
    ("keep", True, True, "keep"), ("keep", False, True, "keep"), ("keep", True, False, "keep"),
    ("resubmit", True, True, "resubmit"), ("resubmit", False, False, "resubmit"),
])
def test_in_flight_mode(requested, labels, counts, mode):
    assert resolve_in_flight_mode(requested, labels, counts) == mode


def test_keep_without_labels_or_counts_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"rollout.in_flight_at_sync='keep'.*VLLM_PLUGINS"):
        resolve_in_flight_mode("keep", False, False)


@pytest.mark.parametrize("answer, has", [({"r-0a1b2c3d": 3}, True), ({}, True),
                                         (RuntimeError("Call to disagg_output_counts method failed"), False)])
def test_output_counts_are_there_where_the_engine_core_answers_them(answer, has):
    """The engine's first call to the utility: an engine core without disagg's plugin answers it as a
    failed utility call (vLLM raises it back in the front end)."""
    class Core:
        async def call_utility_async(self, name):
            assert name == "disagg_output_counts"
            if isinstance(answer, Exception):
                raise answer
            return answer

    assert asyncio.run(has_output_counts(NS(engine_core=Core()))) is has


def test_vllms_internal_request_ids_map_to_our_request_and_sample():
    live = {"g3", "grp-7_1", "long"}
    assert sample_of("g3-0a1b2c3d", live) == ("g3", 0)  # ours plus "-" and 8 random characters
    assert sample_of("grp-7_1-deadbeef", live) == ("grp-7_1", 0)  # our id's own "-" and "_" kept
    assert sample_of("1_long-0a1b2c3d", live) == ("long", 1)  # sample 1 of an n > 1 request
    assert sample_of("12_g3-0a1b2c3d", live) == ("g3", 12)
    assert sample_of("long", live) == ("long", 0)  # VLLM_DISABLE_REQUEST_ID_RANDOMIZATION
    assert sample_of("3_long", live) == ("long", 3)
    assert sample_of("chatcmpl-0a1b2c3d", live) is None  # the OpenAI server's
    assert sample_of("x_long-0a1b2c3d", live) is None


def test_a_kept_response_takes_each_version_from_its_count_at_each_pause():
    assert cut_versions("r", 4, [], 3) == [4, 4, 4]
    assert cut_versions("r", 4, [(2, 5), (2, 6), (5, 7)], 6) == [4, 4, 6, 6, 6, 7]  # one pause before a token of 5
    assert cut_versions("r", 4, [(0, 5)], 2) == [5, 5]  # paused before its first token
    assert cut_versions("r", 4, [(3, 5)], 3) == [4, 4, 4]  # paused after its last
    with pytest.raises(RolloutError, match="paused at 1 tokens after 2"):
        cut_versions("r", 4, [(2, 5), (1, 6)], 3)
    with pytest.raises(RolloutError, match="paused at 4 tokens .* ended with 3"):
        cut_versions("r", 4, [(4, 5)], 3)


def test_a_tool_parser_vllm_does_not_have_is_a_config_error_naming_the_key_and_the_known_ones():
    pytest.importorskip("vllm")
    from disagg.rollout.vllm.api import tool_parser, tool_parser_class

    cls, request = tool_parser("hermes", [{"type": "function", "function": {"name": "calc", "parameters": {}}}])
    assert hasattr(cls, "extract_tool_calls") and request.tools[0].function.name == "calc"
    assert tool_parser_class("hermes") is cls  # the server's check at start: no request built
    for check in (lambda: tool_parser("nonsense", None), lambda: tool_parser_class("nonsense")):
        with pytest.raises(ConfigError, match=r"rollout.tool_call_parser='nonsense': vLLM has no such tool parser; "
                                              r"known: \[.*'hermes'"):
            check()



QUICK_EXIT = r"""
import atexit, os, sys
from pathlib import Path
from vllm.v1.engine import core
from disagg.rollout.vllm.api import install_quick_exit
install_quick_exit()
install_quick_exit()  # once only: vLLM calls the plugin in every process, maybe more than once
for case, (state, code) in enumerate([("SHUTTING_DOWN", 0), ("SHUTTING_DOWN", 3), ("RUNNING", 0)]):
    pid = os.fork()  # one engine-core process per case, vLLM imported once
    if pid:
        print(case, os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), Path(sys.argv[1], str(case)).exists())
        continue
    marker = Path(sys.argv[1], str(case))
    atexit.register(marker.write_text, "interpreter teardown ran")  # registered before the quick exit: runs after
    engine = object.__new__(core.EngineCoreProc)  # what run_engine_core's `finally` shuts down
    engine.structured_output_manager = type("S", (), {"clear_backend": lambda self: None})()
    engine.model_executor = engine.scheduler = None
    engine.shutdown_state = core.EngineShutdownState[state]
    engine.has_work = lambda: False
    try:
        raise SystemExit(code)
    finally:
        engine.shutdown()
"""


def test_a_cleanly_shut_down_cpu_engine_core_skips_the_interpreter_teardown_and_nothing_else_does(tmp_path):
    # vLLM's engine core asked to stop (SHUTTING_DOWN) leaving on SystemExit(0) exits at once, with 0;
    # an error's exit code, or an exit vLLM did not ask for, goes the normal way (every exit handler)
    pytest.importorskip("vllm")
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", QUICK_EXIT, str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # case, exit code, whether the exit handlers registered before the engine's shutdown ran
    assert proc.stdout.split("\n")[:3] == ["0 0 False", "1 3 True", "2 0 True"], proc.stdout + proc.stderr[-2000:]


def test_on_cpu_the_engine_core_is_forked_and_the_start_method_is_read_from_its_process(monkeypatch):
    pytest.importorskip("vllm")
    import multiprocessing

    from vllm.v1.engine import utils as engine_utils

    from disagg.rollout.vllm.api import engine_core_start, fork_engine_core

    vllms = engine_utils.get_mp_context
    monkeypatch.setattr(engine_utils, "get_mp_context", vllms)  # restored after
    fork_engine_core()
    fork_engine_core()  # again: it replaces vLLM's own function, not its own replacement
    assert engine_utils.get_mp_context._disagg_vllms is vllms
    assert engine_utils.get_mp_context().get_start_method() == "fork"
    proc = engine_utils.get_mp_context().Process(target=print)  # what CoreEngineProcManager builds
    engine = NS(engine_core=NS(resources=NS(engine_manager=NS(processes=[proc]))))
    assert engine_core_start(engine) == "fork"
    spawned = NS(engine_core=NS(resources=NS(engine_manager=NS(processes=[
        multiprocessing.get_context("spawn").Process(target=print)]))))
    assert engine_core_start(spawned) == "spawn"
    assert engine_core_start(NS(engine_core=NS(resources=NS(engine_manager=None)))) == ""


@pytest.mark.parametrize("cpu,tp,cuda_initialized,forks", [
    (True, 1, False, True), (True, 2, False, True),  # CPU: the engine core forks whatever the workers
    (False, 1, False, True),  # a GPU engine of one worker whose actor has not touched CUDA
    (False, 1, True, False),  # a CUDA context does not survive a fork
    (False, 2, False, False),  # vLLM's Ray executor would use Ray from the forked child
])
def test_the_engine_core_forks_only_where_its_child_can_run_without_the_actors_cuda_or_ray(cpu, tp, cuda_initialized,
                                                                                          forks):
    from disagg.rollout.vllm.api import fork_reason

    assert (fork_reason(cpu, tp, cuda_initialized) is not None) is forks


def test_on_a_gpu_the_start_method_is_chosen_when_the_engine_core_starts(monkeypatch):
    """A CUDA context made after the engine actor set up the fork (vLLM building its config in the
    actor) still means spawn: the choice is made when vLLM asks for it."""
    import torch

    from disagg.rollout.vllm.api import engine_core_context

    vllms = []
    get = engine_core_context(False, 1, lambda: vllms.append("asked") or "vLLM's choice")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert get().get_start_method() == "fork" and vllms == []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert get() == "vLLM's choice" and vllms == ["asked"]
    assert engine_core_context(False, 2, lambda: "vLLM's choice")() == "vLLM's choice"  # Ray executor


def test_the_model_class_is_inspected_in_this_process_inside_the_block_only():
    pytest.importorskip("vllm")
    import os

    from vllm.model_executor.models import registry

    from disagg.rollout.vllm.api import model_info_in_process

    vllms = registry._run_in_subprocess
    with model_info_in_process():
        assert registry._run_in_subprocess(os.getpid) == os.getpid()
    assert registry._run_in_subprocess is vllms


def test_a_finished_vllm_request_reaches_the_actor_in_its_own_terms():
    """``engine_output``: what the engine actor reads of vLLM's ``RequestOutput`` (the seam: it reads
    nothing else), here from outputs shaped as vLLM 0.32 makes them (flat log-probs, labels)."""
    from disagg.rollout.types import EngineOutput, SampleOutput
    from disagg.rollout.vllm.api import engine_output

    flat = NS(token_ids=[5, 6, 7], logprobs=[-0.1, -0.2, -0.3])
    labelled = NS(index=1, token_ids=[5, 6, 7], logprobs=flat, finish_reason="length",
                  weight_versions=[NS(version="3", start=0, end=2), NS(version="4", start=2, end=3)])
    unlabelled = NS(index=0, token_ids=[], logprobs=None, finish_reason=None)
    out = engine_output(NS(request_id="r", outputs=[labelled, unlabelled], num_cached_tokens=16))
    assert out == EngineOutput([SampleOutput(1, [5, 6, 7], [-0.1, -0.2, -0.3], "length", [3, 3, 4]),
                                SampleOutput(0, [], [], "", None)], cached_tokens=16)
    assert engine_output(NS(request_id="r", outputs=[unlabelled], num_cached_tokens=None)).cached_tokens == 0
    with pytest.raises(RolloutError, match="request r: 3 tokens but weight-version spans cover 2"):
        engine_output(NS(request_id="r", outputs=[NS(index=0, token_ids=[5, 6, 7], logprobs=flat, finish_reason="stop",
                                                     weight_versions=[NS(version="3", start=0, end=2)])]))


def test_rollout_compile_false_asks_vllm_for_whole_step_graphs_without_compiling():
    from vllm.config import CompilationConfig
    from vllm.config.compilation import CompilationMode, CUDAGraphMode

    from disagg.rollout.vllm.api import compilation_args

    assert compilation_args(None, None) == {} and compilation_args(None, True) == {}
    assert compilation_args(96, None) == {"compilation_config": {"max_cudagraph_capture_size": 96}}
    cc = compilation_args(96, False)["compilation_config"]
    resolved = CompilationConfig(**cc)  # vLLM's own validation of every key and value
    assert resolved.mode == CompilationMode.NONE and resolved.cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY
    assert resolved.max_cudagraph_capture_size == 96
    # full graphs need no compiled pieces: vLLM keeps this mode where it drops the default without compilation
    assert not resolved.cudagraph_mode.requires_piecewise_compilation()
    assert CUDAGraphMode.FULL_AND_PIECEWISE.requires_piecewise_compilation()
