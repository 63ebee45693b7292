"""The root config: frozen dataclasses validated once, at the entry point.

Hydra composes YAML from ``configs/``; ``load_config`` turns the result into
these dataclasses, type-checks every field and runs the cross-field checks, so
a bad value fails before any actor starts, with one ``ConfigError`` naming the
key and the value. Each actor then gets only its own sub-config.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from disagg.errors import ConfigError


@dataclass(frozen=True)
class ClusterConfig:
    address: str | None = None
    """Ray address to connect to; null -> $RAY_ADDRESS, else start a local cluster."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Bundle kind: 'cuda' -> GPU bundles; 'cpu' -> CPU bundles; 'auto' -> cuda iff torch sees a GPU."""
    num_cpus: int | None = None
    """Logical CPUs of a local Ray cluster; null -> max(os.cpu_count(), what the pools need)."""
    placement_timeout_s: float = 120.0
    """How long to wait for both placement groups before failing."""
    actor_timeout_s: float = 600.0
    """Upper bound on any single call to a trainer or engine actor (ray.get timeout)."""
    trainer_resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources each trainer bundle also asks for (name -> amount), e.g. {trainer_node: 1}
    with `ray start --resources='{"trainer_node": 8}'` on the trainer's nodes; {} = none."""
    rollout_resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources each rollout bundle also asks for; see trainer_resources."""
    trainer_nodes: tuple[str, ...] = ()
    """Nodes the trainer pool may use: node IPs or Ray node ids (`ray list nodes`); empty = any node."""
    rollout_nodes: tuple[str, ...] = ()
    """Nodes the rollout pool may use: node IPs or Ray node ids; empty = any node."""


@dataclass(frozen=True)
class TrainerConfig:
    num_workers: int = 1
    """Trainer processes (one bundle each); > 1 shards the model with FSDP2."""
    total_steps: int = 200
    """Optimizer steps (= policy versions produced) in the run."""
    lr: float = 5e-4
    """AdamW learning rate."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up over the first optimizer steps (then constant): Adam's first
    steps move every weight by ~lr whatever its gradient, which can wreck a sharp warm-started policy."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    grad_clip: float = 1.0
    """Max global gradient norm; <= 0 disables clipping."""
    micro_batch_size: int = 64
    """Samples per forward/backward on one worker (gradient accumulation beyond it)."""
    seed: int = 1
    """Seed for the trainer's torch RNG (model init is the checkpoint's)."""
    cpus_per_worker: int = 1
    """CPUs in each trainer bundle."""
    gpus_per_worker: float = 1.0
    """GPUs in each trainer bundle (cluster.device=cuda). A fraction lets the trainer share a GPU with
    the engines (rollout.gpus_per_engine): a one-GPU machine. NCCL puts one rank per GPU, so the
    weight sync then goes over gloo, through host memory."""
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the forward and backward passes: 'bfloat16' runs them under torch.autocast (CUDA);
    the parameters, gradients and AdamW moments stay float32 either way."""
    torch_threads: int = 1
    """torch intra-op threads in each trainer worker on CPU."""
    cpu_affinity: tuple[int, ...] | None = None
    """CPU cores the trainer workers' threads are pinned to (null = the OS decides). With
    ``rollout.cpu_affinity`` it keeps the two pools off each other's cores on one machine."""
    step_delay_s: float = 0.0
    """Sleep this long after each optimizer step: simulates a slower trainer (tests, benchmarks)."""
    checkpoint_every: int = 0
    """Write a checkpoint (<checkpoint_dir>/step_<N>) every this many steps, and one after the
    last step; 0 = only when asked (`disagg ctl checkpoint`, `disagg ctl stop`). With
    algorithm.max_staleness > 0 a checkpoint may land one step later (it waits for an idle trainer)."""
    keep_checkpoints: int = 2
    """Complete checkpoints kept in the checkpoint directory: after each one is written, all but the
    newest this many are deleted (the one the run resumed from stays while it runs); 0 = keep all."""
    checkpoint_dir: str | None = None
    """Where this run's checkpoints go (step_<N> directories), somewhere every node reads: a path
    every node mounts (relative: to the launch directory), or an fsspec URL (s3://bucket/ckpt,
    gs://..., file:///shared/ckpt; the protocol's fsspec package on every node), through which
    each trainer rank copies its files up and each process that loads a checkpoint copies it down
    into model.cache_dir/checkpoints on its node. null = <run_dir>/checkpoints, or for a resumed
    run the directory of the checkpoint it resumed from."""


@dataclass(frozen=True)
class RolloutConfig:
    num_engines: int = 1
    """vLLM engines (Ray actors) in the rollout placement group."""
    tensor_parallel_size: int = 1
    """Bundles (GPUs) per engine."""
    load_format: Literal["dummy", "auto"] = "dummy"
    """'dummy': start on random weights and serve nothing until the first sync (training).
    'auto': load model.path's weights (standalone `disagg generate`, no trainer)."""
    max_model_len: int = 64
    """Engine context limit in tokens (prompt + response); longer prompts are dropped and counted."""
    max_tokens: int = 8
    """Max generated tokens per sample."""
    temperature: float = 1.0
    """Sampling temperature (the trainer scales its logits by the same value); 0 = greedy,
    allowed only in `disagg generate`."""
    top_p: float = 1.0
    """Nucleus sampling; must stay 1.0 for unbiased GRPO behaviour log-probs."""
    gpu_memory_utilization: float = 0.15
    """vLLM KV-cache fraction; on CPU a fraction of RAM (keep it small)."""
    max_num_seqs: int = 256
    """vLLM's max concurrent sequences per engine."""
    dtype: str = "float32"
    """Engine weight dtype."""
    enforce_eager: bool = True
    """Disable CUDA graphs / compilation (fast start on CPU)."""
    cpus_per_engine: int = 1
    """CPUs in each rollout bundle."""
    gpus_per_engine: float = 1.0
    """GPUs in each rollout bundle (one bundle per tensor-parallel worker; cluster.device=cuda); a
    fraction shares a GPU with the trainer, see trainer.gpus_per_worker."""
    in_flight_at_sync: Literal["auto", "keep", "resubmit"] = "auto"
    """What a weight sync does with requests in flight. 'keep': they freeze and continue on the new
    weights with their KV cache, vLLM labelling each token with the version that sampled it (needs
    a vLLM that labels tokens: 0.32 does, 0.26 does not). 'resubmit': this actor's requests stop and
    continue on the new weights from their tokens so far, which the new version prefills again
    (any vLLM). 'auto': keep where vLLM labels tokens, else resubmit."""
    cpu_affinity: tuple[int, ...] | None = None
    """CPU cores the engines' threads are pinned to (null = the OS decides); see trainer.cpu_affinity."""
    start_timeout_s: float = 300.0
    """Time for an engine to start before it is declared dead."""
    weights_wait_timeout_s: float = 600.0
    """How long a request waits for the first weights before failing."""
    health_interval_s: float = 5.0
    """How often the driver asks every engine whether it is alive (vLLM's own health check)."""
    health_timeout_s: float = 60.0
    """An engine that does not answer a health check within this is declared dead (stuck): it is
    killed, its prompt groups go back to the queue and a replacement starts."""
    replace_dead_engines: bool = True
    """Start a replacement for every engine that died (false: the pool shrinks)."""
    wait_log_interval_s: float = 10.0
    """Period of progress logs for long waits."""
    vllm_log_level: str = "ERROR"
    """vLLM's own log level in the engines (its layerwise reload warns on every sync about
    weight-less layers such as rotary embeddings and a tied lm_head)."""
    scheduler: Literal["stream", "batch"] = "stream"
    """'stream': keep up to max_inflight_groups prompt groups generating and hand the trainer the
    first complete groups (unfinished ones carry over); 'batch': submit a step's groups together
    and wait for all of them (the synchronous pattern, for comparison)."""
    max_inflight_groups: int = 64
    """Upper bound on prompt groups generating at once (stream); admission control may allow fewer."""
    openai_api: bool = True
    """Each engine serves vLLM's OpenAI API (/v1/chat/completions, /v1/completions, ...) behind the
    same weights-loaded gate, and vLLM's Prometheus metrics at /metrics; the addresses are in
    `disagg ctl status`."""
    api_host: str = "127.0.0.1"
    """Interface the OpenAI API binds to; 'node' = the node's IP (reachable from other nodes)."""
    api_port_base: int = 0
    """0: a free port per engine; otherwise engine i listens on api_port_base + i."""
    served_model_name: str = "policy"
    """The model name clients pass in OpenAI requests."""
    tool_call_parser: str | None = "hermes"
    """vLLM tool parser for the chat endpoint and the agent loop ('hermes' for Qwen2-family
    models and the tiny default); null disables tool calling on the chat endpoint."""


@dataclass(frozen=True)
class TransportConfig:
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Process-group backend; 'auto' -> nccl on cuda, gloo on cpu."""
    bucket_bytes: int = 256 * 1024 * 1024
    """Max bytes in one flat broadcast bucket."""
    timeout_s: float = 120.0
    """Timeout of the group rendezvous and of every collective."""
    dtype: str | None = None
    """Wire dtype (e.g. 'bfloat16'); null -> the trainer parameters' dtype."""
    source: Literal["gather", "shards"] = "gather"
    """With FSDP: 'gather' (ranks gather full tensors in lockstep, rank 0 sends) or
    'shards' (every trainer rank sends its own shards over its own group)."""
    num_buffers: int = 2
    """Bucket buffers per side: packing/loading of one bucket overlaps the wire of the next."""
    verify: bool = False
    """Per-bucket checksums; a mismatch rejects the version (staged, costs one copy of the weights)."""
    max_sync_retries: int = 3
    """A weight sync that fails (a dead receiver, a transport timeout) is retried on a rebuilt group
    this many times in a row before the run ends."""
    overlap_push: bool = True
    """With ``algorithm.max_staleness`` >= 1: each train step ends with a copy of the trainer's
    parameters (this rank's shards under FSDP), and the weight push sends that copy from a
    thread of its own while the next step trains. Costs one more copy of the (local) parameters
    on each trainer worker; not with ``source=gather`` over several workers (the gather is a
    collective of the trainer ranks), which then pushes between steps as with false."""


@dataclass(frozen=True)
class ControlConfig:
    host: str = "127.0.0.1"
    """Coordinator bind address (localhost unless set)."""
    port: int = 0
    """Coordinator port; 0 picks a free one (written to <run_dir>/coordinator.addr)."""
    rpc_timeout_s: float = 30.0
    """Timeout of every control-plane call."""
    tls_cert: str | None = None
    """PEM certificate: the coordinator speaks TLS (with ``tls_key``); null = plain gRPC."""
    tls_key: str | None = None
    """PEM private key of ``tls_cert``."""
    tls_ca: str | None = None
    """PEM the clients verify the server against; null = ``tls_cert`` itself (self-signed)."""
    metrics_port: int | None = 0
    """Port of the coordinator's Prometheus endpoint (``/metrics`` on ``host``, HTTPS with the TLS
    cert); 0 picks a free one (logged, shown by ``disagg ctl status``); null = no endpoint."""


@dataclass(frozen=True)
class AlgorithmConfig:
    name: Literal["grpo"] = "grpo"
    """RL algorithm."""
    group_size: int = 8
    """Samples per prompt; advantages are normalised within each group."""
    prompts_per_step: int = 32
    """Prompts per optimizer step (batch = prompts_per_step * group_size samples)."""
    clip_eps: float = 0.2
    """PPO clip range for the importance ratio against the behaviour log-probs."""
    kl_coef: float = 0.0
    """Weight of the k3 KL penalty to the reference (initial) policy; 0 = off."""
    adv_eps: float = 1e-6
    """Added to the group std when normalising advantages."""
    scale_by_std: bool = True
    """Divide group-centred rewards by the group std (GRPO) or not (Dr. GRPO)."""
    max_staleness: int = 0
    """Max policy versions between a sample's oldest token and the version being trained
    (0 = synchronous on-policy). Changeable at run time: `disagg ctl set-staleness N`."""
    off_policy: Literal["ppo", "tis", "decoupled"] = "ppo"
    """Loss against stale samples: 'ppo' clips the ratio to the behaviour policy; 'tis' is a policy
    gradient weighted by the truncated importance ratio min(pi/mu, is_cap); 'decoupled' clips the
    ratio to the proximal policy (the trainer's policy before this update) and weights by
    min(pi_prox/mu, is_cap). See docs/design.md."""
    is_cap: float = 2.0
    """Truncation of the importance weight for 'tis' and 'decoupled'."""
    num_minibatches: int = 1
    """Optimizer steps per batch (the batch split in this many mini-batches); > 1 makes the
    proximal policy of 'decoupled' differ from the current one after the first."""


@dataclass(frozen=True)
class TinyModelConfig:
    """Shape of the embedded model (a Qwen2 built from this config, nothing downloaded);
    configs/shape/*.yaml set the published Qwen2.5 shapes for runs at realistic sizes."""
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 2
    num_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); null = num_heads."""
    intermediate_size: int = 256
    max_position_embeddings: int = 256
    vocab_size: int | None = None
    """Rows of the (tied) embedding; null = the embedded tokenizer's size. A larger value gives the
    parameter count and sync bytes of a real vocabulary (151936 for Qwen2.5); the extra rows are
    tokens the tokenizer never produces."""


@dataclass(frozen=True)
class WarmStartConfig:
    steps: int = 60
    """Supervised steps on the task format before RL (0 = none); cached like a checkpoint."""
    batch_size: int = 64
    lr: float = 1e-3
    warmup_steps: int = 0
    """Linear learning-rate warm-up over the first steps (then constant)."""
    grad_clip: float = 1.0
    """Gradient-norm clip (0 = none); with warm-up it lets copying emerge (task=calculator)."""


@dataclass(frozen=True)
class ModelConfig:
    path: str | None = None
    """Local HF model directory; null -> build the embedded tiny model."""
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    """Shape of the embedded model."""
    warmstart: WarmStartConfig = field(default_factory=WarmStartConfig)
    """Supervised warm start of the embedded model."""
    seed: int = 0
    """Init seed of the embedded model."""
    cache_dir: str = "~/.cache/disagg"
    """Where built/warm-started models are cached."""


@dataclass(frozen=True)
class DataConfig:
    train_files: tuple[str, ...] = ()
    """JSONL/Parquet files with a prompt column; empty -> the synthetic task ``task``."""
    task: Literal["reverse_digits", "code", "calculator"] = "reverse_digits"
    """Synthetic task when no train_files: 'reverse_digits' (the embedded default), 'code'
    (write a Python function; scored by running assert tests in the sandbox with
    reward.name=code_tests; needs a real model.path) or 'calculator' (a multi-turn agent task:
    multiply numbers too large to guess by calling the calculator tool; `disagg train task=calculator`)."""
    prompt_key: str = "prompt"
    """Column holding the prompt text."""
    num_digits: int = 4
    """Synthetic reverse-digits task: digits per prompt."""
    shuffle: bool = True
    seed: int = 0
    add_bos: bool = True
    """Prepend the tokenizer's BOS token to each prompt."""


@dataclass(frozen=True)
class RewardConfig:
    name: str | None = "reverse_digits"
    """Registered reward function."""
    path: str | None = None
    """'module:function' reward (overrides name)."""
    num_workers: int = 2
    """Reward worker actors (CPU): each group is scored as soon as it finishes generating,
    while generation goes on; 0 = score on the driver."""
    cpus_per_worker: float = 0.0
    """CPUs each reward worker reserves from Ray (0: they share the machine)."""
    latency_s: float = 0.0
    """Extra seconds per scored sample (simulates a slow reward: benchmarks)."""
    require_sandbox_isolation: bool = False
    """Fail at start-up (driver, reward workers, agent runners) where the code sandbox that runs
    model code (the code_tests reward, the agent's python tool) cannot isolate the filesystem
    (neither bubblewrap nor mount namespaces work); false: run it there anyway, warned once."""


@dataclass(frozen=True)
class AgentConfig:
    """Multi-turn tool-calling rollouts (used when the task is an agent task, e.g. calculator)."""

    tools: tuple[str, ...] = ("calculator",)
    """Tools offered to the model: built-ins 'calculator', 'python' (the code sandbox), or a
    user function 'module:function' (schema from its signature, description from its docstring)."""
    max_turns: int = 4
    """Assistant turns per trajectory; a trajectory still calling tools after that ends ('max_turns')."""
    max_tokens_per_turn: int = 96
    """Generated tokens per assistant turn."""
    max_trajectory_tokens: int = 192
    """Token budget of a trajectory after its prompt (generated + tool-response tokens)."""
    python_timeout_s: float = 5.0
    """Wall-clock limit of one 'python' tool call (sandboxed, no network)."""
    max_tool_result_chars: int = 200
    """Tool results longer than this are truncated before tokenisation."""
    client_timeout_s: float | None = None
    """HTTP timeout of one engine request; null = none (a long generation is not cut off)."""
    client_max_retries: int = 0
    """Automatic retries of a failed engine request (0: a retry would re-submit a request id
    that may still be running)."""
    num_runners: int = 1
    """Agent-runner actors (each runs many trajectories concurrently, as asyncio tasks)."""


@dataclass(frozen=True)
class LoggingConfig:
    root_dir: str | None = None
    """Parent of run directories (hydra.run.dir is <root_dir>/<time>); relative: to the launch
    directory. null = $DISAGG_RUNS_DIR, else `runs` under the launch directory, or ~/disagg-runs
    when launched inside a Ray job's working-dir package (which Ray deletes); a root inside such a
    package is an error (disagg.paths)."""
    level: str = "INFO"
    backends: tuple[str, ...] = ("jsonl", "tensorboard")
    """Where per-step metrics go: any of jsonl, tensorboard, wandb, mlflow (disagg.trackers).
    <run_dir>/metrics.jsonl is written whether listed or not. wandb and mlflow are extras:
    pip install 'disagg[wandb]' / 'disagg[mlflow]'."""
    project: str = "disagg"
    """The wandb project and the MLflow experiment."""
    run_name: str | None = None
    """The tracker run's display name; null = the run directory's name."""
    wandb_mode: Literal["online", "offline"] | None = None
    """null = $WANDB_MODE, else online (needs `wandb login`); offline writes under $WANDB_DIR, else
    the run directory, for a later `wandb sync`."""
    mlflow_tracking_uri: str | None = None
    """null = $MLFLOW_TRACKING_URI, else sqlite:///<run_dir>/mlflow.db (artifacts in
    <run_dir>/mlflow-artifacts)."""
    plot: bool = True
    progress: bool = True
    """Show a progress bar."""


@dataclass(frozen=True)
class Config:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    control: ControlConfig = field(default_factory=ControlConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    run_dir: str | None = None
    """Run directory; null -> hydra's output directory. Never inside a Ray job's working-dir package."""
    resume: str | None = None
    """Continue a run: its run directory (the latest complete checkpoint), a checkpoint directory
    (trainer.checkpoint_dir: a path or fsspec URL; its latest complete checkpoint) or one checkpoint.
    Weights, optimizer, scheduler, RNG, data cursor and counters come from the checkpoint; everything
    else from this config (trainer.num_workers may differ). Steps, policy versions and metrics.jsonl
    continue in that run directory. null = a new run."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _coerce(key: str, tp: Any, value: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(key, a, value)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}={value!r}: invalid value")
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={value!r}: expected a mapping")
        key_tp, value_tp = typing.get_args(tp)
        return {_coerce(key, key_tp, k): _coerce(f"{key}.{k}", value_tp, v) for k, v in value.items()}
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r}: must be one of {list(allowed)}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            if isinstance(value, str) and typing.get_args(tp)[-1] is Ellipsis:
                value = [value]
            else:
                raise ConfigError(f"{key}={value!r}: expected a list")
        args = typing.get_args(tp)
        if args and args[-1] is Ellipsis:
            return tuple(_coerce(f"{key}[{i}]", args[0], v) for i, v in enumerate(value))
        if len(args) != len(value):
            raise ConfigError(f"{key}={value!r}: expected {len(args)} values")
        return tuple(_coerce(f"{key}[{i}]", a, v) for i, (a, v) in enumerate(zip(args, value)))
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}={value!r}: expected true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}={value!r}: expected an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}={value!r}: expected a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}={value!r}: expected a string")
        return value
    if tp is Any:
        return value
    raise ConfigError(f"{key}: unsupported config type {tp}")


RENAMED_KEYS = {
    "logging.tensorboard": "logging.tensorboard was replaced by logging.backends, a list of jsonl, tensorboard, "
                           "wandb, mlflow (default [jsonl,tensorboard]; logging.backends=[jsonl] turns TensorBoard off)",
}
"""Keys that were replaced -> the message that names the new key."""


def _build(cls: type, data: Any, prefix: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}={data!r}: expected a mapping")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        where = f"{prefix}." if prefix else ""
        if f"{where}{unknown[0]}" in RENAMED_KEYS:
            raise ConfigError(RENAMED_KEYS[f"{where}{unknown[0]}"])
        raise ConfigError(f"unknown config key {where}{unknown[0]} (known under {prefix or 'root'}: {sorted(names)})")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            key = f"{prefix}.{f.name}" if prefix else f.name
            kwargs[f.name] = _coerce(key, hints[f.name], data[f.name])
    return cls(**kwargs)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def validate(cfg: Config, mode: str = "train") -> Config:
    """Cross-field checks, each raising a ConfigError that quotes the values.

    ``mode`` is "train" (engines on dummy weights, fed by the trainer) or
    "generate" (standalone engines that load ``model.path`` themselves).
    """
    t, r, a, tr = cfg.trainer, cfg.rollout, cfg.algorithm, cfg.transport
    for key, v in [
        ("trainer.num_workers", t.num_workers),
        ("trainer.total_steps", t.total_steps),
        ("trainer.micro_batch_size", t.micro_batch_size),
        ("trainer.cpus_per_worker", t.cpus_per_worker),
        ("trainer.torch_threads", t.torch_threads),
        ("rollout.num_engines", r.num_engines),
        ("rollout.tensor_parallel_size", r.tensor_parallel_size),
        ("rollout.max_model_len", r.max_model_len),
        ("rollout.max_tokens", r.max_tokens),
        ("rollout.max_num_seqs", r.max_num_seqs),
        ("rollout.cpus_per_engine", r.cpus_per_engine),
        ("algorithm.prompts_per_step", a.prompts_per_step),
        ("transport.bucket_bytes", tr.bucket_bytes),
        ("transport.num_buffers", tr.num_buffers),
        ("data.num_digits", cfg.data.num_digits),
    ]:
        _check(v >= 1, f"{key}={v}: must be >= 1")
    for key, v in [
        ("trainer.lr", t.lr),
        ("transport.timeout_s", tr.timeout_s),
        ("control.rpc_timeout_s", cfg.control.rpc_timeout_s),
        ("cluster.placement_timeout_s", cfg.cluster.placement_timeout_s),
        ("cluster.actor_timeout_s", cfg.cluster.actor_timeout_s),
        ("rollout.start_timeout_s", r.start_timeout_s),
        ("trainer.gpus_per_worker", t.gpus_per_worker),
        ("rollout.gpus_per_engine", r.gpus_per_engine),
        ("rollout.health_interval_s", r.health_interval_s),
        ("rollout.health_timeout_s", r.health_timeout_s),
    ]:
        _check(v > 0, f"{key}={v}: must be > 0")
    if mode == "train":
        _check(r.temperature > 0, f"rollout.temperature={r.temperature}: training samples need a temperature > 0")
    else:
        _check(r.temperature >= 0, f"rollout.temperature={r.temperature}: must be >= 0 (0 = greedy)")
    _check(a.group_size >= 2, f"algorithm.group_size={a.group_size}: GRPO needs >= 2 samples per prompt")
    _check(a.max_staleness >= 0, f"algorithm.max_staleness={a.max_staleness}: must be >= 0")
    for key, v in (("trainer.gpus_per_worker", t.gpus_per_worker), ("rollout.gpus_per_engine", r.gpus_per_engine)):
        _check(v <= 1, f"{key}={v:g}: must be <= 1 (one GPU per rank; more GPUs = more workers or engines)")
    _check(r.gpus_per_engine == 1 or r.tensor_parallel_size == 1,
           f"rollout.gpus_per_engine={r.gpus_per_engine:g} with rollout.tensor_parallel_size={r.tensor_parallel_size}: "
           "tensor-parallel workers need a GPU each")
    _check(not shares_gpus(cfg) or tr.backend != "nccl",
           f"transport.backend='nccl' with trainer.gpus_per_worker={t.gpus_per_worker:g}, rollout.gpus_per_engine="
           f"{r.gpus_per_engine:g}: the trainer and the engines may share a GPU, and NCCL puts one rank per GPU; "
           "use transport.backend=gloo (or auto)")
    _check(tr.max_sync_retries >= 0, f"transport.max_sync_retries={tr.max_sync_retries}: must be >= 0")
    _check(0 < a.clip_eps < 1, f"algorithm.clip_eps={a.clip_eps}: must be in (0, 1)")
    _check(a.kl_coef >= 0, f"algorithm.kl_coef={a.kl_coef}: must be >= 0")
    _check(0 < r.top_p <= 1, f"rollout.top_p={r.top_p}: must be in (0, 1]")
    _check(
        0 < r.gpu_memory_utilization < 1,
        f"rollout.gpu_memory_utilization={r.gpu_memory_utilization}: must be in (0, 1)",
    )
    _check(
        r.max_tokens < r.max_model_len,
        f"rollout.max_tokens={r.max_tokens} must be < rollout.max_model_len={r.max_model_len}",
    )
    _check(t.warmup_steps >= 0, f"trainer.warmup_steps={t.warmup_steps}: must be >= 0")
    _check(t.checkpoint_every >= 0, f"trainer.checkpoint_every={t.checkpoint_every}: must be >= 0 (0 = off)")
    _check(t.keep_checkpoints >= 0, f"trainer.keep_checkpoints={t.keep_checkpoints}: must be >= 0 (0 = keep all)")
    from disagg.storage import check_location, is_url

    for key, where in (("trainer.checkpoint_dir", t.checkpoint_dir), ("resume", cfg.resume)):
        if where is not None:
            check_location(key, where)
    _check(cfg.resume is None or is_url(cfg.resume) or os.path.isdir(os.path.expanduser(cfg.resume)),
           f"resume={cfg.resume!r}: not a directory (a run directory, a checkpoint directory or one checkpoint "
           "step_<N>)")
    n_cpu = os.cpu_count() or 1
    for key, cores in (("trainer.cpu_affinity", t.cpu_affinity), ("rollout.cpu_affinity", r.cpu_affinity)):
        _check(cores is None or (len(cores) > 0 and all(0 <= c < n_cpu for c in cores)),
               f"{key}={list(cores) if cores is not None else None}: cores must be a non-empty list of ids in "
               f"[0, {n_cpu - 1}] (this machine has {n_cpu})")
    ws = cfg.model.warmstart
    for key, v in [("model.warmstart.steps", ws.steps), ("model.warmstart.warmup_steps", ws.warmup_steps),
                   ("model.warmstart.grad_clip", ws.grad_clip)]:
        _check(v >= 0, f"{key}={v}: must be >= 0")
    _check(ws.batch_size >= 1, f"model.warmstart.batch_size={ws.batch_size}: must be >= 1")
    _check(ws.lr > 0, f"model.warmstart.lr={ws.lr}: must be > 0")
    c = cfg.control
    _check((c.tls_cert is None) == (c.tls_key is None),
           f"control.tls_cert={c.tls_cert!r}, control.tls_key={c.tls_key!r}: TLS needs both (or neither)")
    for key, v in (("control.tls_cert", c.tls_cert), ("control.tls_key", c.tls_key), ("control.tls_ca", c.tls_ca)):
        _check(v is None or os.path.isfile(os.path.expanduser(v)), f"{key}={v!r}: no such file")
    _check(0 <= cfg.control.port < 65536, f"control.port={cfg.control.port}: must be in [0, 65535]")
    _check(c.metrics_port is None or 0 <= c.metrics_port < 65536,
           f"control.metrics_port={c.metrics_port}: must be in [0, 65535] (0 = a free port) or null (off)")
    _check(not c.metrics_port or c.metrics_port != c.port,
           f"control.metrics_port={c.metrics_port} and control.port={c.port}: /metrics needs a port of its own")
    _check_cluster_placement(cfg.cluster)
    if cfg.model.path is None:
        tiny = cfg.model.tiny
        kv = tiny.num_kv_heads or tiny.num_heads
        _check(kv >= 1 and tiny.num_heads % kv == 0,
               f"model.tiny.num_kv_heads={tiny.num_kv_heads}: must divide model.tiny.num_heads={tiny.num_heads}")
        from disagg.model.tiny import vocab

        n_vocab = len(vocab())
        _check(tiny.vocab_size is None or tiny.vocab_size >= n_vocab,
               f"model.tiny.vocab_size={tiny.vocab_size}: must be >= {n_vocab} (the embedded tokenizer's size) or null")
        _check(
            tiny.hidden_size % tiny.num_heads == 0 and tiny.hidden_size // tiny.num_heads in (32, 64, 128),
            f"model.tiny.hidden_size={tiny.hidden_size} / model.tiny.num_heads={tiny.num_heads}: "
            "head_dim must be 32, 64 or 128 (vLLM CPU attention)",
        )
        _check(
            r.max_model_len <= tiny.max_position_embeddings,
            f"rollout.max_model_len={r.max_model_len} exceeds model.tiny.max_position_embeddings="
            f"{tiny.max_position_embeddings}",
        )
    elif not os.path.isdir(os.path.expanduser(cfg.model.path)):
        raise ConfigError(f"model.path={cfg.model.path!r}: not a local directory (nothing can be downloaded)")
    _check(
        cfg.reward.name is not None or cfg.reward.path is not None,
        "reward.name and reward.path are both null: set one",
    )
    _check(
        r.load_format == ("dummy" if mode == "train" else "auto"),
        f"rollout.load_format={r.load_format!r}: training engines start on dummy weights and wait for the "
        "trainer's first sync; 'auto' is for standalone `disagg generate`",
    )
    _check(
        cfg.data.task != "code" or cfg.data.train_files or cfg.reward.path is not None
        or cfg.reward.name != "reverse_digits",
        "data.task=code is scored by running the answer's tests: set reward.name=code_tests "
        "(reward.name=reverse_digits would score code as digits)",
    )
    _check(
        cfg.data.task != "calculator" or cfg.data.train_files or cfg.reward.path is not None
        or cfg.reward.name == "calculator",
        f"data.task=calculator is scored on the final answer: set reward.name=calculator "
        f"(got reward.name={cfg.reward.name!r}); `disagg train task=calculator` sets both",
    )
    ag = cfg.agent
    for key, v in [("agent.max_turns", ag.max_turns), ("agent.max_tokens_per_turn", ag.max_tokens_per_turn),
                   ("agent.max_trajectory_tokens", ag.max_trajectory_tokens), ("agent.num_runners", ag.num_runners),
                   ]:
        _check(v >= 1, f"{key}={v}: must be >= 1")
    _check(ag.max_tool_result_chars >= 100,
           f"agent.max_tool_result_chars={ag.max_tool_result_chars}: must be >= 100 (room for error messages)")
    _check(ag.client_max_retries >= 0, f"agent.client_max_retries={ag.client_max_retries}: must be >= 0")
    _check(ag.client_timeout_s is None or ag.client_timeout_s > 0,
           f"agent.client_timeout_s={ag.client_timeout_s}: must be > 0 or null (no timeout)")
    _check(0 <= r.api_port_base < 65536, f"rollout.api_port_base={r.api_port_base}: must be in [0, 65535]")
    _check(a.is_cap > 0, f"algorithm.is_cap={a.is_cap}: must be > 0")
    _check(a.num_minibatches >= 1, f"algorithm.num_minibatches={a.num_minibatches}: must be >= 1")
    _check(a.prompts_per_step % a.num_minibatches == 0,
           f"algorithm.num_minibatches={a.num_minibatches}: must divide algorithm.prompts_per_step="
           f"{a.prompts_per_step}")
    _check(r.max_inflight_groups >= a.prompts_per_step,
           f"rollout.max_inflight_groups={r.max_inflight_groups}: must be >= algorithm.prompts_per_step="
           f"{a.prompts_per_step} (a step needs that many groups)")
    _check(cfg.reward.num_workers >= 0, f"reward.num_workers={cfg.reward.num_workers}: must be >= 0")
    _check(cfg.reward.latency_s >= 0, f"reward.latency_s={cfg.reward.latency_s}: must be >= 0")
    _check(cfg.trainer.step_delay_s >= 0, f"trainer.step_delay_s={cfg.trainer.step_delay_s}: must be >= 0")
    from disagg.trackers import check_backends

    check_backends(cfg.logging.backends, need_packages=mode == "train")
    if cfg.trainer.num_workers > 1:
        per = a.prompts_per_step * a.group_size
        _check(
            per >= cfg.trainer.num_workers,
            f"algorithm.prompts_per_step*group_size={per} is smaller than trainer.num_workers={t.num_workers}",
        )
    return cfg


# Resources a bundle gets from other keys (trainer.cpus_per_worker, cluster.device, cluster.*_nodes).
_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")
_NODE_ID = re.compile(r"[0-9a-f]{56}")


def _check_cluster_placement(c: ClusterConfig) -> None:
    """Custom resources and node lists of the two pools (membership is checked once Ray is up)."""
    for key, res in (("cluster.trainer_resources", c.trainer_resources),
                     ("cluster.rollout_resources", c.rollout_resources)):
        for name, amount in res.items():
            _check(name not in _BUILTIN_RESOURCES and not name.startswith("node:"),
                   f"{key}.{name}={amount:g}: list only custom resources here (CPUs and GPUs come from "
                   "trainer.cpus_per_worker / rollout.cpus_per_engine and cluster.device, nodes from cluster.*_nodes)")
            _check(amount > 0, f"{key}.{name}={amount:g}: must be > 0")
    for key, nodes in (("cluster.trainer_nodes", c.trainer_nodes), ("cluster.rollout_nodes", c.rollout_nodes)):
        for node in nodes:
            _check(_is_ip(node) or _NODE_ID.fullmatch(node) is not None,
                   f"{key}={list(nodes)}: {node!r} is neither a node IP nor a Ray node id (56 hex digits, "
                   "`ray list nodes`)")
        _check(len(set(nodes)) == len(nodes), f"{key}={list(nodes)}: a node is listed twice")


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def load_config(data: dict[str, Any] | None, *, check: bool = True, mode: str = "train") -> Config:
    """Build the validated Config from a plain dict (e.g. ``OmegaConf.to_container``)."""
    data = dict(data or {})
    data.pop("hydra", None)
    if mode == "generate":
        data["rollout"] = {**(data.get("rollout") or {}), "load_format": "auto"}
    cfg = _build(Config, data, "")
    return validate(cfg, mode) if check else cfg


def resolve_device(cfg: Config) -> str:
    """'cpu' or 'cuda' for this run's bundles."""
    if cfg.cluster.device != "auto":
        return cfg.cluster.device
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


def shares_gpus(cfg: Config) -> bool:
    """Whether trainer and engine bundles ask for fractions of a GPU (so that they may share one)."""
    return cfg.trainer.gpus_per_worker < 1 or cfg.rollout.gpus_per_engine < 1


def resolve_backend(cfg: Config, device: str) -> str:
    if cfg.transport.backend != "auto":
        if cfg.transport.backend == "nccl" and device != "cuda":
            raise ConfigError("transport.backend='nccl' needs cluster.device=cuda; use 'gloo' on CPU")
        return cfg.transport.backend
    return "nccl" if device == "cuda" and not shares_gpus(cfg) else "gloo"
