"""Cross-field checks of a built ``Config``, in one place.

Each raises a ``ConfigError`` that quotes the offending keys and values. Node
membership of ``cluster.*_nodes`` is checked later, once Ray is up (``disagg.cluster``).
"""

from __future__ import annotations

import ipaddress
import os
import re

from disagg.config.resolve import shares_gpus
from disagg.config.schema import ClusterConfig, Config
from disagg.errors import ConfigError


# The floating dtypes the transport can put on the wire (disagg.transport.manifest.DTYPE_BYTES;
# tests/unit/test_config.py holds the two together).
WIRE_DTYPES = ("bfloat16", "float16", "float32", "float64")


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def validate(cfg: Config, mode: str = "train") -> Config:
    """Cross-field checks, each raising a ConfigError that quotes the values: the range of every
    numeric key in ``RANGES``, then one check per concern in ``CHECKS``.

    ``mode`` is "train" (engines on dummy weights, fed by the trainer) or
    "generate" (standalone engines that load ``model.path`` themselves).
    """
    for key, rule, note in RANGES:
        v = _value(cfg, key)
        _check(_RULES[rule](v), f"{key}={v}: must be {rule}{note}")
    for check in CHECKS:
        check(cfg, mode)
    return cfg


_RULES = {">= 1": lambda v: v >= 1, "> 0": lambda v: v > 0, ">= 0": lambda v: v >= 0}

RANGES: tuple[tuple[str, str, str], ...] = (
    # (key, rule, what the message adds)
    ("trainer.num_workers", ">= 1", ""),
    ("trainer.total_steps", ">= 1", ""),
    ("trainer.micro_batch_size", ">= 1", ""),
    ("trainer.cpus_per_worker", ">= 1", ""),
    ("trainer.torch_threads", ">= 1", ""),
    ("rollout.num_engines", ">= 1", ""),
    ("rollout.tensor_parallel_size", ">= 1", ""),
    ("rollout.max_model_len", ">= 1", ""),
    ("rollout.max_tokens", ">= 1", ""),
    ("rollout.max_num_seqs", ">= 1", ""),
    ("rollout.cpus_per_engine", ">= 1", ""),
    ("algorithm.prompts_per_step", ">= 1", ""),
    ("transport.bucket_bytes", ">= 1", ""),
    ("transport.num_buffers", ">= 1", ""),
    ("transport.first_bucket_bytes", ">= 0", " (0: no ramp)"),
    ("data.num_digits", ">= 1", ""),
    ("trainer.lr", "> 0", ""),
    ("transport.timeout_s", "> 0", ""),
    ("control.rpc_timeout_s", "> 0", ""),
    ("cluster.placement_timeout_s", "> 0", ""),
    ("cluster.actor_timeout_s", "> 0", ""),
    ("rollout.start_timeout_s", "> 0", ""),
    ("trainer.gpus_per_worker", "> 0", ""),
    ("rollout.gpus_per_engine", "> 0", ""),
    ("rollout.health_interval_s", "> 0", ""),
    ("rollout.health_timeout_s", "> 0", ""),
    ("algorithm.max_staleness", ">= 0", ""),
    ("algorithm.sync_interval", ">= 1", ""),
    ("transport.max_sync_retries", ">= 0", ""),
    ("algorithm.kl_coef", ">= 0", ""),
    ("trainer.warmup_steps", ">= 0", ""),
    ("trainer.micro_batch_tokens", ">= 0", " (0: no token budget)"),
    ("trainer.checkpoint_every", ">= 0", " (0 = off)"),
    ("trainer.keep_checkpoints", ">= 0", " (0 = keep all)"),
    ("model.warmstart.steps", ">= 0", ""),
    ("model.warmstart.warmup_steps", ">= 0", ""),
    ("model.warmstart.grad_clip", ">= 0", ""),
    ("model.warmstart.batch_size", ">= 1", ""),
    ("model.warmstart.lr", "> 0", ""),
    ("agent.max_turns", ">= 1", ""),
    ("agent.max_tokens_per_turn", ">= 1", ""),
    ("agent.max_trajectory_tokens", ">= 1", ""),
    ("agent.num_runners", ">= 1", ""),
    ("agent.client_max_retries", ">= 0", ""),
    ("algorithm.is_cap", "> 0", ""),
    ("algorithm.num_minibatches", ">= 1", ""),
    ("reward.num_workers", ">= 0", ""),
    ("reward.latency_s", ">= 0", ""),
    ("trainer.step_delay_s", ">= 0", ""),
)
"""Every numeric key with a plain range, one row each."""


def _value(cfg: Config, key: str):
    out = cfg
    for part in key.split("."):
        out = getattr(out, part)
    return out


def _check_sampling(cfg: Config, mode: str) -> None:
    r = cfg.rollout
    if mode == "train":
        _check(r.temperature > 0, f"rollout.temperature={r.temperature}: training samples need a temperature > 0")
    else:
        _check(r.temperature >= 0, f"rollout.temperature={r.temperature}: must be >= 0 (0 = greedy)")
    _check(cfg.algorithm.group_size >= 2,
           f"algorithm.group_size={cfg.algorithm.group_size}: GRPO needs >= 2 samples per prompt")
    _check(0 < r.top_p <= 1, f"rollout.top_p={r.top_p}: must be in (0, 1]")
    _check(0 < r.gpu_memory_utilization < 1,
           f"rollout.gpu_memory_utilization={r.gpu_memory_utilization}: must be in (0, 1)")
    _check(r.max_tokens < r.max_model_len,
           f"rollout.max_tokens={r.max_tokens} must be < rollout.max_model_len={r.max_model_len}")
    _check(r.load_format == ("dummy" if mode == "train" else "auto"),
           f"rollout.load_format={r.load_format!r}: training engines start on dummy weights and wait for the "
           "trainer's first sync; 'auto' is for standalone `disagg generate`")
    _check(0 <= r.api_port_base < 65536, f"rollout.api_port_base={r.api_port_base}: must be in [0, 65535]")
    _check(r.max_cudagraph_capture_size is None or r.max_cudagraph_capture_size >= 1,
           f"rollout.max_cudagraph_capture_size={r.max_cudagraph_capture_size}: must be >= 1, or null for vLLM's "
           "default")


def _check_engine(cfg: Config, mode: str) -> None:
    """What ``rollout.engine=sglang`` cannot honour, each refused by its key (what it maps instead:
    ``disagg/rollout/sglang/__init__.py``); a CPU device that ``auto`` resolves to is refused before
    Ray starts (``resolve.resolve_device``)."""
    r = cfg.rollout
    if r.engine != "sglang":
        return
    refusals = [
        (cfg.cluster.device == "cpu", f"cluster.device={cfg.cluster.device!r}",
         "SGLang publishes no CPU build; use cluster.device=cuda (or rollout.engine=vllm)"),
        (r.tensor_parallel_size > 1, f"rollout.tensor_parallel_size={r.tensor_parallel_size}",
         "SGLang runs its tensor-parallel workers as processes of the engine actor, which the pool places "
         "on one GPU bundle; use 1"),
        (r.in_flight_at_sync == "keep", "rollout.in_flight_at_sync='keep'",
         "SGLang labels no token with its weight version and disagg has no count of a paused request's "
         "tokens there; use 'resubmit' or 'auto'"),
        (r.openai_api, "rollout.openai_api=true",
         "SGLang's OpenAI server is not behind disagg's weights gate (and its engine starts without a "
         "tokenizer: token ids in and out); leave rollout.openai_api unset (off with SGLang) or set it false"),
        (cfg.transport.load == "layerwise", "transport.load='layerwise'",
         "SGLang has no layerwise reload; use 'direct' or 'auto'"),
    ]
    for refused, what, why in refusals:
        _check(not refused, f"{what} with rollout.engine='sglang': {why}")


def _check_devices(cfg: Config, mode: str) -> None:
    """GPUs per rank, tensor parallelism, the transport backend on shared GPUs, CPU affinity."""
    t, r, tr = cfg.trainer, cfg.rollout, cfg.transport
    for key, v in (("trainer.gpus_per_worker", t.gpus_per_worker), ("rollout.gpus_per_engine", r.gpus_per_engine)):
        _check(v <= 1, f"{key}={v:g}: must be <= 1 (one GPU per rank; more GPUs = more workers or engines)")
    _check(r.gpus_per_engine == 1 or r.tensor_parallel_size == 1,
           f"rollout.gpus_per_engine={r.gpus_per_engine:g} with rollout.tensor_parallel_size={r.tensor_parallel_size}: "
           "tensor-parallel workers need a GPU each")
    _check(not shares_gpus(cfg) or tr.backend != "nccl",
           f"transport.backend='nccl' with trainer.gpus_per_worker={t.gpus_per_worker:g}, rollout.gpus_per_engine="
           f"{r.gpus_per_engine:g}: the trainer and the engines may share a GPU, and NCCL puts one rank per GPU; "
           "use transport.backend=gloo (or auto)")
    _check(tr.dtype is None or tr.dtype in WIRE_DTYPES,
           f"transport.dtype={tr.dtype!r}: must be null (the trainer's dtype) or one of {', '.join(WIRE_DTYPES)}")
    n_cpu = os.cpu_count() or 1
    for key, cores in (("trainer.cpu_affinity", t.cpu_affinity), ("rollout.cpu_affinity", r.cpu_affinity)):
        _check(cores is None or (len(cores) > 0 and all(0 <= c < n_cpu for c in cores)),
               f"{key}={list(cores) if cores is not None else None}: cores must be a non-empty list of ids in "
               f"[0, {n_cpu - 1}] (this machine has {n_cpu})")
    _check_cluster_placement(cfg.cluster)


def _check_storage(cfg: Config, mode: str) -> None:
    """Checkpoint and resume locations."""
    from disagg.storage import check_location, is_url

    for key, where in (("trainer.checkpoint_dir", cfg.trainer.checkpoint_dir), ("resume", cfg.resume)):
        if where is not None:
            check_location(key, where)
    _check(cfg.resume is None or is_url(cfg.resume) or os.path.isdir(os.path.expanduser(cfg.resume)),
           f"resume={cfg.resume!r}: not a directory (a run directory, a checkpoint directory or one checkpoint "
           "step_<N>)")


def _check_control(cfg: Config, mode: str) -> None:
    """The coordinator's TLS files and ports; the engines' API keys and TLS files."""
    c = cfg.control
    _check((c.tls_cert is None) == (c.tls_key is None),
           f"control.tls_cert={c.tls_cert!r}, control.tls_key={c.tls_key!r}: TLS needs both (or neither)")
    for key, v in (("control.tls_cert", c.tls_cert), ("control.tls_key", c.tls_key), ("control.tls_ca", c.tls_ca)):
        _check(v is None or os.path.isfile(os.path.expanduser(v)), f"{key}={v!r}: no such file")
    r = cfg.rollout
    _check((r.api_tls_cert is None) == (r.api_tls_key is None),
           f"rollout.api_tls_cert={r.api_tls_cert!r}, rollout.api_tls_key={r.api_tls_key!r}: TLS needs both "
           "(or neither)")
    for key, v in (("rollout.api_tls_cert", r.api_tls_cert), ("rollout.api_tls_key", r.api_tls_key),
                   ("rollout.api_tls_ca", r.api_tls_ca)):
        _check(v is None or os.path.isfile(os.path.expanduser(v)), f"{key}={v!r}: no such file")
    _check(r.api_key is None or r.api_key.startswith(("env:", "file:")),
           f"rollout.api_key={'<a literal key>' if r.api_key else repr(r.api_key)}: must be null (the control token), "
           "'env:NAME' or 'file:PATH'; a key written here would be written into the run's config.json")
    _check(0 <= c.port < 65536, f"control.port={c.port}: must be in [0, 65535]")
    _check(c.metrics_port is None or 0 <= c.metrics_port < 65536,
           f"control.metrics_port={c.metrics_port}: must be in [0, 65535] (0 = a free port) or null (off)")
    _check(not c.metrics_port or c.metrics_port != c.port,
           f"control.metrics_port={c.metrics_port} and control.port={c.port}: /metrics needs a port of its own")


def _check_model(cfg: Config, mode: str) -> None:
    """The embedded model's shape (vLLM's CPU attention, the tokenizer's size), or a local model.path."""
    if cfg.model.path is not None:
        if not os.path.isdir(os.path.expanduser(cfg.model.path)):
            raise ConfigError(f"model.path={cfg.model.path!r}: not a local directory (nothing can be downloaded)")
        return
    from disagg.vocab import vocab

    tiny, r = cfg.model.tiny, cfg.rollout
    kv = tiny.num_kv_heads or tiny.num_heads
    _check(kv >= 1 and tiny.num_heads % kv == 0,
           f"model.tiny.num_kv_heads={tiny.num_kv_heads}: must divide model.tiny.num_heads={tiny.num_heads}")
    n_vocab = len(vocab())
    _check(tiny.vocab_size is None or tiny.vocab_size >= n_vocab,
           f"model.tiny.vocab_size={tiny.vocab_size}: must be >= {n_vocab} (the embedded tokenizer's size) or null")
    _check(tiny.hidden_size % tiny.num_heads == 0 and tiny.hidden_size // tiny.num_heads in (32, 64, 128),
           f"model.tiny.hidden_size={tiny.hidden_size} / model.tiny.num_heads={tiny.num_heads}: "
           "head_dim must be 32, 64 or 128 (vLLM CPU attention)")
    _check(r.max_model_len <= tiny.max_position_embeddings,
           f"rollout.max_model_len={r.max_model_len} exceeds model.tiny.max_position_embeddings="
           f"{tiny.max_position_embeddings}")


def _check_task(cfg: Config, mode: str) -> None:
    """The reward a task needs, and the agent's limits."""
    rw = cfg.reward
    _check(rw.name is not None or rw.path is not None, "reward.name and reward.path are both null: set one")
    _check(cfg.data.task != "code" or cfg.data.train_files or rw.path is not None or rw.name != "reverse_digits",
           "data.task=code is scored by running the answer's tests: set reward.name=code_tests "
           "(reward.name=reverse_digits would score code as digits)")
    _check(cfg.data.task != "calculator" or cfg.data.train_files or rw.path is not None or rw.name == "calculator",
           f"data.task=calculator is scored on the final answer: set reward.name=calculator "
           f"(got reward.name={rw.name!r}); `disagg train task=calculator` sets both")
    ag = cfg.agent
    _check(ag.max_tool_result_chars >= 100,
           f"agent.max_tool_result_chars={ag.max_tool_result_chars}: must be >= 100 (room for error messages)")
    _check(ag.client_timeout_s is None or ag.client_timeout_s > 0,
           f"agent.client_timeout_s={ag.client_timeout_s}: must be > 0 or null (no timeout)")


def _check_batches(cfg: Config, mode: str) -> None:
    """The loss's clip, and how a step's groups split into mini-batches, in flight and over workers."""
    a, r, t = cfg.algorithm, cfg.rollout, cfg.trainer
    _check(0 < a.clip_eps < 1, f"algorithm.clip_eps={a.clip_eps}: must be in (0, 1)")
    _check(a.prompts_per_step % a.num_minibatches == 0,
           f"algorithm.num_minibatches={a.num_minibatches}: must divide algorithm.prompts_per_step="
           f"{a.prompts_per_step}")
    _check(a.sync_interval <= max(1, a.max_staleness),
           f"algorithm.sync_interval={a.sync_interval}: must be <= max(1, algorithm.max_staleness="
           f"{a.max_staleness}) (the engines would fall further behind than the staleness limit allows)")
    _check(r.max_inflight_groups >= a.prompts_per_step,
           f"rollout.max_inflight_groups={r.max_inflight_groups}: must be >= algorithm.prompts_per_step="
           f"{a.prompts_per_step} (a step needs that many groups)")
    if t.num_workers > 1:
        per = a.prompts_per_step * a.group_size
        _check(per >= t.num_workers,
               f"algorithm.prompts_per_step*group_size={per} is smaller than trainer.num_workers={t.num_workers}")


def _check_trackers(cfg: Config, mode: str) -> None:
    from disagg.trackers import check_backends

    check_backends(cfg.logging.backends, need_packages=mode == "train")


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


_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_ENGINE_DTYPES = ("auto", "float32", "float16", "bfloat16", "half", "float")  # vLLM's --dtype
_HOSTNAME = re.compile(r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*")


def _check_strings(cfg: Config, mode: str) -> None:
    """Keys whose type is a string but whose values are few or shaped: one row each."""
    r, c, lg = cfg.rollout, cfg.control, cfg.logging
    rows = [
        ("rollout.dtype", r.dtype, r.dtype in _ENGINE_DTYPES, f"one of {', '.join(_ENGINE_DTYPES)}"),
        ("rollout.vllm_log_level", r.vllm_log_level, r.vllm_log_level in _LOG_LEVELS, f"one of {', '.join(_LOG_LEVELS)}"),
        ("logging.level", lg.level, lg.level in _LOG_LEVELS, f"one of {', '.join(_LOG_LEVELS)}"),
        ("rollout.api_host", r.api_host, r.api_host == "node" or _is_host(r.api_host),
         "'node', an IP address or a host name"),
        ("control.host", c.host, _is_host(c.host), "an IP address or a host name"),
        ("rollout.served_model_name", r.served_model_name, bool(r.served_model_name.strip()), "a non-empty name"),
        ("data.prompt_key", cfg.data.prompt_key, bool(cfg.data.prompt_key.strip()), "a non-empty column name"),
        ("logging.project", lg.project, bool(lg.project.strip()), "a non-empty name"),
        ("reward.path", cfg.reward.path, cfg.reward.path is None or is_module_function(cfg.reward.path),
         "null or 'module:function'"),
    ]
    for key, value, ok, want in rows:
        _check(ok, f"{key}={value!r}: must be {want}")


def _is_host(text: str) -> bool:
    return _is_ip(text) or _HOSTNAME.fullmatch(text) is not None


def is_module_function(text: str) -> bool:
    """``text`` has the shape of a ``module:function`` reference (dotted module, one identifier);
    the one rule for every such config value (checked before Ray; imported later)."""
    module, _, func = text.partition(":")
    return bool(module) and func.isidentifier() and all(p.isidentifier() for p in module.split("."))


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


CHECKS = (_check_sampling, _check_engine, _check_devices, _check_strings, _check_storage, _check_control, _check_model,
          _check_task, _check_batches, _check_trackers)
"""One check per concern, in this order, after RANGES."""
