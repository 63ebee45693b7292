"""``disagg bench pipeline``'s options: the GPU defaults, the presets it picks, and overrides
composed under the bench's own settings (no Ray, no engine)."""

from __future__ import annotations

import pytest

from disagg.bench.pipeline import GPU_DEFAULTS, PipelineBenchOptions, _base_config, resolve_options


def test_cpu_keeps_the_cpu_defaults_and_composes_nothing():
    o = resolve_options({}, gpus=0)
    assert o == PipelineBenchOptions()
    assert o.overrides == () and o.device == "cpu"


def test_cuda_takes_the_gpu_defaults_the_05b_shape_and_a_cluster_preset_by_gpu_count():
    one = resolve_options({"device": "cuda"}, gpus=1)
    for name, value in GPU_DEFAULTS.items():
        assert getattr(one, name) == value, name
    assert one.overrides == ("cluster=one_gpu", "shape=qwen2.5-0.5b")
    two = resolve_options({"device": "auto"}, gpus=2)
    assert two.device == "cuda" and two.overrides == ("cluster=gpu", "shape=qwen2.5-0.5b")


def test_the_command_line_wins_over_the_gpu_defaults_and_presets():
    o = resolve_options({"device": "cuda", "tail_steps": 3, "pin_pools": True,
                         "overrides": ("shape=qwen2.5-1.5b", "cluster=gpu", "trainer.lr=1e-5")}, gpus=1)
    assert o.tail_steps == 3 and o.pin_pools is True
    assert o.tail_long == GPU_DEFAULTS["tail_long"]
    assert o.overrides == ("shape=qwen2.5-1.5b", "cluster=gpu", "trainer.lr=1e-5")


def test_bad_device_and_cuda_without_a_gpu_are_named():
    with pytest.raises(ValueError, match="--device must be cpu, cuda or auto, got 'tpu'"):
        resolve_options({"device": "tpu"}, gpus=0)
    with pytest.raises(ValueError, match="--device cuda: this process sees no GPU"):
        resolve_options({"device": "cuda"}, gpus=0)
    assert resolve_options({"device": "auto"}, gpus=0).device == "cpu"


def test_overrides_compose_the_presets_and_the_bench_settings_win():
    o = resolve_options({"overrides": ("shape=qwen2.5-0.5b", "rollout.max_num_seqs=7", "algorithm.max_staleness=5"),
                         "pin_pools": False}, gpus=0)
    cfg = _base_config(o, algorithm={"max_staleness": 1, "prompts_per_step": 3})
    assert cfg.model.tiny.hidden_size == 896 and cfg.model.tiny.num_layers == 24  # configs/shape/qwen2.5-0.5b.yaml
    assert cfg.rollout.max_num_seqs == 7  # the user's override
    assert cfg.algorithm.max_staleness == 1 and cfg.algorithm.prompts_per_step == 3  # the comparison's own
    assert cfg.cluster.device == "cpu" and tuple(cfg.logging.backends) == ("jsonl",)
    plain = _base_config(resolve_options({"pin_pools": False}, gpus=0))
    assert plain.model.tiny.hidden_size != 896
