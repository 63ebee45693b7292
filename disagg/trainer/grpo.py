"""GRPO: group-normalised advantages and the PPO-clip token loss. Pure torch.

The importance ratio is taken against the behaviour log-probs that vLLM
returned for the exact tokens it sampled (``logprobs_mode=processed_logprobs``,
so temperature is applied on both sides). An optional k3 KL penalty pulls
towards a frozen reference policy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6, scale_by_std: bool = True) -> torch.Tensor:
    """``rewards`` is [num_groups, group_size]; returns advantages of the same shape.

    Each reward minus its group's mean, divided by the group's std (unbiased=False)
    plus ``eps`` when ``scale_by_std``. A group whose samples all scored the same
    gets zero advantage: it carries no signal for GRPO.
    """
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be [num_groups, group_size>=2], got {tuple(rewards.shape)}")
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not scale_by_std:
        return centred
    return centred / (rewards.std(dim=1, unbiased=False, keepdim=True) + eps)


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar to backpropagate (already divided by the normaliser)
    clip_frac: torch.Tensor  # summed over tokens (divide by token count to report)
    ratio_sum: torch.Tensor
    kl_behaviour_sum: torch.Tensor  # sum of (behaviour - current) log-prob: approx KL(behaviour || current)
    kl_ref_sum: torch.Tensor
    num_tokens: torch.Tensor


def ppo_clip_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    normaliser: float,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    mode: str = "ppo",
    proximal_logp: torch.Tensor | None = None,
    is_cap: float = 2.0,
) -> LossOutput:
    """Token-level policy loss, summed over masked tokens and divided by ``normaliser``.

    ``logp``, ``behaviour_logp``, ``mask``: [B, T]; ``advantages``: [B] (one per
    sample, broadcast over its tokens). Pass the global number of response tokens
    in the batch as ``normaliser`` so micro-batches and ranks add up to a token
    mean over the whole batch. ``mode``:

    - ``ppo``: PPO-clip of the ratio pi/mu to the behaviour policy mu.
    - ``tis``: truncated importance sampling, -min(pi/mu, is_cap) * A * log pi with the
      weight held constant: an unbiased-up-to-truncation policy gradient for stale samples.
    - ``decoupled``: decoupled PPO; the ratio pi/pi_prox to ``proximal_logp`` (the policy
      before this update) is clipped, and the whole term is weighted by min(pi_prox/mu, is_cap).

    ``clip_frac`` counts clipped ratios (ppo, decoupled) or truncated weights (tis).
    """
    mask = mask.to(logp.dtype)
    log_ratio = logp - behaviour_logp
    ratio = torch.exp(log_ratio)
    adv = advantages[:, None].to(logp.dtype)
    if mode == "ppo":
        unclipped = ratio * adv
        clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
        per_token = -torch.minimum(unclipped, clipped)
        clipped_tokens = (ratio - 1.0).abs() > clip_eps
    elif mode == "tis":
        weight = torch.clamp(ratio.detach(), max=is_cap)
        per_token = -weight * adv * logp
        clipped_tokens = ratio.detach() > is_cap
    elif mode == "decoupled":
        if proximal_logp is None:
            raise ValueError("decoupled PPO needs proximal_logp (the policy before this update)")
        weight = torch.clamp(torch.exp(proximal_logp - behaviour_logp), max=is_cap)
        r = torch.exp(logp - proximal_logp)
        per_token = -weight * torch.minimum(r * adv, torch.clamp(r, 1.0 - clip_eps, 1.0 + clip_eps) * adv)
        clipped_tokens = (r.detach() - 1.0).abs() > clip_eps
    else:
        raise ValueError(f"algorithm.off_policy must be ppo, tis or decoupled, got {mode!r}")
    kl_ref_sum = torch.zeros((), dtype=logp.dtype, device=logp.device)
    if ref_logp is not None and kl_coef > 0:
        d = ref_logp - logp
        k3 = torch.exp(d) - d - 1.0
        per_token = per_token + kl_coef * k3
        kl_ref_sum = (k3 * mask).sum().detach()
    loss = (per_token * mask).sum() / normaliser
    with torch.no_grad():
        clip_frac = (clipped_tokens.to(logp.dtype) * mask).sum()
        return_kwargs = dict(
            clip_frac=clip_frac,
            ratio_sum=(ratio * mask).sum(),
            kl_behaviour_sum=(-log_ratio * mask).sum(),
            kl_ref_sum=kl_ref_sum,
            num_tokens=mask.sum(),
        )
    return LossOutput(loss=loss, **return_kwargs)


@dataclass
class MismatchStats:
    """How far the engine's log-probs are from the trainer's for the same tokens (sums over tokens)."""

    abs_sum: float  # sum of |trainer - engine| log-prob
    abs_max: float
    over_cap: float  # tokens whose ratio trainer/engine exceeds is_cap (what tis and decoupled truncate)
    num_tokens: float


@torch.no_grad()
def mismatch_stats(trainer_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor,
                   is_cap: float) -> MismatchStats:
    """``trainer_logp`` (the trainer's policy before this update), ``engine_logp`` (what vLLM returned
    when it sampled) and ``mask``: [B, T]. On-policy samples: the engine's numerics alone (zero where
    both are exact); stale ones add how far the policy moved since their version."""
    m = mask.to(trainer_logp.dtype)
    d = (trainer_logp.float() - engine_logp.float()) * m
    over = (torch.exp(d) > is_cap).to(m.dtype) * m
    return MismatchStats(abs_sum=float(d.abs().sum()), abs_max=float(d.abs().max()) if d.numel() else 0.0,
                         over_cap=float(over.sum()), num_tokens=float(m.sum()))


def mismatch_summary(outs: list[dict]) -> dict[str, float]:
    """The step's mismatch figures from every trainer rank's sums (``TrainerWorker.train_step``):
    mean and max |trainer - engine| log-prob, share of tokens over ``is_cap``."""
    n = sum(o["mismatch_tokens"] for o in outs)
    if n == 0:
        return {}
    return {"logprob_mismatch_mean": sum(o["mismatch_abs_sum"] for o in outs) / n,
            "logprob_mismatch_max": max(o["mismatch_abs_max"] for o in outs),
            "is_over_cap_frac": sum(o["mismatch_over_cap"] for o in outs) / n}


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-prob of ``targets`` under ``logits / temperature`` ([B, T, V] -> [B, T])."""
    logits = logits.float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def linear_warmup(opt: torch.optim.Optimizer, warmup_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Learning rate ramping linearly over the first ``warmup_steps`` optimizer steps, then constant."""
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / (warmup_steps + 1)))
