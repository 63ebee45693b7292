"""Typed messages between the driver and rollout engines (no vLLM imports).

Token in, token out: prompts travel as token ids and responses come back as the
engine's token ids with one behaviour log-prob per generated token, so what the
trainer trains on is exactly what the engine sampled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Response headers of the engines' OpenAI API: the policy version served when the request
# passed the weights gate and when the response started (every token's version is in between).
VERSION_MIN_HEADER = "x-disagg-policy-version-min"
VERSION_MAX_HEADER = "x-disagg-policy-version-max"


@dataclass(frozen=True)
class SamplingSpec:
    """What vLLM's SamplingParams needs, without importing vLLM."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    seed: int | None = None
    greedy: bool = False
    ignore_eos: bool = False  # generate exactly max_tokens (benchmarks control lengths this way)


@dataclass(frozen=True)
class GenRequest:
    """One prompt; the engine returns ``sampling.n`` samples for it."""

    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingSpec
    # The pipeline's groups: the engine may stop the request once no train step can take it (a sync
    # loaded a version more than the run's max_staleness past its oldest token), and answers it
    # ``dropped="stale"``. Evaluations and the OpenAI server's requests are never stopped.
    stale_drop: bool = False


@dataclass
class Completion:
    """One generated sample. ``logprobs[i]`` is the behaviour log-prob of ``response_ids[i]``,
    ``token_versions[i]`` the policy version that generated it (a request paused across weight
    updates continues on the new weights, so versions rise along the response)."""

    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    token_versions: list[int] = field(default_factory=list)
    # Multi-turn trajectories (agent tasks): 1 for tokens the engine generated, 0 for tool
    # responses (their log-prob entries are placeholders); None = every token generated.
    loss_mask: list[int] | None = None
    final_text: str | None = None  # the text the reward reads (None: decode response_ids)
    info: dict = field(default_factory=dict)  # per-trajectory counts (turns, tool_calls, finish_*)
    # Resubmit mode: for each continuation after a sync, (response tokens it started from, prompt +
    # response positions whose KV vLLM's prefix cache gave back, computed by the earlier pieces).
    pieces: list[tuple[int, int]] = field(default_factory=list)

    @property
    def min_version(self) -> int:
        return min(self.token_versions, default=0)


@dataclass(frozen=True)
class SampleOutput:
    """One sample of a finished engine request, as every engine backend hands it to the engine actor
    (``rollout/vllm/api.py: final_output``): the actor never reads an engine's own output objects."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    """The log-prob of each sampled token."""
    finish_reason: str
    """'stop', 'length', 'abort' (a sync or a client aborted it); '' when the engine gave none."""
    labels: list[int] | None
    """Each token's weight version as the engine labelled it; None where the engine labels none."""


@dataclass(frozen=True)
class EngineOutput:
    """A finished engine request: its samples, and the prompt tokens whose KV came from the engine's
    prefix cache (a resubmitted piece's kept KV)."""

    samples: list[SampleOutput]
    cached_tokens: int = 0


@dataclass
class GenResult:
    """The engine's answer to one GenRequest.

    ``min_version``/``max_version`` are the policy versions the engine served
    while producing the tokens (equal unless a sync happened in between).
    ``dropped`` is a reason string when the prompt could not be served (e.g.
    ``prompt_too_long``); then ``completions`` is empty. ``dropped="stale"``: the engine stopped it
    once no step could train it; ``min_version`` is then its oldest token's version and
    ``max_version`` the version whose load stopped it.
    """

    request_id: str
    engine_id: int
    prompt_ids: list[int]
    completions: list[Completion] = field(default_factory=list)
    min_version: int = 0
    max_version: int = 0
    dropped: str | None = None
    detail: str = ""


@dataclass
class SyncReport:
    """What an engine reports after loading one policy version."""

    engine_id: int
    policy_version: int
    bytes_received: int
    num_buckets: int
    num_tensors: int
    receive_s: float
    total_s: float
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds of each phase: the actor's (manifest_s, quiesce_s, update_s: the one call into the
    worker with the prefix-cache reset beside it, resume_s, ack_s where the engine acks itself) and
    the worker's split of it (worker_receive_s: wire and loads, worker_load_s: loads,
    worker_reload_init_s, worker_finalize_s)."""
    layout_digest: str = ""  # the manifest's layout, for the coordinator's ack
    copy_plan: str = ""  # direct loads: "learned" (vLLM's loader, recorded), "replayed" (a tensor at a time),
    # "replayed by bucket" (a bucket at a time: copyplan.BucketReplay), "loader"; else ""
    stamps: dict[str, float] = field(default_factory=dict)
    """Unix clock readings of the sync's events on this engine (one host's clock: the driver places
    them on its timeline): engine_in, update_call, worker_in, wire_start (the sender's header
    matched), wire_end, loaded, worker_out, update_return, engine_out."""
    cancelled: str = ""  # an armed receive the trainer called off (why); nothing was loaded


TIMELINE = {  # a sync's events, in their usual order -> what happened (the latest party's, where several)
    "trainer_in": "the trainer's push started (Ray's dispatch to it; armed: it had the driver's word)",
    "engine_in": "the engine actor's receive started (Ray's dispatch to it)",
    "update_call": "the engine called into vLLM's worker (manifest and quiesce done)",
    "worker_in": "vLLM's worker entered the update (the engine core picked the call up)",
    "worker_word": "the engine's worker had its word (an armed receive: the driver's, or the trainer's)",
    "trainer_send": "the trainer's sender entered (the push's own set-up done)",
    "trainer_planned": "the sender planned its buckets' packing",
    "trainer_header_copied": "the header on the trainer's device (its broadcast next)",
    "trainer_early_packed": "the trainer's first buckets packed as its step ended (an armed push)",
    "trainer_header": "the trainer posted its header (the send's set-up done; an armed push: before its word)",
    "trainer_first": "the trainer posted its first bucket's broadcast",
    "wire_start": "the sender's header matched on the worker (armed with the header first: the worker's word)",
    "worker_posted": "the worker posted its first buckets' receives (the wire runs once the trainer's are posted)",
    "trainer_out": "the trainer's push returned (its last bucket on the wire)",
    "wire_end": "the worker's host saw its last bucket received",
    "loaded": "the worker's loads done on its device (the stream synchronised)",
    "worker_out": "the worker left the update (bytes loaded)",
    "update_return": "the engine actor had the worker's answer",
    "engine_out": "the engine actor returned its report",
    "done": "the driver had every report and the version committed",
}


def sync_timeline(wall0: float, seconds: float, sent: list[dict], received: list) -> dict[str, float]:
    """Each ``TIMELINE`` event's seconds after the announce at unix time ``wall0``: the latest party's
    clock reading (the trainer ranks' pushes, the engines' ``SyncReport.stamps``; one host's clock, or
    synchronised ones); ``done`` is ``seconds``. Events no party reported are left out. Pure."""
    latest: dict[str, float] = {}
    for out in sent:
        for key in (k for k in TIMELINE if k.startswith("trainer_")):
            if f"{key}_unix_s" in out:
                latest[key] = max(latest.get(key, 0.0), float(out[f"{key}_unix_s"]))
    for report in received:
        for key, stamp in getattr(report, "stamps", {}).items():
            latest[key] = max(latest.get(key, 0.0), stamp)
    timeline = {k: latest[k] - wall0 for k in TIMELINE if k in latest}
    timeline["done"] = seconds
    return timeline
