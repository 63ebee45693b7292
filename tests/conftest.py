"""Shared fixtures: a small config, the warm-started tiny model (built once per
session), and one local Ray cluster for the whole session."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import pytest

os.environ.setdefault("RAY_DEDUP_LOGS", "0")

# Small, fast settings every integration test starts from.
SMALL = {
    "trainer": {"total_steps": 3, "micro_batch_size": 32},
    # KV cache: on CPU the engine allocates (and zeroes) this share of the NUMA node's memory at every
    # start (vllm_api.memory_args); 0.02 (0.19 GiB, ~12k tokens, on a 9.3 GiB node) starts an engine
    # sooner than the default. vLLM's own reading of 0.02 (the whole engine process in 2 % of the
    # node, ~0.6 GiB resident) would leave no KV cache on a node under ~30 GiB: every engine test
    # here fails if memory_args stops asking for the KV cache itself.
    "rollout": {"max_model_len": 32, "max_tokens": 8, "gpu_memory_utilization": 0.02},
    "algorithm": {"group_size": 4, "prompts_per_step": 4},
    "model": {"warmstart": {"steps": 30}},
    "logging": {"backends": ["jsonl", "tensorboard"], "progress": False},
}


# The same small settings as command-line overrides, for tests that run `disagg` as a subprocess.
SMALL_CLI = [
    "trainer.micro_batch_size=32",
    "rollout.max_model_len=32",
    "rollout.gpu_memory_utilization=0.02",
    "algorithm.group_size=4",
    "algorithm.prompts_per_step=4",
    "model.warmstart.steps=30",
    "logging.progress=false",
]


def disagg_process(args: list[str], env: dict[str, str] | None = None, **kw):
    """``python -m disagg ARGS`` as a user runs it, output captured as text, unbuffered; ``env``
    is added to this process's environment."""
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-m", "disagg", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, **kw)


def rank_processes():
    """The multiprocessing context the transport tests start their rank processes from: a fork
    server that imported torch, disagg's transport and those tests' modules once, so that each rank
    starts by a fork of it instead of importing torch again (spawn: ~1.7 s of a core per rank, four
    ranks a test). The server is started before any test's threads exist in it, and CUDA is never
    initialised there (the GPU forms initialise it in each rank)."""
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "disagg.transport.sender", "disagg.transport.receiver",
                                "disagg.transport.model_transfer", "tests.integration.test_transport_gloo",
                                "tests.integration.test_sync_modes"])
    return ctx


# Modules whose model takes long to build on CPU -> the function of that module giving its config:
# ``prebuilt_models`` builds those models in the background from the session's start, and the
# modules run last (the calculator model's warm start: ~40 s of a 2-core machine, off the clock).
PREBUILT = {"tests.integration.test_agent": "agent_config"}


def _lowest_cpu_priority() -> None:
    """In a background build's process: Linux's idle scheduling class, which runs on what the tests
    leave idle (the scheduler weighs it 3 against a test process's 1024; nice 19 would be 15), else
    nice 19."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)


class _Prebuilt:
    """Background builds of PREBUILT's models (``prepare_model`` into the session's model cache)."""

    def __init__(self, model_cache: Path, modules: list[str]) -> None:
        import subprocess
        import sys

        self.procs: dict[str, tuple[subprocess.Popen, Path]] = {}
        root = Path(__file__).resolve().parents[1]
        for module in modules:
            log = model_cache / f"prebuild-{module.rsplit('.', 1)[-1]}.log"
            code = (f"import sys; from pathlib import Path; from {module} import {PREBUILT[module]} as config; "
                    "from disagg.model.warmstart import prepare_model; prepare_model(config(Path(sys.argv[1])))")
            with open(log, "w") as out:
                self.procs[module] = (subprocess.Popen([sys.executable, "-c", code, str(model_cache)], cwd=root,
                                                       stdout=out, stderr=subprocess.STDOUT,
                                                       preexec_fn=_lowest_cpu_priority), log)

    def wait(self, module: str, timeout_s: float = 900.0) -> None:
        """Wait for ``module``'s model; where its build failed, the module's own ``prepare_model``
        builds it (and the build's log says why in the test output)."""
        proc, log = self.procs.pop(module, (None, None))
        if proc is None:
            return
        try:
            proc.wait(timeout=timeout_s)
        except Exception:
            proc.kill()
            raise
        if proc.returncode != 0:
            print(f"background build of {module}'s model failed ({proc.returncode}):\n{log.read_text()[-3000:]}")

    def close(self) -> None:
        for proc, _ in self.procs.values():
            proc.kill()
            proc.wait(timeout=30)


@pytest.fixture(scope="session", autouse=True)
def prebuilt_models(request, model_cache):
    modules = sorted({item.module.__name__ for item in request.session.items
                      if getattr(item, "module", None) is not None and item.module.__name__ in PREBUILT})
    builds = _Prebuilt(model_cache, modules)
    yield builds
    builds.close()


def pytest_collection_modifyitems(config, items):
    import torch

    # The modules whose model is built in the background run last (stable: otherwise in order).
    items.sort(key=lambda item: getattr(getattr(item, "module", None), "__name__", "") in PREBUILT)

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA GPUs (run on the GPU machines)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("model-cache")


def small_config(model_cache: Path, **overrides):
    """A validated Config from SMALL plus nested overrides."""
    from disagg.config import load_config

    data = {k: dict(v) for k, v in SMALL.items()}
    data["model"] = {**data["model"], "cache_dir": str(model_cache)}
    for section, values in overrides.items():
        if isinstance(values, dict):
            data.setdefault(section, {}).update(values)
        else:
            data[section] = values
    return load_config(data)


@pytest.fixture(scope="session")
def ray_session():
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=True)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def tok(job):
    """The tokenizer of the module's ``job`` (each test module that asks for it defines its own ``job``)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(job.model_path)


def long_request_across_syncs(job, prompt: list[int], num_tokens: int, max_versions: int | None = None,
                              poll_s: float = 0.0):
    """Generate one 2-sample request of exactly ``num_tokens`` tokens on engine 0 while the trainer
    makes and syncs a new version after each of its steps (a large learning rate makes each
    version's log-probs tell it apart). Filler requests keep the batch full, so decode steps are
    slow enough for several syncs. Returns the request's ``GenResult`` and the trainer's weights
    of every version synced meanwhile (version -> state dict), starting with the current one.
    ``max_versions`` stops syncing after that many versions; ``poll_s`` paces the loop."""
    import ray

    from disagg.rollout.types import GenRequest, SamplingSpec
    from disagg.samples import TrainSample

    v = job.coordinator.state.latest_version() + 1
    job.sync_weights(v, trainer_step=v)
    states = {v: ray.get(job.trainer.rank0.full_state_dict.remote(), timeout=120)}
    engine = job.rollout.engines[0]
    target = engine.generate.remote([GenRequest("long", tuple(prompt), SamplingSpec(max_tokens=num_tokens, n=2,
                                                                                    ignore_eos=True))])
    filler = engine.generate.remote([GenRequest(f"fill{i}", tuple(prompt), SamplingSpec(max_tokens=num_tokens, n=8,
                                                                                         ignore_eos=True))
                                     for i in range(12)])
    batch = [TrainSample(prompt, [5 + i, 6, 7, 8], [-1.0] * 4, 1.0 if i % 2 else -1.0, 0.0, v) for i in range(8)]
    while not ray.wait([target], timeout=poll_s)[0] and (max_versions is None or len(states) < max_versions):
        job.trainer.train_step(batch)
        v += 1
        job.sync_weights(v, trainer_step=v)
        states[v] = ray.get(job.trainer.rank0.full_state_dict.remote(), timeout=120)
    (result,) = ray.get(target, timeout=300)
    ray.get(filler, timeout=300)
    return result, states


def a_sync_stops_what_no_step_can_train(job, prompt: list[int], num_tokens: int, limit: int = 1,
                                        poll_s: float = 0.0) -> None:
    """GenRequest.stale_drop on engine 0, checked: once a sync loads a version more than ``limit``
    (the run's max_staleness) past a request's oldest token, no step can train it; the engine aborts
    it in vLLM (its tokens stop) and answers ``dropped="stale"``, at the first such version, while a
    request without the flag, started beside it, runs on across the same syncs to its end. Filler
    requests keep decode steps slow enough for several syncs, as in ``long_request_across_syncs``;
    ``poll_s`` paces the syncs (resubmit mode: a request aborted at every sync before its prefill is
    done would make no token)."""
    import ray

    from disagg.rollout.types import GenRequest, SamplingSpec
    from disagg.samples import TrainSample

    job.coordinator.state.set_max_staleness(limit)
    v = job.coordinator.state.latest_version() + 1
    job.sync_weights(v, trainer_step=v)
    engine = job.rollout.engines[0]
    before = ray.get(engine.get_stats.remote(), timeout=60)
    spec = SamplingSpec(max_tokens=num_tokens, n=2, ignore_eos=True)
    doomed = engine.generate.remote([GenRequest("doomed", tuple(prompt), spec, stale_drop=True)])
    kept = engine.generate.remote([GenRequest("kept", tuple(prompt), spec)])
    filler = engine.generate.remote([GenRequest(f"sfill{i}", tuple(prompt), SamplingSpec(max_tokens=num_tokens, n=8,
                                                                                          ignore_eos=True))
                                     for i in range(12)])
    batch = [TrainSample(prompt, [5 + i, 6, 7, 8], [-1.0] * 4, 1.0 if i % 2 else -1.0, 0.0, v) for i in range(8)]
    first = v
    while not ray.wait([doomed], timeout=poll_s)[0] and v < first + 10:
        job.trainer.train_step(batch)
        v += 1
        job.sync_weights(v, trainer_step=v)
    (gone,) = ray.get(doomed, timeout=300)
    (done,) = ray.get(kept, timeout=300)
    ray.get(filler, timeout=300)
    after = ray.get(engine.get_stats.remote(), timeout=60)

    assert gone.dropped == "stale" and gone.completions == [], gone
    # stopped by the first version no step could train it with: limit + 1 past its oldest token
    assert gone.max_version - gone.min_version == limit + 1, gone
    assert first <= gone.min_version and gone.max_version <= v
    # The request without the flag crossed the sync that stopped the other and ran to its end.
    assert [len(c.response_ids) for c in done.completions] == [num_tokens] * 2
    assert done.max_version >= gone.max_version, (done.max_version, gone)
    assert after["dropped_stale_in_flight"] - before["dropped_stale_in_flight"] == 1
    assert after["requests_cancelled"] == before["requests_cancelled"]  # a drop, not a run's end
    # Aborted in vLLM, not just relabelled: vLLM sampled fewer tokens than the 100 full responses.
    sampled = after["vllm_generation_tokens"] - before["vllm_generation_tokens"]
    assert sampled < (2 + 2 + 96 - 1) * num_tokens, sampled
    assert after["unfinished_requests"] == 0


@contextmanager
def next_step_held_until(job, condition, timeout_s: float = 300.0):
    """Hold the trainer's next train step (rank 0, ``hold_next_step``) until ``condition()`` holds:
    a thread of this process polls it (it may read a pipeline the test runs here) and then releases
    the step. A test thereby sets up, deterministically, what must happen while that step runs. On
    leaving, the step is released in any case; yields a list that holds True once the condition was met."""
    import threading
    import time

    import ray

    ray.get(job.trainer.rank0.hold_next_step.remote(timeout_s), timeout=60)
    met: list[bool] = []
    done = threading.Event()

    def watch() -> None:
        deadline = time.monotonic() + timeout_s
        while not done.is_set() and time.monotonic() < deadline:
            if condition():
                met.append(True)
                break
            time.sleep(0.01)
        ray.get(job.trainer.transport_method(0, "release_step").remote(), timeout=60)

    watcher = threading.Thread(target=watch, name="release-held-step", daemon=True)
    watcher.start()
    try:
        yield met
    finally:
        done.set()
        watcher.join(timeout=120)


def replay_logprobs(model_path, states: dict[int, dict], prompt: list[int], response: list[int],
                    versions: list[int], *, recompute: bool = False, pieces=None, refilled=(), device: str = "cpu",
                    engine_dtype=None, rounding: bool = False):
    """Each response token's log-prob under the float32 weights of the version it is tagged with.

    ``recompute=False`` (keep mode, vLLM's pause): decode step by step, the KV of earlier tokens
    kept as the weights of their own steps computed it; token t comes out of the step that feeds
    token t-1 (the prompt for t = 0). ``recompute=True``: everything before a token computed again
    by that token's weights, one pass per run of a version (the tests' "other KV rule"). ``pieces`` (resubmit
    mode, ``Completion.pieces``): as vLLM ran it, each continuation ``(k, kept)`` keeping the KV of
    the first ``kept`` positions as the earlier pieces computed it and prefilling the rest of the
    prompt and ``response[:k]`` with token k's weights, then decoding step by step. ``refilled``: the
    starts ``k`` of continuations at the end of a full KV block of their chain (``refill_points``)
    whose piece before had filled that block in a step the sync's abort discarded: vLLM then holds
    two copies of it, and every later continuation of the chain takes that first one, not the one
    the continuation at ``k`` computed again.

    ``engine_dtype`` (e.g. ``torch.bfloat16``): the weights are first rounded to it, as the engine
    holds them; the arithmetic stays float32. ``rounding=True`` returns ``(log-probs, bound)``, where
    ``bound[t]`` is how far rounding the logits to ``engine_dtype`` alone can move token t's log-prob
    (vLLM computes logits in the model's dtype): half a unit in the last place of the token's logit
    plus half of the row's largest, so it grows with the logits' magnitude.
    """
    import torch
    from transformers import DynamicCache, Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device).eval()
    eps = torch.finfo(engine_dtype if engine_dtype is not None else torch.float32).eps  # 2 ** -mantissa bits

    def load(v: int) -> None:
        cast = (lambda t: t.to(engine_dtype)) if engine_dtype is not None else (lambda t: t)
        model.load_state_dict({k: cast(t).float().to(device) for k, t in states[v].items()}, strict=False)
        model.tie_weights()

    def ulp(x: torch.Tensor) -> torch.Tensor:
        return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(1e-30)))) * eps

    out = torch.zeros(len(response))
    bound = torch.zeros(len(response))

    def take(t: int, logits: torch.Tensor) -> None:
        out[t] = torch.log_softmax(logits.float(), dim=-1)[response[t]].cpu()
        bound[t] = ((ulp(logits[response[t]]) + ulp(logits.abs().max())) / 2).cpu()

    with torch.no_grad():
        if recompute:
            start = 0
            while start < len(response):
                end = start
                while end < len(response) and versions[end] == versions[start]:
                    end += 1
                load(versions[start])
                logits = model(input_ids=torch.tensor([prompt + response[:end]], device=device)).logits[0].float()
                for t in range(start, end):  # token t is predicted at position len(prompt) + t - 1
                    take(t, logits[len(prompt) + t - 1])
                start = end
        else:  # decode step by step; a piece (resubmit mode) first cuts the cache to what it kept
            # (kept, fresh) of the last piece at each k: one that made no token is followed by a fresh one there
            starts = dict(chain_starts(pieces or ()))
            cache = DynamicCache()
            firsts: list = []  # (a, b, per layer (keys, values)): the chain's first copies of blocks computed again
            for t in range(len(response)):
                if t == 0 or t in starts:
                    kept, fresh = starts.get(t, (0, True))
                    if t in refilled:  # the step the abort discarded: token t - 1 fed by the weights before
                        model(input_ids=torch.tensor([[response[t - 1]]], device=device), past_key_values=cache,
                              use_cache=True)
                        a, b = kept, len(prompt) + t
                        firsts.append((a, b, [(x.keys[:, :, a:b].clone(), x.values[:, :, a:b].clone())
                                              for x in cache.layers]))
                    load(versions[t])
                    firsts = [] if fresh else firsts
                    if not kept:
                        cache = DynamicCache()
                    elif cache.get_seq_length() > kept:  # negative: tokens to drop (every transformers release)
                        cache.crop(kept - cache.get_seq_length())
                    for a, b, kv in firsts if kept else ():
                        if b <= kept:  # vLLM's prefix cache returns the copy it cached first
                            for x, (keys, values) in zip(cache.layers, kv):
                                x.keys[:, :, a:b], x.values[:, :, a:b] = keys, values
                    feed = (prompt + response[:t])[kept:]
                else:
                    if versions[t] != versions[t - 1]:  # keep mode: the next step runs on the new weights
                        assert pieces is None, f"token {t}: a change of version inside a piece"
                        load(versions[t])
                    feed = [response[t - 1]]
                logits = model(input_ids=torch.tensor([feed], device=device), past_key_values=cache,
                               use_cache=True).logits[0, -1]
                take(t, logits.float())
    return (out, bound) if rounding else out


def chain_starts(pieces) -> list[tuple[int, tuple[int, bool]]]:
    """Each continuation of ``Completion.pieces`` as (k, (kept, fresh)): ``fresh`` where it starts a
    new KV chain (the engine's rule: the piece before it made no token, so it starts at that piece's k)."""
    out, prev = [], 0
    for k, kept in pieces:
        out.append((k, (kept, k == prev)))
        prev = k
    return out


def refill_points(pieces, prompt_len: int, block: int) -> list[int]:
    """The continuations (their starts k) whose context ends at the end of a full KV block of their
    chain, which a later continuation of the chain keeps: vLLM computes that block again (it
    recomputes at least the last token) and caches it beside the copy the piece before filled where
    the sync's abort came during a step (its token dropped, its KV kept). Which copy the later ones
    took depends on that step: ``replay_logprobs(refilled=...)``."""
    starts = chain_starts(pieces)
    points = []
    for i, (k, (_, fresh)) in enumerate(starts):
        end = prompt_len + k
        if fresh or not k or end % block:
            continue
        for _, (kept, later_fresh) in starts[i + 1:]:
            if later_fresh:  # the chain ends
                break
            if kept >= end:
                points.append(k)
                break
    return points
