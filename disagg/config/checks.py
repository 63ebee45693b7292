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
    _check(tr.dtype is None or tr.dtype in WIRE_DTYPES,
           f"transport.dtype={tr.dtype!r}: must be null (the trainer's dtype) or one of {', '.join(WIRE_DTYPES)}")
    _check_strings(cfg)
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
    _check(t.micro_batch_tokens >= 0,
           f"trainer.micro_batch_tokens={t.micro_batch_tokens}: must be >= 0 (0: no token budget)")
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


_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_ENGINE_DTYPES = ("auto", "float32", "float16", "bfloat16", "half", "float")  # vLLM's --dtype
_HOSTNAME = re.compile(r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*")


def _check_strings(cfg: Config) -> None:
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
