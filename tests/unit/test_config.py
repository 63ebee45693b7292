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
        ({"transport": {"bucket_bytes": 0}}, "transport.bucket_bytes=0"),
        ({"model": {"tiny": {"hidden_size": 32, "num_heads": 2}}}, "head_dim"),
        ({"model": {"path": "/nonexistent/model"}}, "model.path='/nonexistent/model'"),
        ({"trainer": {"bogus": 1}}, "trainer.bogus"),
        ({"reward": {"name": None, "path": None}}, "reward.name"),
        ({"rollout": {"gpu_memory_utilization": 1.5}}, "rollout.gpu_memory_utilization=1.5"),
        ({"trainer": {"grad_clip": True}}, "trainer.grad_clip=True"),
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
