"""Config: every shipped YAML composes and validates; bad values name key and value."""

from pathlib import Path

import pytest

from disagg.config import Config, load_config
from disagg.errors import ConfigError

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _yaml_configs():
    return sorted(p.relative_to(CONFIGS).with_suffix("").as_posix() for p in CONFIGS.rglob("*.yaml")
                  if p.parent == CONFIGS)


@pytest.mark.parametrize("name", _yaml_configs())
def test_every_shipped_yaml_composes_and_validates(name):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        dc = compose(config_name=name)
    cfg = load_config(OmegaConf.to_container(dc, resolve=False))
    assert isinstance(cfg, Config)


@pytest.mark.parametrize("task", sorted(p.stem for p in (CONFIGS / "task").glob("*.yaml")))
def test_every_task_composes_and_validates(task):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        dc = compose(config_name="train", overrides=[f"task={task}"])
    cfg = load_config(OmegaConf.to_container(dc, resolve=False))
    assert cfg.data.task == task and cfg.reward.name == task


def test_calculator_task_needs_its_reward():
    with pytest.raises(ConfigError, match="reward.name=calculator"):
        load_config({"data": {"task": "calculator"}, "rollout": {"max_model_len": 256}})


def test_defaults_match_the_shipped_default_yaml():
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        dc = compose(config_name="train")
    data = OmegaConf.to_container(dc, resolve=False)
    data.pop("hydra", None)
    assert load_config(data) == load_config({})


@pytest.mark.parametrize(
    "data, needle",
    [
        ({"trainer": {"num_workers": 0}}, "trainer.num_workers=0"),
        ({"trainer": {"total_steps": "many"}}, "trainer.total_steps='many'"),
        ({"trainer": {"lr": -1.0}}, "trainer.lr=-1.0"),
        ({"algorithm": {"group_size": 1}}, "algorithm.group_size=1"),
        ({"rollout": {"max_tokens": 64, "max_model_len": 64}}, "rollout.max_tokens=64"),
        ({"rollout": {"load_format": "safetensors"}}, "rollout.load_format='safetensors'"),
        ({"rollout": {"load_format": "auto"}}, "rollout.load_format='auto'"),
        ({"cluster": {"device": "tpu"}}, "cluster.device='tpu'"),
        ({"rollout": {"engine": "tensorrt"}}, "rollout.engine='tensorrt'"),
        ({"transport": {"bucket_bytes": 0}}, "transport.bucket_bytes=0"),
        ({"transport": {"first_bucket_bytes": -1}}, "transport.first_bucket_bytes=-1"),
        ({"rollout": {"max_cudagraph_capture_size": 0}}, "rollout.max_cudagraph_capture_size=0"),
        ({"model": {"tiny": {"hidden_size": 32, "num_heads": 2}}}, "head_dim"),
        ({"model": {"path": "/nonexistent/model"}}, "model.path='/nonexistent/model'"),
        ({"trainer": {"bogus": 1}}, "trainer.bogus"),
        ({"reward": {"name": None, "path": None}}, "reward.name"),
        ({"rollout": {"gpu_memory_utilization": 1.5}}, "rollout.gpu_memory_utilization=1.5"),
        ({"trainer": {"grad_clip": True}}, "trainer.grad_clip=True"),
        ({"algorithm": {"sync_interval": 2}},
         "algorithm.sync_interval=2: must be <= max(1, algorithm.max_staleness=0)"),
        ({"algorithm": {"sync_interval": 0, "max_staleness": 2}}, "algorithm.sync_interval=0"),
    ],
)
def test_invalid_values_raise_one_message_naming_key_and_value(data, needle):
    with pytest.raises(ConfigError) as e:
        load_config(data)
    assert needle in str(e.value)


def test_lists_and_tuples_are_coerced():
    cfg = load_config({"data": {"train_files": ["a.jsonl"]}, "trainer": {"betas": [0.8, 0.9]}}, check=False)
    assert cfg.data.train_files == ("a.jsonl",)
    assert cfg.trainer.betas == (0.8, 0.9)


def test_generate_mode_loads_real_weights_and_train_mode_refuses_them():
    assert load_config({}, mode="generate").rollout.load_format == "auto"
    assert load_config({}).rollout.load_format == "dummy"


def test_greedy_is_for_generate_only():
    assert load_config({"rollout": {"temperature": 0}}, mode="generate").rollout.temperature == 0
    with pytest.raises(ConfigError, match="rollout.temperature=0"):
        load_config({"rollout": {"temperature": 0}})
    with pytest.raises(ConfigError, match="rollout.temperature=-1"):
        load_config({"rollout": {"temperature": -1}}, mode="generate")


def test_warmstart_keys_are_checked():
    with pytest.raises(ConfigError, match=r"model.warmstart.warmup_steps=-1: must be >= 0"):
        load_config({"model": {"warmstart": {"warmup_steps": -1}}})
    with pytest.raises(ConfigError, match=r"model.warmstart.lr=0.0: must be > 0"):
        load_config({"model": {"warmstart": {"lr": 0.0}}})


def test_a_wire_dtype_the_transport_cannot_send_is_refused_naming_the_key_and_value(model_cache):
    import torch

    from disagg.config.checks import WIRE_DTYPES
    from disagg.transport.manifest import DTYPE_BYTES
    from tests.conftest import small_config

    with pytest.raises(ConfigError, match=r"transport.dtype='float7': must be null .* one of bfloat16"):
        small_config(model_cache, transport={"dtype": "float7"})
    with pytest.raises(ConfigError, match=r"transport.dtype='int8'"):  # integers stay as they are on the wire
        small_config(model_cache, transport={"dtype": "int8"})
    assert small_config(model_cache, transport={"dtype": "bfloat16"}).transport.dtype == "bfloat16"
    floating = {n for n in DTYPE_BYTES if getattr(torch, n).is_floating_point}
    assert set(WIRE_DTYPES) == floating  # the check and the transport agree


# Every key of the schema, with how a bad value of it is caught (issue 32: validation coverage in one
# table). Keys typed int/float/bool/Literal/tuple/dict get a value of the wrong type; string keys get
# the bad value below, or are listed with why any string is accepted here or where it is checked later.
BAD_STRINGS = {
    "rollout.dtype": "float7", "rollout.vllm_log_level": "LOUD", "logging.level": "LOUD",
    "rollout.api_host": "not a host!", "control.host": "not a host!", "rollout.served_model_name": " ",
    "data.prompt_key": "", "logging.project": "", "reward.path": "no_function_here", "transport.dtype": "float7",
    "control.tls_cert": "/nonexistent.pem", "control.tls_key": "/nonexistent.key", "control.tls_ca": "/nonexistent.ca",
    "model.path": "/nonexistent", "resume": "/nonexistent",
    "rollout.api_key": "sk-a-literal-key", "rollout.api_tls_cert": "/nonexistent.pem",
    "rollout.api_tls_key": "/nonexistent.key", "rollout.api_tls_ca": "/nonexistent.ca",
}
STRINGS_CHECKED_LATER = {
    "reward.name": "the task registry, in `disagg train` before Ray starts (tests/integration/test_cli.py)",
    "rollout.tool_call_parser": "vLLM's parser registry, when the engine starts (the driver does not import vLLM)",
}
ANY_STRING = {
    "cluster.address": "a Ray address; Ray says whether it answers",
    "trainer.checkpoint_dir": "a path or fsspec URL, made when the first checkpoint is written",
    "model.cache_dir": "a directory, made when the model is",
    "logging.root_dir": "a directory, made with the run",
    "logging.run_name": "a free-form name (null: the run directory's)",
    "logging.mlflow_tracking_uri": "MLflow's own URI schemes; MLflow checks it",
    "run_dir": "a directory, made with the run",
}


def _schema_keys():
    import dataclasses
    import typing

    from disagg.config.schema import Config

    def walk(cls, prefix):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                yield from walk(hints[f.name], prefix + (f.name,))
            else:
                yield prefix + (f.name,), hints[f.name]

    return list(walk(Config, ()))


def _wrong_type(t):
    text = str(t)
    if "Literal" in text:
        return "nonsense"
    if t is bool or text == "bool | None":
        return "maybe"
    if t in (int, float) or text in ("int | None", "float | None"):
        return "abc"
    if text.startswith(("tuple", "dict")):
        return 12
    return None


def test_every_key_of_the_schema_is_refused_with_a_bad_value_naming_it_or_listed_with_why(model_cache):
    import copy

    from tests.conftest import SMALL

    keys = _schema_keys()
    untyped = {".".join(k) for k, t in keys if _wrong_type(t) is None}
    listed = set(BAD_STRINGS) | set(STRINGS_CHECKED_LATER) | set(ANY_STRING)
    assert untyped == listed, f"string keys not in the tables, or listed but not string keys: {sorted(untyped ^ listed)}"
    not_refused = []
    for key, t in keys:
        name = ".".join(key)
        bad = BAD_STRINGS.get(name, _wrong_type(t))
        if name in STRINGS_CHECKED_LATER or name in ANY_STRING:
            continue
        data = copy.deepcopy(dict(SMALL))
        data["model"] = {**data["model"], "cache_dir": str(model_cache)}
        node = data
        for part in key[:-1]:
            node = node.setdefault(part, {})
        node[key[-1]] = bad
        try:
            load_config(data)
            not_refused.append(f"{name}={bad!r}")
        except ConfigError as e:
            if name not in str(e):
                not_refused.append(f"{name}={bad!r}: the error does not name it ({e})")
    assert not not_refused, not_refused
