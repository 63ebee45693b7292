"""``disagg bench peers``' own parts: the job every framework reads, the reward each calls, the lengths
every engine holds, each framework's settings from the job, and the summary of a run's steps."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest
import torch

from disagg.bench.peers import disagg_run, trl_run, verl_run
from disagg.bench.peers.job import default_job, write_job
from disagg.bench.peers.lengths import Lengths, StepTrace, force_lengths, target_length
from disagg.bench.peers.runs import (REWARD_WINDOW, PeerRun, RunResult, _stop_reason, engine_busy_s, first_reaching,
                               moving_average, read_trace, summarise)


@pytest.fixture(scope="module")
def tiny_job(tmp_path_factory):
    job = default_job("tiny", steps=3, prompts_per_step=4)
    return job, write_job(job, tmp_path_factory.mktemp("peers") / "job")


def test_the_chat_path_of_verl_and_trl_gives_the_token_ids_disagg_encodes(tiny_job):
    """verl and TRL render each prompt through the model's chat template; disagg encodes the raw text
    with BOS. The job's model directory makes both the same ids, for every prompt of the job."""
    import pyarrow.parquet as pq
    from transformers import AutoConfig, AutoTokenizer

    from disagg.train import encode_prompt

    job, files = tiny_job
    tok = AutoTokenizer.from_pretrained(files.model)
    rows = [json.loads(x) for x in files.train_jsonl.read_text().splitlines()]
    assert len(rows) == job.steps * job.prompts_per_step + job.prompts_per_step
    for r in rows:
        chat = tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                       tokenize=True, return_dict=True)["input_ids"]
        assert tuple(chat) == encode_prompt(tok, r["prompt"], add_bos=True), r
        assert len(chat) <= job.max_prompt_tokens
    verl = pq.read_table(files.train_parquet).to_pylist()
    assert [v["prompt"][0]["content"] for v in verl] == [r["prompt"] for r in rows]
    assert [v["reward_model"]["ground_truth"] for v in verl] == [r["answer"] for r in rows]
    cfg = AutoConfig.from_pretrained(files.model)
    assert cfg.vocab_size == len(tok)  # verl masks ids past the tokenizer in vLLM; the others do not
    assert str(cfg.dtype).endswith("bfloat16")


def test_the_jobs_reward_file_scores_as_the_embedded_task_in_every_framework_form(tiny_job):
    from disagg.tasks.reverse import reverse_digits_reward

    _, files = tiny_job
    spec = importlib.util.spec_from_file_location("copied_reward", files.reward)
    copied = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copied)
    rng = random.Random(3)
    for _ in range(300):
        answer = "".join(rng.choice("0123456789") for _ in range(4))
        response = "".join(rng.choice("0123456789 ") for _ in range(rng.randint(0, 6)))
        want = reverse_digits_reward(response, {"answer": answer})
        assert copied.compute_score("reverse_digits", response, answer) == want
        assert copied.trl_reward([[{"role": "assistant", "content": response}]], [answer]) == [want]
        assert copied.trl_reward([response], [answer]) == [want]
        assert copied.score_row(response, {"answer": answer}) == want


def test_each_prompt_keeps_one_length_and_the_tail_takes_its_share():
    lengths = Lengths(short=4, long=20, fraction=0.1, eos=2)
    rng = random.Random(0)
    prompts = [[1] + [rng.randrange(4, 14) for _ in range(5)] for _ in range(4000)]
    got = [target_length(p, lengths) for p in prompts]
    assert set(got) == {4, 20}
    assert got == [target_length(list(p), lengths) for p in prompts]  # a function of the ids alone
    assert abs(sum(g == 20 for g in got) / len(got) - 0.1) < 0.02
    assert Lengths.parse(lengths.spec()) == lengths
    with pytest.raises(ValueError, match="DISAGG_PEERS_LENGTHS='short=4'"):
        Lengths.parse("short=4")


def test_end_of_sequence_is_banned_before_the_target_and_forced_at_it():
    eos, vocab = 2, 10
    logits = torch.randn(4, vocab)
    before = logits.clone()
    logits[2, eos] = float("-inf")  # a row whose end-of-sequence another processor had banned
    # row 0 may also stop on id 9 (another end-of-sequence id of the model); row 3 is not held
    reqs = {0: (5, [7, 7], (2, 9)), 1: (5, [7, 7, 7, 7], (2, 9)), 2: (3, [7, 7], (2,))}
    out = force_lengths(logits, reqs, eos)
    assert out[0, eos] == float("-inf") and out[0, 9] == float("-inf") and torch.equal(out[0, 3:9], before[0, 3:9])
    assert torch.isfinite(out[1]).tolist() == [i == eos for i in range(vocab)] and out[1, eos] == before[1, eos]
    assert out[2, eos] == 0 and torch.isinf(out[2]).sum() == vocab - 1
    assert torch.equal(out[3], before[3])
    # sampling from the forced row can only end the sequence
    assert torch.multinomial(torch.softmax(out[1], -1), 50, replacement=True).eq(eos).all()


def test_the_step_trace_is_read_back_per_engine_process(tmp_path):
    trace = StepTrace(str(tmp_path))
    for _ in range(5):
        trace.record(3)
    times = read_trace(tmp_path)  # on disk as recorded: a killed engine leaves its trace whole
    assert len(times) == 1 and len(next(iter(times.values()))) == 5
    trace.close()


def test_engine_busy_time_counts_only_gaps_between_close_steps():
    times = [0.0, 0.1, 0.2, 0.3, 2.0, 2.1, 5.0]
    assert engine_busy_s(times, 0.0, 10.0, gap_s=0.25) == pytest.approx(0.4)
    assert engine_busy_s(times, 0.15, 10.0, gap_s=0.25) == pytest.approx(0.2)


def _steps(rewards, t0=100.0, step_s=0.5, tokens=1000, samples=256, sync_s=0.01):
    return [{"step": i + 1, "t": t0 + (i + 1) * step_s, "step_s": step_s, "samples": samples, "tokens": tokens,
             "reward": r, "sync_s": sync_s} for i, r in enumerate(rewards)]


def test_the_reward_target_needs_a_full_window_of_the_moving_average():
    rewards = [0.95] * 3 + [0.5] * 10 + [0.95] * 20
    ma = moving_average(rewards)
    assert ma[0] == 0.95 and ma[REWARD_WINDOW - 1] == pytest.approx((3 * 0.95 + 7 * 0.5) / 10)
    hit = first_reaching(_steps(rewards), 0.9)
    assert hit is not None and all(v < 0.9 for v in ma[REWARD_WINDOW - 1:hit]) and ma[hit] >= 0.9
    assert first_reaching(_steps([0.95] * (REWARD_WINDOW - 1)), 0.9) is None


def test_a_run_summary_takes_rates_after_the_warmup_and_times_from_launch(tmp_path):
    steps = _steps([0.5] * 10 + [1.0] * 10)
    steps[0]["step_s"] = steps[1]["step_s"] = 5.0  # slow warm-up steps, left out of the rates
    run = PeerRun(framework="trl", mode="colocate", gpus=1, correction="x", cmd=[], env={}, out=tmp_path)
    result = RunResult(exit_code=0, t_launch=60.0, t_end=120.0, steps=steps, stopped_by="target")
    trace = {"a": [100.0 + 0.1 * i for i in range(40)]}  # busy from 100.0 to 103.9
    e = summarise(run, result, shape="tiny", card="c", engine="vLLM x", warmup_steps=2, trace=trace)
    assert e["measured_steps"] == 18
    assert e["trained_tokens_per_s"] == pytest.approx(1000 / 0.5)
    assert e["samples_per_s"] == pytest.approx(256 / 0.5)
    assert e["setup_s"] == pytest.approx(100.5 - 5.0 - 60.0)
    hit = first_reaching(steps, 0.9)
    assert e["seconds_to_reward_0_9"] == pytest.approx(steps[hit]["t"] - 60.0)
    assert e["samples_to_reward_0_9"] == 256 * (hit + 1)
    m_start, m_end = steps[2]["t"] - 0.5, steps[-1]["t"]
    busy = engine_busy_s(trace["a"], m_start, m_end)
    assert e["engine_idle_share"] == pytest.approx(1 - busy / (m_end - m_start))
    assert [c["step"] for c in e["curve"]] == list(range(1, 21))
    empty = summarise(run, RunResult(1, 0.0, 1.0, [], "finished"), shape="tiny", card="c", engine="e",
                      warmup_steps=2)
    assert empty["error"] == "no train step completed" and "trained_tokens_per_s" not in empty


def test_a_run_stops_for_steps_budget_target_or_timeout():
    steps = _steps([0.95] * 15, t0=0.0, step_s=1.0)  # reaches 0.9 at index 9
    kw = dict(max_steps=100, budget_s=1000, timeout_s=1000, stop_after_target=None)
    assert _stop_reason(steps, now=16.0, t0=0.0, **kw) is None
    assert _stop_reason(steps, now=16.0, t0=0.0, **{**kw, "stop_after_target": 5}) == "target"
    assert _stop_reason(steps, now=16.0, t0=0.0, **{**kw, "stop_after_target": 6}) is None
    assert _stop_reason(steps, now=16.0, t0=0.0, **{**kw, "max_steps": 15}) == "steps"
    assert _stop_reason(steps, now=16.0, t0=0.0, **{**kw, "budget_s": 15.5}) == "budget"
    assert _stop_reason([], now=1001.0, t0=0.0, **kw) == "timeout"


def test_each_framework_gets_the_jobs_batch_sampling_and_optimizer(tiny_job, tmp_path):
    from disagg.config.files import compose_train
    from disagg.config.load import load_config

    _, files = tiny_job
    for job in (default_job("tiny"), default_job("qwen2.5-0.5b")):
        cfg = load_config(compose_train(disagg_run.overrides(job, files, 1, "sync", tmp_path / "run")))
        assert (cfg.algorithm.group_size, cfg.algorithm.prompts_per_step) == (job.group_size, job.prompts_per_step)
        assert (cfg.trainer.lr, cfg.trainer.weight_decay, cfg.trainer.grad_clip) == (job.lr, 0.0, job.grad_clip)
        assert (cfg.rollout.max_tokens, cfg.rollout.temperature) == (job.max_tokens, job.temperature)
        assert cfg.data.train_files == (str(files.train_jsonl),) and cfg.data.shuffle is False
        assert cfg.model.path == str(files.model)
        t = trl_run.config_kwargs(job, "colocate", tmp_path)
        assert t["per_device_train_batch_size"] * t["gradient_accumulation_steps"] == job.samples_per_step
        assert (t["num_generations"], t["max_completion_length"], t["learning_rate"]) == (
            job.group_size, job.max_tokens, job.lr)
        assert t["lr_scheduler_type"] == "constant" and t["weight_decay"] == 0.0 and t["shuffle_dataset"] is False
        v = dict(x.lstrip("+").split("=", 1) for x in verl_run.overrides(job, files, 1, "colocate"))
        assert int(v["data.train_batch_size"]) * int(v["actor_rollout_ref.rollout.n"]) == job.samples_per_step
        assert v["actor_rollout_ref.actor.ppo_mini_batch_size"] == v["data.train_batch_size"]  # one optimizer step
        assert float(v["actor_rollout_ref.actor.optim.lr"]) == job.lr
        assert int(v["data.max_response_length"]) == job.max_tokens
    with pytest.raises(ValueError, match="two GPUs"):
        verl_run.overrides(default_job("tiny"), files, 1, "separate_async")
    with pytest.raises(ValueError, match="two GPUs"):
        trl_run.plan(default_job("tiny"), files, 1, "server", tmp_path, None)


def test_runs_take_each_frameworks_best_mode_for_the_gpus_and_fall_back_in_order():
    from disagg.bench.peers.bench import parse_runs, parse_tail

    assert parse_runs("disagg,trl,verl", 1) == [[("disagg", "sync", None)], [("trl", "colocate", None)],
                                                 [("verl", "colocate", None)]]
    assert parse_runs("disagg,trl,verl", 2) == [[("disagg", "async", None)], [("trl", "server", None)],
                                                 [("verl", "separate_async", None)]]
    assert parse_runs("verl|verl:legacy,disagg:sync:tis", 1) == [
        [("verl", "colocate", None), ("verl", "legacy", None)], [("disagg", "sync", "tis")]]
    with pytest.raises(ValueError, match="'trl:sync'"):
        parse_runs("trl:sync", 1)
    assert parse_runs("disagg:async4", 1) == [[("disagg", "async4", None)]]
    for bad in ("disagg:async0", "disagg:asyncx", "disagg:colocate"):
        with pytest.raises(ValueError, match=f"'{bad}'.*sync, async or asyncN"):
            parse_runs(bad, 1)

    with pytest.raises(ValueError, match="'verl::tis'"):
        parse_runs("verl::tis", 1)
    assert parse_runs("disagg@rollout.compile=false,disagg:async5:tis@a.b=1@c=2", 1) == [
        [("disagg", "sync@rollout.compile=false", None)], [("disagg", "async5@a.b=1@c=2", "tis")]]
    for bad in ("trl@rollout.compile=false", "disagg:async@rollout.compile"):
        with pytest.raises(ValueError, match=f"'{bad}'.*disagg's runs only"):
            parse_runs(bad, 1)
    assert parse_tail("4,16,0.25") == {"tail_short": 4, "tail_long": 16, "tail_fraction": 0.25}
    with pytest.raises(ValueError, match="--tail='16,4,0.1'"):
        parse_tail("16,4,0.1")
    job = default_job("tiny", **parse_tail("4,16,0.25"))
    assert job.max_tokens == 16 and Lengths.parse(job.lengths_spec).long == 16


@pytest.mark.parametrize("mode,staleness", [("sync", 0), ("async", 1), ("async4", 4), ("async12", 12)])
def test_disaggs_modes_set_its_staleness(tiny_job, tmp_path, mode, staleness):
    from disagg.bench.peers import disagg_run

    job, files = tiny_job
    args = disagg_run.overrides(job, files, 1, mode, tmp_path / "run")
    assert f"algorithm.max_staleness={staleness}" in args


def test_a_disagg_runs_settings_reach_its_train_command(tiny_job, tmp_path):
    from disagg.bench.peers import disagg_run
    from disagg.bench.peers.bench import run_folder

    job, files = tiny_job
    folder = run_folder(1, "disagg", "async3@rollout.compile=false", "tis")
    assert folder == "01-disagg-async3_rollout.compile_false-tis"
    # planning composes the train config with hydra.run.dir under that folder: hydra must take it
    run = disagg_run.plan(job, files, 1, "async3@rollout.compile=false", tmp_path / folder, "tis")
    args = run.cmd[run.cmd.index("train") + 1:]
    assert "algorithm.max_staleness=3" in args and args[-2:] == ["rollout.compile=false", "algorithm.off_policy=tis"]
    assert run.mode == "async3@rollout.compile=false" and run.correction == "tis"


def test_a_failed_runs_log_keeps_its_first_error_and_its_end(tmp_path):
    from disagg.bench.peers.bench import log_excerpts

    log = tmp_path / "run.log"
    log.write_text("\n".join(["start"] * 5 + ["Traceback (most recent call last):", "  the cause"] +
                             [f"noise {i}" for i in range(200)]))
    out = log_excerpts(log, context=10)
    assert out["log_first_error"][:2] == ["Traceback (most recent call last):", "  the cause"]
    assert out["log_tail"][-1] == "noise 199" and len(out["log_tail"]) == 10


def test_ratios_compare_disaggs_best_run_with_each_peer():
    from disagg.bench.peers.bench import ratios

    entries = [{"framework": "disagg", "mode": "sync", "trained_tokens_per_s": 300.0, "seconds_to_reward_0_9": 50.0},
               {"framework": "disagg", "mode": "async", "trained_tokens_per_s": 400.0, "seconds_to_reward_0_9": 60.0},
               {"framework": "trl", "mode": "colocate", "trained_tokens_per_s": 100.0, "seconds_to_reward_0_9": 100.0},
               {"framework": "verl", "mode": "colocate", "skipped": "not installed"}]
    assert ratios(entries) == {"tokens_per_s disagg/trl:colocate": 4.0, "seconds_to_0.9 disagg/trl:colocate": 0.5}


def test_a_disagg_run_that_trained_another_job_is_not_compared_and_says_why():
    """The 0.5B heavy tail at staleness 1 (H100, 2026-12-07): disagg's async run dropped every long
    group as too stale and trained 128-token responses where TRL trained 428: its 3.01x was not a ratio."""
    from disagg.bench.peers.bench import ratios, render

    trl = {"framework": "trl", "mode": "colocate", "trained_tokens_per_s": 4015.0, "response_tokens_per_sample": 428.0}
    dropped = {"framework": "disagg", "mode": "async", "trained_tokens_per_s": 12071.0,
               "response_tokens_per_sample": 128.0, "samples_dropped": 176}
    shorter = dict(dropped, samples_dropped=0)
    kept = {"framework": "disagg", "mode": "sync", "trained_tokens_per_s": 7550.0,
            "response_tokens_per_sample": 410.0, "samples_dropped": 0}
    out = ratios([dropped, shorter, kept, trl])
    assert out["tokens_per_s disagg/trl:colocate"] == 7550.0 / 4015.0  # the fastest run of the same job
    assert out["not compared"] == ["disagg:async vs trl:colocate: disagg:async dropped 176 samples as too stale",
                                   "disagg:async vs trl:colocate: disagg:async trained 128 tokens a response, "
                                   "trl:colocate 428"]
    assert ratios([dropped, trl]) == {"not compared": out["not compared"][:1]}
    report = {"shape": "qwen2.5-0.5b", "card": "1 x H100", "engine": "vLLM 0.26.0", "runs": [], "ratios": out}
    assert render(report).splitlines()[-2:] == [f"not compared: {why}" for why in out["not compared"]]


def test_a_written_job_round_trips(tiny_job):
    from disagg.bench.peers.job import load_job

    job, files = tiny_job
    assert load_job(files.root) == job
    assert Path(files.reward).read_text() == (Path(disagg_run.__file__).with_name("job_reward.py")).read_text()


def test_disaggs_set_up_is_split_at_its_logged_milestones(tmp_path):
    log = tmp_path / "run.log"
    log.write_text("\n".join([
        "23:59:50 INFO [driver] disagg.train: run directory: x",
        "23:59:51 INFO [driver] disagg.cluster: starting a local Ray cluster (2 logical CPUs)",
        "(EngineActor pid=1) 00:00:20 INFO [rollout:0] disagg.rollout: engine started in 24.0s (vLLM 0.26.0)",
        "(TrainerWorker pid=2) 00:00:29 INFO [trainer:0] disagg.trainer: model loaded from /m (671616 parameters; "
        "read 0.4 s, to cuda:0 7.9 s, the rest 0.2 s)",
        "00:00:30 INFO [driver] disagg.job: pools up in 38.5s (engine start 24.0 s)",
        "00:00:30 INFO [driver] disagg.job: engine imports took 11.5 s",
        "00:00:31 INFO [driver] disagg.train: initial weights (version 1) synced: 10 bytes in 0.1s",
        "00:00:33 INFO [driver] disagg.train: step 1/200 {'reward': '0.5'}",
        "00:00:34 INFO [driver] disagg.train: step 2/200 {'reward': '0.5'}"]))
    assert disagg_run.setup_phases(log) == {"ray_up_s": 1, "pools_up_s": 40, "first_weights_s": 41,
                                            "first_step_s": 43, "engine_start_s": 24.0, "engine_imports_s": 11.5, "trainer_read_s": 0.4,
                                            "trainer_to_device_s": 7.9, "trainer_rest_s": 0.2}


def test_vllms_own_start_up_timings_are_read_from_any_frameworks_log(tmp_path):
    log = tmp_path / "run.log"
    log.write_text("\n".join([
        "(EngineCore pid=7) INFO 12-07 20:57:06 [gpu_model_runner.py:5150] Model loading took 0.9 GiB memory and 1.250000 seconds",
        "(EngineCore pid=7) INFO 12-07 20:57:20 [backends.py:1167] Dynamo bytecode transform time: 6.40 s",
        "(EngineCore pid=7) INFO 12-07 20:57:40 [monitor.py:20] torch.compile took 31.72 s in total",
        "(EngineCore pid=7) INFO 12-07 20:57:55 [gpu_model_runner.py:6582] Graph capturing finished in 14 secs, took 0.31 GiB",
        "(EngineCore pid=7) INFO 12-07 20:57:56 [core.py:402] init engine (profile, create kv cache, warmup model) "
        "took 49.80 s (compilation: 31.72 s)",
        "(EngineCore pid=9) INFO 12-07 21:07:40 [monitor.py:20] torch.compile took 2.00 s in total",  # a restart
    ]))
    assert disagg_run.vllm_phases(log) == {"vllm_model_load_s": 1.25, "vllm_dynamo_s": 6.4, "vllm_compile_s": 31.72,
                                           "vllm_graphs_s": 14.0, "vllm_init_engine_s": 49.8}
    log.write_text("12:00:00 INFO [driver] disagg.train: step 1/4 {'reward': '0.5'}\n")
    assert disagg_run.vllm_phases(log) == {}
