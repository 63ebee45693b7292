"""``disagg generate``: standalone engines with real weights, for debugging an engine or a reward.

No trainer and no transport: the engines load ``model.path`` themselves
(``rollout.load_format=auto``), answer ``algorithm.prompts_per_step`` prompts
from the configured data with ``algorithm.group_size`` samples each (one, greedy,
with ``rollout.temperature=0``), and the configured reward scores them. Samples go to ``<run_dir>/samples.jsonl`` and a
table with the reward summary is printed.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from itertools import islice
from pathlib import Path

from disagg.cluster import connect, create_pools
from disagg.config import Config, resolve_device
from disagg.model.warmstart import prepare_model
from disagg.rollout.pool import RolloutPool
from disagg.rollout.types import GenRequest, SamplingSpec
from disagg.scoring import Scorer
from disagg.tasks import get_reward
from disagg.sandbox import require_filesystem_isolation
from disagg.train import encode_prompt, make_source

log = logging.getLogger("disagg.generate")


def run_generate(cfg: Config, run_dir: Path) -> dict[str, float]:
    from ray.util.placement_group import remove_placement_group
    from rich.console import Console
    from rich.table import Table
    from transformers import AutoTokenizer

    from disagg.control.auth import api_key

    run_dir.mkdir(parents=True, exist_ok=True)
    model_path = prepare_model(cfg)
    tok = AutoTokenizer.from_pretrained(model_path)
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    if cfg.reward.require_sandbox_isolation:
        require_filesystem_isolation()
    scorer = Scorer(get_reward(cfg.reward.name, cfg.reward.path), decode, cfg.algorithm)
    rows = list(islice(iter(make_source(cfg)), cfg.algorithm.prompts_per_step))
    device = resolve_device(cfg)
    connect(cfg, device)
    pools = create_pools(cfg, device, with_trainer=False)
    # no control plane here, so no token: off loopback the API needs rollout.api_key (env: or file:)
    pool = RolloutPool(cfg, pools.rollout_pg, device, str(model_path), coordinator=None,
                       api_key=api_key(cfg.rollout.api_key, None))
    try:
        pool.wait_started()
        greedy = cfg.rollout.temperature == 0  # one sample per prompt: greedy ones would all be equal
        spec = SamplingSpec(max_tokens=cfg.rollout.max_tokens, temperature=cfg.rollout.temperature,
                            top_p=cfg.rollout.top_p, n=1 if greedy else cfg.algorithm.group_size, greedy=greedy)
        reqs = [GenRequest(f"gen-{r.index}", encode_prompt(tok, r.prompt, cfg.data.add_bos), spec) for r in rows]
        results = pool.generate(reqs)
    finally:
        pool.shutdown()
        remove_placement_group(pools.rollout_pg)
    counts: Counter = Counter()
    rewards: list[float] = []
    table = Table(title=f"disagg generate: {model_path.name}")
    for col in ("prompt", "response", "reward"):
        table.add_column(col)
    with (run_dir / "samples.jsonl").open("w") as f:
        for row, res in zip(rows, results):
            if res.dropped:
                counts[f"dropped_{res.dropped}"] += 1
            for c in res.completions:
                text = decode(c.response_ids)
                reward = scorer.reward(text, row.row, counts)
                rewards.append(reward)
                f.write(json.dumps({"prompt": row.prompt, "response": text, "reward": reward,
                                    "response_ids": c.response_ids, "finish_reason": c.finish_reason}) + "\n")
                if len(table.rows) < 24:
                    table.add_row(row.prompt, text, f"{reward:.3f}")
            if res.dropped:
                f.write(json.dumps({"prompt": row.prompt, "dropped": res.dropped, "detail": res.detail}) + "\n")
    Console().print(table)
    summary = {"reward_mean": sum(rewards) / max(len(rewards), 1), "samples": len(rewards),
               **{k: float(v) for k, v in counts.items()}}
    print(json.dumps(summary))
    return summary
