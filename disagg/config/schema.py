"""The config schema: one frozen dataclass per section (and subsection) of ``configs/train.yaml``.

Each field carries its type and default, and a docstring saying what it is and its unit.
Nothing here reads files, checks values or imports more than the standard library:
``load`` builds these from a dict and ``checks`` validates them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(frozen=True)
class ClusterConfig:
    address: str | None = None
    """Ray address to connect to; null -> $RAY_ADDRESS, else start a local cluster (one of its own,
    also where `ray start` runs one here: `auto` joins that one)."""
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
    micro_batch_tokens: int = 32768
    """> 0: a micro-batch is also capped at this many padded tokens (rows x its longest sequence),
    its samples taken in order of length, so that long responses share micro-batches with each
    other and short ones do not pay for their padding (the gradient is the same: the loss is a
    token sum over the mini-batch's token count). 0: micro_batch_size samples in arrival order."""
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
    engine: Literal["vllm", "sglang"] = "vllm"
    """The inference engine each engine actor runs: 'vllm', or 'sglang' (GPUs only: SGLang publishes
    no CPU build; what it maps or refuses of the options below: ``disagg/rollout/sglang/__init__.py``)."""
    num_engines: int = 1
    """Inference engines (Ray actors) in the rollout placement group."""
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
    """On GPUs the share of the card vLLM takes; on CPU the KV cache's share of the memory of the
    NUMA node vLLM allocates on (``vllm_api.memory_args``; keep it small)."""
    max_num_seqs: int = 256
    """vLLM's max concurrent sequences per engine."""
    dtype: str = "float32"
    """Engine weight dtype."""
    enforce_eager: bool = True
    """Disable CUDA graphs / compilation (fast start on CPU)."""
    compile: bool | None = None
    """torch.compile the engine's model (where ``enforce_eager`` is off). null: the engine's default
    (vLLM compiles, SGLang does not). false with vLLM: no compilation, CUDA graphs of whole decode
    steps instead of compiled pieces (``cudagraph_mode`` FULL_DECODE_ONLY; prefills run eagerly): the
    engine starts without Dynamo and Inductor (10-17 s on a cold cache at 0.5B and below). true with
    SGLang: its ``enable_torch_compile``."""
    max_cudagraph_capture_size: int | None = None
    """The largest decode batch (sequences) vLLM captures a CUDA graph for; larger batches decode
    without graphs. null: vLLM's default, min(2 x max_num_seqs, 512). Raise it to max_num_seqs when
    more sequences than that run at once (a wide stream of groups): more graphs to capture at start."""
    cpus_per_engine: int = 1
    """CPUs in each rollout bundle."""
    gpus_per_engine: float = 1.0
    """GPUs in each rollout bundle (one bundle per tensor-parallel worker; cluster.device=cuda); a
    fraction shares a GPU with the trainer, see trainer.gpus_per_worker."""
    in_flight_at_sync: Literal["auto", "keep", "resubmit"] = "auto"
    """What a weight sync does with requests in flight. 'keep': they freeze and continue on the new
    weights with their KV cache, each response cut where the engine core counted its tokens at the
    pause (and checked against vLLM's own label of each token's version where vLLM labels them:
    0.32 does, 0.26 does not). 'resubmit': this actor's requests stop and continue on the new
    weights from their tokens so far, which the new version prefills again (any vLLM). 'auto':
    keep wherever the engine can tell each token's version (vLLM's labels, or the engine core's
    counts that disagg's vLLM plugin adds: both on 0.26 and 0.32), else resubmit."""
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
    """The engine's own log level in the engines (vLLM's; SGLang's ``log_level`` with rollout.engine=sglang).
    vLLM's layerwise reload warns on every sync about weight-less layers such as rotary embeddings and
    a tied lm_head."""
    scheduler: Literal["stream", "batch"] = "stream"
    """'stream': keep up to max_inflight_groups prompt groups generating and hand the trainer the
    first complete groups (unfinished ones carry over); 'batch': submit a step's groups together
    and wait for all of them (the synchronous pattern, for comparison)."""
    max_inflight_groups: int = 64
    """Upper bound on prompt groups generating at once (stream); admission control may allow fewer."""
    openai_api: bool | None = None
    """Each engine serves vLLM's OpenAI API (/v1/chat/completions, /v1/completions, ...) behind the
    same weights-loaded gate, and vLLM's Prometheus metrics at /metrics; the addresses are in
    `disagg ctl status`. null (the default): on where the engine has one behind the gate (vLLM), off
    where it has none (SGLang); true with rollout.engine=sglang is refused."""
    api_host: str = "127.0.0.1"
    """Interface the OpenAI API binds to; 'node' = the node's IP (reachable from other nodes). Bound
    off loopback, every request that arrives there needs the key (api_key), the probes excepted."""
    api_key: str | None = None
    """Where the key comes from that requests to an engine's OpenAI API off loopback must carry
    ('Authorization: Bearer <key>'): null = the job's control token (<run_dir>/control.token);
    'env:NAME' = the driver's environment variable NAME; 'file:PATH' = the file PATH (mode 0600).
    Not the key itself, which would be written into the run's config.json."""
    api_tls_cert: str | None = None
    """PEM certificate: the OpenAI API speaks HTTPS (with api_tls_key); it must name the engines'
    addresses. null = plain HTTP."""
    api_tls_key: str | None = None
    """PEM private key of api_tls_cert."""
    api_tls_ca: str | None = None
    """PEM the agent clients verify the engines against; null = api_tls_cert itself (self-signed)."""
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
    first_bucket_bytes: int = 0
    """The buckets ramp up from this size to bucket_bytes and back down (each 3x the one before):
    the first bucket is packed before any byte leaves and the last one loaded after the last
    arrives; 0 (or >= bucket_bytes): every bucket full. Off by default: on 2 x H200 (2026-11-29)
    a ramp from 32 MiB was no faster at 1.5B and 7B and slower at 0.5B (more buckets, each a
    receiver's host work before the next receive is posted)."""
    timeout_s: float = 120.0
    """Timeout of the group rendezvous and of every collective."""
    dtype: str | None = None
    """Wire dtype (e.g. 'bfloat16'); null -> the trainer parameters' dtype."""
    source: Literal["gather", "shards"] = "gather"
    """With FSDP: 'gather' (ranks gather full tensors in lockstep, rank 0 sends) or
    'shards' (every trainer rank sends its own shards over its own group)."""
    num_buffers: int = 2
    """Bucket buffers per side: packing/loading of one bucket overlaps the wire of the next."""
    nccl_high_priority: bool = False
    """NCCL groups run their broadcasts on a stream of the highest CUDA priority: on a GPU that packs
    (trainer) or loads (engine) one bucket while the next is on the wire, the broadcast's kernels
    are scheduled ahead of those copies. Both ends of a group take it from here. Off: on 2 x H200
    (2026-11-30) it was no faster (7B, 1 GiB buckets: 42.5 ms against 41.9 announce -> serving;
    0.5B: 4.45 against 4.39)."""
    verify: bool = False
    """Per-bucket checksums; a mismatch rejects the version (staged, costs one copy of the weights)."""
    load: Literal["auto", "layerwise", "direct"] = "auto"
    """How an engine loads what it receives: 'layerwise' (vLLM's layerwise reload: needed on CPU and
    for quantised models; a second copy of the weights and per-layer set-up), 'direct' (vLLM's loaders
    straight into the live parameters: unquantised models on GPUs); 'auto' -> direct on GPUs, else
    layerwise."""
    max_sync_retries: int = 3
    """A weight sync that fails (a dead receiver, a transport timeout) is retried on a rebuilt group
    this many times in a row before the run ends."""
    overlap_push: bool = True
    """With ``algorithm.max_staleness`` >= 1: each train step ends with a copy of the trainer's
    parameters (this rank's shards under FSDP), and the weight push sends that copy from a
    thread of its own while the next step trains. Costs one more copy of the (local) parameters
    on each trainer worker; not with ``source=gather`` over several workers (the gather is a
    collective of the trainer ranks), which then pushes between steps as with false."""
    delta: Literal["off", "on", "auto"] = "off"
    """'on': each sync sends only the elements whose bits changed since the version every engine
    holds (index lists or bit masks per bucket, a bucket dense where that is smaller), exactly: the
    engines apply it onto their copy of that version, refuse one made against another, and get a
    dense sync after joining or after a failed sync. For trainer and engines on different nodes,
    where the bytes decide the sync's time. Costs one copy of the weights in the wire dtype on each
    trainer worker and each engine worker, and a comparison pass per sync. 'auto': the same copies,
    and each sync goes as a delta or dense, whichever the syncs before took less time for (a delta
    tried again every 8 dense syncs; ``weight_sync/delta`` says which). 'off': every sync dense."""
    signals: Literal["socket", "store"] = "socket"
    """How the words that start and call off an armed sync travel (the driver's word to the trainer's
    push and the engines' receives, the trainer's to the engines): 'socket', a TCP connection from
    each sayer to a port each member listens on (one more port per trainer rank and engine worker,
    published in the group's store), where the waiting thread itself wakes; 'store', keys in the
    group's TCPStore, where a word wakes the store's server thread in the trainer's process and then
    the waiting client. Measured side by side (``disagg bench vllm-sync --signals store,socket``,
    2026-12-02): the trainer's push had the word 0.23 ms after the announce against 0.34 on an H200
    host, 0.45 against 0.90 on a 2-core machine."""
    arm: bool = True
    """With ``algorithm.max_staleness`` = 0 (the engines idle while the trainer trains): every engine's
    receive of the coming version waits on the transport group during the train step, beside the
    trainer's push, so the sync is the driver's word (``signals``) and the wire, with no Ray or vLLM
    dispatch after the step. The push's header goes out as it is set up and every engine takes it
    then, and the push packs its first buckets as the step ends: after the word only buckets are
    posted. Called off (the engines load nothing) when engines join or leave."""


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
    stale_groups: Literal["drop", "wait"] = "drop"
    """What happens to a prompt group that is still generating when the next step would leave it too
    stale for any later one (a long response of a heavy tail at a small staleness limit). 'drop': the
    steps go on; the group is stopped by its engine at the next sync and its samples are counted in
    ``samples/dropped_stale``. 'wait': the step waits for it (trainer idle, engines generating) and
    trains it, oldest first, so no sample is lost and the limit holds (AReaL bounds staleness the same
    way); ``samples/steps_held_for_old_groups`` counts the steps that waited. Stream scheduler only
    (the batch scheduler waits for every group anyway)."""
    sync_interval: int = 1
    """The engines take every N-th version the trainer makes (and its last); the steps between
    train on without a sync. Each sync interrupts generation (requests in flight pause, or are
    resubmitted on vLLM releases without keep mode), so with fast train steps at staleness >= 1 a
    longer interval keeps the engines generating. At most max(1, max_staleness); at run time it
    is capped by the staleness limit in force."""
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
