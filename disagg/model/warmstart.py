"""Prepare the base checkpoint the run starts from.

For ``model.path`` that is the user's directory, untouched. For the embedded
default it is the tiny model after a short supervised warm start on the task
format (RL from a random init barely moves; REFERENCE.md). The result is cached
under ``model.cache_dir`` keyed by everything that shapes it, like a
pretrained checkpoint, so repeated runs and tests skip the work.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

from disagg.config import Config

log = logging.getLogger("disagg.model")

_CACHE_FORMAT = 3  # 2: chat/tool tokens in the vocabulary; 3: warm-up + grad clip


def _cache_key(cfg: Config) -> str:
    blob = json.dumps(
        {
            "format": _CACHE_FORMAT,
            "tiny": {k: v for k, v in cfg.model.tiny.__dict__.items() if v is not None},
            "warmstart": cfg.model.warmstart.__dict__,
            "seed": cfg.model.seed,
            "num_digits": cfg.data.num_digits,
            "task": cfg.data.task,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def prepare_model(cfg: Config) -> Path:
    """Return the local HF directory that trainer and engines load."""
    if cfg.model.path is not None:
        return Path(os.path.expanduser(cfg.model.path)).resolve()
    root = Path(os.path.expanduser(cfg.model.cache_dir)) / "models"
    path = root / f"tiny-{cfg.data.task}-{_cache_key(cfg)}"
    if (path / "READY").exists():
        log.info("using cached warm-started tiny model %s", path)
        return path
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{path.name}.{os.getpid()}"
    log.info("building the tiny model and its %d-step warm start on task %s (cached afterwards as %s)",
             cfg.model.warmstart.steps, cfg.data.task, path)
    t0 = time.perf_counter()
    _build_and_warm_start(cfg, tmp)
    (tmp / "READY").write_text("ok\n")
    try:
        tmp.rename(path)
    except OSError:  # another process finished first: use theirs
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    log.info("built tiny model + %d-step warm start in %.1fs -> %s", cfg.model.warmstart.steps, time.perf_counter() - t0, path)
    return path


def _build_and_warm_start(cfg: Config, out: Path) -> None:
    import torch
    from tqdm import tqdm

    from disagg.trainer.grpo import linear_warmup

    from disagg.model.tiny import build_model, build_tokenizer, save_checkpoint

    model = build_model(cfg.model.tiny, seed=cfg.model.seed)
    tok = build_tokenizer()
    ws = cfg.model.warmstart
    if ws.steps > 0:
        torch.manual_seed(cfg.model.seed)
        seqs = _sft_sequences(cfg, tok, ws.steps * ws.batch_size)
        opt = torch.optim.AdamW(model.parameters(), lr=ws.lr)
        sched = linear_warmup(opt, ws.warmup_steps)
        model.train()
        bar = tqdm(range(ws.steps), desc="warm start", unit="step", disable=not cfg.logging.progress)
        for step in bar:
            chunk = seqs[step * ws.batch_size : (step + 1) * ws.batch_size]
            ids = [x for x, _ in chunk]
            labels = [[t if m else -100 for t, m in zip(x, mask)] for x, mask in chunk]
            n = max(len(x) for x in ids)
            input_ids = torch.tensor([x + [tok.pad_token_id] * (n - len(x)) for x in ids])
            lab = torch.tensor([y + [-100] * (n - len(y)) for y in labels])
            attn = (torch.arange(n)[None, :] < torch.tensor([len(x) for x in ids])[:, None]).long()
            loss = model(input_ids=input_ids, attention_mask=attn, labels=lab).loss
            opt.zero_grad()
            loss.backward()
            if ws.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), ws.grad_clip)
            opt.step()
            sched.step()
            bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
        log.info("warm start: %d steps, final loss %.3f", ws.steps, loss.item())
    model.eval()
    save_checkpoint(model, tok, out)


def _sft_sequences(cfg: Config, tok, n: int) -> list[tuple[list[int], list[int]]]:
    """``n`` (token ids, loss mask) demonstrations of the task's format."""
    if cfg.data.task == "calculator":
        from disagg.agent.format import ChatFormat
        from disagg.agent.tools import ToolRegistry
        from disagg.tasks.calculator import TOOLS, CalculatorSource

        tools = ToolRegistry.from_config(TOOLS).openai_tools()
        return CalculatorSource(cfg.data.num_digits, seed=cfg.model.seed).sft_sequences(
            n, cfg.model.seed, ChatFormat(tok), tools)
    from disagg.tasks.reverse import ReverseDigitsSource

    out = []
    for prompt, completion in ReverseDigitsSource(cfg.data.num_digits, seed=cfg.model.seed).sft_examples(
            n, seed=cfg.model.seed):
        p = [tok.bos_token_id] + tok.encode(prompt, add_special_tokens=False)
        c = tok.encode(completion, add_special_tokens=False) + [tok.eos_token_id]
        out.append((p + c, [0] * len(p) + [1] * len(c)))
    return out
