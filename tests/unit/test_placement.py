"""Multi-node placement, without Ray: rank order, bundles with custom resources, node lists,
capacity checks, the config keys' validation and the shipped cluster presets."""

from pathlib import Path

import pytest

from disagg.cluster import bundles, check_capacity, label_selector, order_bundles, resolve_nodes
from disagg.config import load_config
from disagg.errors import ConfigError

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
A, B, C = "a" * 56, "b" * 56, "c" * 56  # Ray node ids


def _node(node_id: str, ip: str, **resources: float) -> dict:
    """One entry of ``ray.nodes()``."""
    return {"NodeID": node_id, "NodeManagerAddress": ip, "Alive": True, "Resources": resources}


@pytest.mark.parametrize(
    "bundle_nodes, ranks",
    [
        ({}, []),
        ({0: A, 1: A, 2: A}, [0, 1, 2]),
        ({0: A, 1: B, 2: A, 3: B}, [0, 2, 1, 3]),  # PACK split over two nodes, interleaved
        ({0: B, 1: A, 2: B, 3: A}, [0, 2, 1, 3]),  # nodes in the order of their lowest bundle, not by id
        ({3: A, 2: B, 1: A, 0: B}, [0, 2, 1, 3]),  # the table's key order does not matter
        ({0: A, 1: B, 2: C, 3: C, 4: B, 5: A}, [0, 5, 1, 4, 2, 3]),
    ],
)
def test_ranks_are_ordered_by_node_then_bundle(bundle_nodes, ranks):
    assert order_bundles(bundle_nodes) == ranks


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_custom_resources_are_in_every_bundle_of_their_pool_only(device):
    cfg = load_config({"trainer": {"num_workers": 2, "cpus_per_worker": 2},
                       "rollout": {"num_engines": 2, "tensor_parallel_size": 2},
                       "cluster": {"trainer_resources": {"trainer_node": 1},
                                   "rollout_resources": {"rollout_node": 0.5, "fast_disk": 1}}})
    tb, rb = bundles(cfg, device)
    gpu = {"GPU": 1.0} if device == "cuda" else {}
    assert tb == [{**gpu, "CPU": 2.0, "trainer_node": 1.0}] * 2
    assert rb == [{**gpu, "CPU": 1.0, "rollout_node": 0.5, "fast_disk": 1.0}] * 4
    tb[0]["CPU"] = 99.0  # each bundle is its own dict (the scaling code hands them to new groups)
    assert tb[1]["CPU"] == 2.0


def test_no_custom_resources_by_default():
    tb, rb = bundles(load_config({}), "cpu")
    assert tb == [{"CPU": 1.0}] and rb == [{"CPU": 1.0}]


def test_nodes_resolve_by_ip_or_id():
    nodes = [_node(A, "10.0.0.1"), _node(B, "10.0.0.2"), _node(C, "10.0.0.2")]
    assert resolve_nodes("cluster.trainer_nodes", (), nodes) == []
    assert resolve_nodes("cluster.trainer_nodes", ("10.0.0.1",), nodes) == [A]
    assert resolve_nodes("cluster.trainer_nodes", ("10.0.0.2",), nodes) == [B, C]  # every node on that IP
    assert resolve_nodes("cluster.trainer_nodes", (C, "10.0.0.2"), nodes) == [C, B]


def test_a_node_not_in_the_cluster_names_the_key_and_lists_the_nodes():
    nodes = [_node(A, "10.0.0.1"), _node(B, "10.0.0.2")]
    with pytest.raises(ConfigError) as e:
        resolve_nodes("cluster.rollout_nodes", ("10.0.0.2", "10.0.0.9"), nodes)
    msg = str(e.value)
    assert "cluster.rollout_nodes=['10.0.0.2', '10.0.0.9']" in msg and "'10.0.0.9'" in msg
    assert f"{A} (10.0.0.1)" in msg and f"{B} (10.0.0.2)" in msg


def test_label_selector_pins_bundles_to_the_node_ids():
    assert label_selector([]) == {}
    assert label_selector([A]) == {"ray.io/node-id": A}
    assert label_selector([A, B]) == {"ray.io/node-id": f"in({A},{B})"}


def _capacity(cluster: dict, nodes: list[dict], trainer_ids=(), rollout_ids=(), **sections) -> None:
    cfg = load_config({"cluster": cluster, **sections})
    tb, rb = bundles(cfg, "cpu")
    check_capacity(cfg, tb, rb, nodes, list(trainer_ids), list(rollout_ids))


def test_capacity_counts_custom_resources():
    nodes = [_node(A, "10.0.0.1", CPU=2.0, trainer_node=4.0), _node(B, "10.0.0.2", CPU=2.0, rollout_node=4.0)]
    _capacity({"trainer_resources": {"trainer_node": 1}, "rollout_resources": {"rollout_node": 1}}, nodes)
    with pytest.raises(ConfigError) as e:
        _capacity({"rollout_resources": {"gpu_box": 1}}, nodes)
    assert "cluster.rollout_resources.gpu_box=1" in str(e.value) and "has 0" in str(e.value)
    with pytest.raises(ConfigError) as e:  # 3 trainer bundles x 2 trainer_node > 4
        _capacity({"trainer_resources": {"trainer_node": 2}}, nodes, trainer={"num_workers": 3})
    assert "cluster.trainer_resources.trainer_node=2" in str(e.value) and "need 6" in str(e.value)
    with pytest.raises(ConfigError) as e:  # both pools ask for the same resource: their sum counts
        _capacity({"trainer_resources": {"trainer_node": 3}, "rollout_resources": {"trainer_node": 2}}, nodes)
    assert "cluster.trainer_resources.trainer_node=3 + cluster.rollout_resources.trainer_node=2" in str(e.value)


def test_capacity_of_a_pool_counts_only_its_nodes():
    nodes = [_node(A, "10.0.0.1", CPU=4.0), _node(B, "10.0.0.2", CPU=1.0)]
    _capacity({"rollout_nodes": ["10.0.0.1"]}, nodes, rollout_ids=[A], rollout={"num_engines": 4})
    with pytest.raises(ConfigError) as e:
        _capacity({"rollout_nodes": ["10.0.0.2"]}, nodes, rollout_ids=[B], rollout={"num_engines": 2})
    assert "cluster.rollout_nodes=['10.0.0.2']" in str(e.value) and "needs 2 CPU" in str(e.value)
    with pytest.raises(ConfigError, match="need 6 CPU, but the Ray cluster has 5"):
        _capacity({}, nodes, trainer={"num_workers": 2}, rollout={"num_engines": 4})


@pytest.mark.parametrize(
    "cluster, needle",
    [
        ({"trainer_resources": {"GPU": 1}}, "cluster.trainer_resources.GPU=1"),
        ({"rollout_resources": {"node:10.0.0.1": 0.01}}, "cluster.rollout_resources.node:10.0.0.1=0.01"),
        ({"rollout_resources": {"rollout_node": 0}}, "cluster.rollout_resources.rollout_node=0"),
        ({"rollout_resources": {"rollout_node": "one"}}, "cluster.rollout_resources.rollout_node='one'"),
        ({"trainer_resources": ["trainer_node"]}, "cluster.trainer_resources=['trainer_node']"),
        ({"trainer_nodes": ["gpu-box-1"]}, "cluster.trainer_nodes=['gpu-box-1']"),
        ({"rollout_nodes": ["10.0.0.1", "10.0.0.1"]}, "cluster.rollout_nodes=['10.0.0.1', '10.0.0.1']"),
        ({"rollout_nodes": [A[:-1]]}, f"cluster.rollout_nodes=['{A[:-1]}']"),
    ],
)
def test_bad_placement_keys_name_key_and_value(cluster, needle):
    with pytest.raises(ConfigError) as e:
        load_config({"cluster": cluster})
    assert needle in str(e.value)


def test_good_placement_keys():
    c = load_config({"cluster": {"trainer_nodes": ["10.0.0.1", "fd00::2"], "rollout_nodes": [A],
                                 "rollout_resources": {"rollout_node": 1}}}).cluster
    assert c.trainer_nodes == ("10.0.0.1", "fd00::2") and c.rollout_nodes == (A,)
    assert c.rollout_resources == {"rollout_node": 1.0} and c.trainer_resources == {}


def _compose(overrides: list[str]):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        dc = compose(config_name="train", overrides=overrides)
    return load_config(OmegaConf.to_container(dc, resolve=True))


@pytest.mark.parametrize("overrides, resources, nodes", [
    (["cluster=two_nodes_8gpu"], ({"trainer_node": 1.0}, {"rollout_node": 1.0}), ((), ())),
    (["cluster=two_nodes_8gpu_by_node", "cluster.trainer_nodes=[10.0.0.1]", "cluster.rollout_nodes=[10.0.0.2]"],
     ({}, {}), (("10.0.0.1",), ("10.0.0.2",))),
])
def test_cluster_presets_put_8_workers_and_8_engines_on_two_nodes(overrides, resources, nodes):
    cfg = _compose(overrides)
    c = cfg.cluster
    assert (cfg.trainer.num_workers, cfg.rollout.num_engines, cfg.rollout.tensor_parallel_size) == (8, 8, 1)
    assert c.device == "cuda" and cfg.rollout.api_host == "node"
    assert (c.trainer_resources, c.rollout_resources) == resources
    assert (c.trainer_nodes, c.rollout_nodes) == nodes


def test_the_one_gpu_preset_shares_a_gpu_and_syncs_over_gloo():
    from disagg.config import resolve_backend

    cfg = _compose(["cluster=one_gpu"])
    tb, rb = bundles(cfg, "cuda")
    assert tb[0]["GPU"] + rb[0]["GPU"] <= 1.0
    check_capacity(cfg, tb, rb, [_node(A, "10.0.0.1", CPU=16, GPU=1)], [], [])  # fits one GPU
    assert resolve_backend(cfg, "cuda") == "gloo"  # NCCL cannot put two ranks on one GPU
    assert (cfg.trainer.compute_dtype, cfg.rollout.dtype, cfg.transport.dtype) == ("bfloat16",) * 3
    with pytest.raises(ConfigError, match="NCCL puts one rank per GPU"):
        _compose(["cluster=one_gpu", "transport.backend=nccl"])


def test_direct_loading_is_refused_on_cpu_with_the_key_named():
    from disagg.config import resolve_backend

    cfg = _compose(["transport.load=direct"])
    assert resolve_backend(cfg, "cuda") == "nccl"  # accepted on GPUs
    with pytest.raises(ConfigError, match="transport.load='direct' needs cluster.device=cuda"):
        resolve_backend(cfg, "cpu")


def test_the_gpu_preset_gives_each_rank_a_gpu_and_syncs_over_nccl():
    from disagg.config import resolve_backend

    cfg = _compose(["cluster=gpu"])
    tb, rb = bundles(cfg, "cuda")
    assert tb == [{"GPU": 1.0, "CPU": 1.0}] and rb == [{"GPU": 1.0, "CPU": 1.0}]
    assert resolve_backend(cfg, "cuda") == "nccl"
    check_capacity(cfg, tb, rb, [_node(A, "10.0.0.1", CPU=32, GPU=2)], [], [])
    with pytest.raises(ConfigError) as e:  # on a one-GPU machine the error says what to do
        check_capacity(cfg, tb, rb, [_node(A, "10.0.0.1", CPU=16, GPU=1)], [], [])
    assert "need 2 GPU, but the Ray cluster has 1" in str(e.value) and "cluster=one_gpu" in str(e.value)


@pytest.mark.parametrize("overrides, needle", [
    ({"trainer": {"gpus_per_worker": 2}}, "trainer.gpus_per_worker=2: must be <= 1"),
    ({"rollout": {"gpus_per_engine": 0}}, "rollout.gpus_per_engine=0.0: must be > 0"),
    ({"rollout": {"gpus_per_engine": 0.5, "tensor_parallel_size": 2}}, "tensor-parallel workers need a GPU each"),
])
def test_bad_gpu_fractions_name_key_and_value(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(overrides)
    assert needle in str(e.value)


def test_every_cluster_preset_is_tested():
    tested = {"two_nodes_8gpu", "two_nodes_8gpu_by_node", "one_gpu", "gpu"}
    assert {p.stem for p in (CONFIGS / "cluster").glob("*.yaml")} == tested


def test_the_by_node_preset_fails_until_its_nodes_are_set():
    with pytest.raises(ConfigError, match="cluster.trainer_nodes="):
        _compose(["cluster=two_nodes_8gpu_by_node"])


def test_resources_override_from_the_command_line():
    cfg = _compose(["+cluster.trainer_resources.trainer_node=1", "++cluster.rollout_resources={rollout_node:2}"])
    assert cfg.cluster.trainer_resources == {"trainer_node": 1.0}
    assert cfg.cluster.rollout_resources == {"rollout_node": 2.0}


@pytest.mark.parametrize("shape, published", [("qwen2.5-0.5b", "qwen2-0.5b"), ("qwen2.5-1.5b", "qwen2-1.5b"),
                                             ("qwen2.5-7b", "qwen2-7b")])
def test_shape_presets_build_the_published_parameter_count(shape, published):
    """shape=... builds the embedded model at a published size (on the meta device: no memory); the
    embedded model ties its embeddings, so a published model with its own lm_head counts one less."""
    import torch

    from disagg.bench.shapes import SHAPES, num_parameters
    from disagg.model.tiny import build_model

    cfg = _compose([f"shape={shape}"])
    assert cfg.model.warmstart.steps == 0 and cfg.model.path is None
    with torch.device("meta"):
        model = build_model(cfg.model.tiny, seed=0)
    want = SHAPES[published]
    lm_head = 0 if want["tie_word_embeddings"] else want["vocab_size"] * want["hidden_size"]
    assert sum(p.numel() for p in model.parameters()) == num_parameters(published) - lm_head
    assert model.config.num_key_value_heads == want["num_key_value_heads"]
    assert model.config.vocab_size == want["vocab_size"]


def test_every_shape_preset_is_tested():
    assert {p.stem for p in (CONFIGS / "shape").glob("*.yaml")} == {"qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b"}


def test_a_bad_tiny_shape_names_key_and_value():
    with pytest.raises(ConfigError, match=r"model.tiny.num_kv_heads=3: must divide model.tiny.num_heads=2"):
        load_config({"model": {"tiny": {"num_kv_heads": 3}}})
    with pytest.raises(ConfigError, match=r"model.tiny.vocab_size=50: must be >= 106"):
        load_config({"model": {"tiny": {"vocab_size": 50}}})
