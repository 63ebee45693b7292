"""The one GRPO job ``disagg bench peers`` runs in disagg, verl and TRL, written once to a folder.

Same job everywhere means the same files, read by each framework its own way:

- ``model/``: a local HF directory (config, bf16 safetensors, the embedded tokenizer) that all three
  load. Its chat template renders a conversation as ``<s>`` + the user's text, so verl's and TRL's
  chat path gives the very token ids disagg makes from the raw prompt (``data.add_bos``).
  ``tiny``: the embedded model after its warm start (the default task's base); a shape
  (``qwen2.5-0.5b``, ``qwen2.5-1.5b``): random weights at that size.
- ``train.jsonl`` (disagg: ``prompt``, ``answer``), ``train.parquet`` / ``val.parquet`` (verl's
  columns), read in file order by every framework (no shuffling).
- ``reward.py``: ``disagg/bench/peers/job_reward.py`` as it is.
- ``job.json``: the job's settings (``PeerJob``), which each driver maps onto its framework's keys.

For a shape the responses follow a heavy tail, enforced inside every framework's vLLM by the same
logits processor (``disagg/bench/peers/vllm_lengths.py``).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

# A conversation rendered as BOS + the user's text: the token ids disagg encodes from the prompt text.
PEERS_CHAT_TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
SHAPES = ("tiny", "qwen2.5-0.5b", "qwen2.5-1.5b")


@dataclass(frozen=True)
class PeerJob:
    """One GRPO job, framework-neutral. Units: tokens, seconds, steps (one optimizer step each)."""

    shape: str = "tiny"
    """tiny (the embedded model, warm-started, on the default reverse-digits task) or a Qwen2.5 shape."""
    steps: int = 200
    """Train steps at most (each framework stops earlier when its time budget runs out)."""
    prompts_per_step: int = 32
    group_size: int = 8
    max_tokens: int = 8
    """Largest response (the tail's long length for a shape)."""
    max_prompt_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    lr: float = 5.0e-4
    """AdamW, constant (no warm-up, no decay), betas (0.9, 0.999), weight decay 0."""
    grad_clip: float = 1.0
    clip_eps: float = 0.2
    num_digits: int = 4
    seed: int = 0
    tail_short: int = 0
    """> 0: heavy-tailed responses of this many tokens ..."""
    tail_long: int = 0
    """... and a ``tail_fraction`` share of prompts with this many."""
    tail_fraction: float = 0.0
    eos_token_id: int = 2
    gpu_memory_utilization: float = 0.3
    """The engine's share of the GPU where it shares one with the trainer."""

    @property
    def heavy_tail(self) -> bool:
        return self.tail_short > 0

    @property
    def lengths_spec(self) -> str | None:
        """``DISAGG_PEERS_LENGTHS`` for the engines (``vllm_lengths.Lengths``), None without a tail."""
        if not self.heavy_tail:
            return None
        from disagg.bench.peers.lengths import Lengths

        return Lengths(self.tail_short, self.tail_long, self.tail_fraction, self.eos_token_id).spec()

    @property
    def max_model_len(self) -> int:
        return self.max_prompt_tokens + self.max_tokens + 8

    @property
    def micro_batch_size(self) -> int:
        """Samples per forward in the peers' trainers (disagg sizes its micro-batches by tokens)."""
        return 64 if self.shape == "tiny" else 8

    @property
    def samples_per_step(self) -> int:
        return self.prompts_per_step * self.group_size


def default_job(shape: str, **changes: Any) -> PeerJob:
    """The job of ``shape``: the default task's settings for ``tiny``; for a Qwen2.5 shape the long
    tail of ``disagg bench pipeline --device cuda`` (128 tokens, a tenth of prompts 2048) and a
    learning rate for a model of that size."""
    if shape not in SHAPES:
        raise ValueError(f"--shape must be one of {', '.join(SHAPES)}, got {shape!r}")
    base = PeerJob() if shape == "tiny" else PeerJob(shape=shape, steps=10, lr=1.0e-6, tail_short=128, tail_long=2048,
                                                      tail_fraction=0.1, gpu_memory_utilization=0.4)
    job = replace(base, **changes)
    return replace(job, max_tokens=job.tail_long) if job.heavy_tail else job


@dataclass(frozen=True)
class JobFiles:
    root: Path
    model: Path
    train_jsonl: Path
    train_parquet: Path
    val_parquet: Path
    reward: Path
    spec: Path


def job_files(root: Path) -> JobFiles:
    return JobFiles(root, root / "model", root / "train.jsonl", root / "train.parquet", root / "val.parquet",
                    root / "reward.py", root / "job.json")


def load_job(root: Path) -> PeerJob:
    return PeerJob(**json.loads((Path(root) / "job.json").read_text()))


def rows(job: PeerJob, n: int) -> list[dict[str, Any]]:
    """The job's first ``n`` prompts: the default task's seeded stream (``ReverseDigitsSource``)."""
    from disagg.tasks.reverse import ReverseDigitsSource

    source = ReverseDigitsSource(job.num_digits, seed=job.seed)
    return [{"index": i, **source.row_at(i).row} for i in range(n)]


def write_job(job: PeerJob, root: Path, model_cache: str | None = None) -> JobFiles:
    """Write ``job``'s folder (see the module's docstring); the model is built or taken from the cache."""
    root = Path(root)
    files = job_files(root)
    root.mkdir(parents=True, exist_ok=True)
    _write_model(job, files.model, model_cache)
    data = rows(job, job.steps * job.prompts_per_step + job.prompts_per_step)
    with open(files.train_jsonl, "w") as f:
        for r in data:
            f.write(json.dumps({"prompt": r["prompt"], "answer": r["answer"], "index": r["index"]}) + "\n")
    _write_verl_parquet(data, files.train_parquet)
    _write_verl_parquet(data[: job.prompts_per_step], files.val_parquet)
    shutil.copyfile(Path(__file__).with_name("job_reward.py"), files.reward)
    files.spec.write_text(json.dumps(asdict(job), indent=2))
    return files


def _write_verl_parquet(data: list[dict[str, Any]], path: Path) -> None:
    """verl's RL dataset columns: a chat prompt, the rule reward's ground truth, extra info."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist([
        {"data_source": "reverse_digits", "prompt": [{"role": "user", "content": r["prompt"]}],
         "reward_model": {"style": "rule", "ground_truth": r["answer"]}, "answer": r["answer"],
         "extra_info": {"index": r["index"]}} for r in data])
    pq.write_table(table, path)


def _write_model(job: PeerJob, out: Path, model_cache: str | None) -> None:
    """The job's base model at ``out`` in bf16 (every engine runs bf16; every trainer upcasts the same
    values), with the peers' chat template."""
    import torch
    from transformers import AutoModelForCausalLM

    from disagg.config.files import compose_train
    from disagg.config.load import load_config
    from disagg.model.tiny import build_model, build_tokenizer
    from disagg.model.warmstart import prepare_model

    overrides = [f"model.cache_dir={model_cache}"] if model_cache else []
    if job.shape != "tiny":
        overrides.append(f"shape={job.shape}")
    cfg = load_config(compose_train(overrides))
    if job.shape == "tiny":
        model = AutoModelForCausalLM.from_pretrained(prepare_model(cfg), dtype=torch.float32)
    else:
        model = build_model(cfg.model.tiny, seed=job.seed)
    tok = build_tokenizer()
    tok.chat_template = PEERS_CHAT_TEMPLATE
    model.to(torch.bfloat16)
    model.config.torch_dtype = torch.bfloat16
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
