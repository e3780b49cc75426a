"""Policy losses (PPO, GSPO, CISPO, Clip-Cov, KL-Cov) and the critic's value loss.

Conventions in `reprorl.algos.masked`; the losses are differentiable in the current policy's
`log_prob` / the critic's `values`. `reprorl.algos.registry.POLICY_LOSSES` describes each
policy loss and calls it with one signature.
"""

from __future__ import annotations

from typing import Any

import torch

from reprorl.algos.masked import Count, agg_loss, check_same_shape, masked_mean, masked_sum
from reprorl.kernels.pinned import pinned_exp


def ppo_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float,
    loss_agg_mode: str,
    *,
    global_num_tokens: Count | None = None,
    global_num_seqs: Count | None = None,
    max_response_length: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017, arXiv:1707.06347) with dual-clip.

    Per token, with ratio r = exp(log_prob - old_log_prob) and advantage A:
        L = max(-A * r, -A * clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high))
    (separate low/high bounds: DAPO's clip-higher, Yu et al. 2025). For A < 0 the loss is
    also capped at -A * clip_ratio_c (dual-clip, Ye et al. 2020, arXiv:1912.09729), so a
    token whose ratio has grown huge cannot dominate the update.
    The per-token losses are reduced by `agg_loss` (keyword arguments passed on).

    old_log_prob, log_prob, advantages, response_mask: `[B, T]`.
    Returns (loss, stats); stats (detached scalars, token means over this batch):
    "clipfrac" (share of tokens where the clipped term was taken), "clipfrac_lower"
    (share where the dual-clip cap was taken), "approx_kl" (mean of old_log_prob -
    log_prob, the k1 estimate of KL(old || new), with the log-ratio clamped to [-20, 20]
    as the loss uses it).
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1.0 (the dual-clip cap on the ratio); got {clip_ratio_c}")
    check_same_shape(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)
    # exp(20) ~ 4.9e8 is finite in float32 (and bfloat16); an unclamped log-ratio of a
    # token whose probability collapsed could reach exp(~88) = inf and turn the loss NaN.
    log_ratio = (log_prob - old_log_prob).clamp(min=-20.0, max=20.0)
    ratio = pinned_exp(log_ratio)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)
    loss_cap = -advantages * clip_ratio_c
    negative = advantages < 0
    loss_mat = torch.where(negative, torch.minimum(loss_ppo, loss_cap), loss_ppo)
    loss = agg_loss(
        loss_mat,
        response_mask,
        loss_agg_mode,
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
        max_response_length=max_response_length,
    )
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean((loss_clipped > loss_unclipped).to(loss_mat.dtype), response_mask),
            "clipfrac_lower": masked_mean((negative & (loss_ppo > loss_cap)).to(loss_mat.dtype), response_mask),
            "approx_kl": masked_mean(-log_ratio, response_mask),
        }
    return loss, stats


def gspo_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    *,
    global_num_seqs: Count | None = None,
    global_num_tokens: Count | None = None,
    max_response_length: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025, arXiv:2507.18071): PPO's clip on a SEQUENCE-level ratio.

    Per sequence, s = exp(mean over its valid tokens of (log_prob - old_log_prob)), the
    geometric mean of its token ratios. Each token carries s's value with its own gradient,
    log s_t = sg[log s] + log_prob_t - sg[log_prob_t] (clamped at 10), and
        L_t = max(-A * s_t, -A * clip(s_t, 1 - clip_ratio_low, 1 + clip_ratio_high)),
    reduced "seq-mean-token-mean" whatever the actor's loss_agg_mode (as verl does: the
    sequence is GSPO's unit). Its clip ranges are small (the paper's 3e-4 / 4e-4): a mean
    log-ratio moves far less than a token's. No dual clip. `global_num_tokens` and
    `max_response_length` are taken and unused (its mode divides by sequences alone), so every
    policy loss takes the same norms. Stats "clipfrac" and "approx_kl" as `ppo_policy_loss`'s
    (the latter from the unclamped token log-ratios).
    """
    check_same_shape(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)
    log_ratio = log_prob - old_log_prob
    seq_log_ratio = masked_sum(log_ratio, response_mask, dim=-1) / response_mask.sum(dim=-1).clamp(min=1)  # [B]
    log_s = (log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)).clamp(max=10.0)
    s = pinned_exp(log_s)
    loss_unclipped = -advantages * s
    loss_clipped = -advantages * s.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_mat = torch.maximum(loss_unclipped, loss_clipped)
    loss = agg_loss(loss_mat, response_mask, "seq-mean-token-mean", global_num_seqs=global_num_seqs)
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean((loss_clipped > loss_unclipped).to(loss_mat.dtype), response_mask),
            "approx_kl": masked_mean(-log_ratio, response_mask),
        }
    return loss, stats


def cispo_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    loss_agg_mode: str,
    **norms: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, arXiv:2506.13585): clip the importance WEIGHT, not the update.

    Per token, with r = exp(clamp(log_prob - old_log_prob, -20, 20)):
        L = -sg[clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high)] * A * log_prob
    so every token keeps a gradient (REINFORCE's, weighted by the clipped, stopped ratio),
    where PPO's clip zeroes the gradient of clipped tokens. Reduced by `agg_loss`
    (`norms` passed on). Stats: "clipfrac" the share of tokens whose weight was clipped,
    "approx_kl" as `ppo_policy_loss`.
    """
    check_same_shape(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)
    log_ratio = (log_prob - old_log_prob).clamp(min=-20.0, max=20.0)
    ratio = pinned_exp(log_ratio)
    weight = ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high).detach()
    loss_mat = -weight * advantages * log_prob
    loss = agg_loss(loss_mat, response_mask, loss_agg_mode, **norms)
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean((ratio != weight).to(loss_mat.dtype), response_mask),
            "approx_kl": masked_mean(-log_ratio, response_mask),
        }
    return loss, stats


def token_priority(old_log_prob: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """A pseudo-random 32-bit priority per token `[B, T]` (int64), hashed from the bits of its
    old log-prob and advantage and its position: a random choice that is a function of the
    data alone, the same on every run, device, worker count and micro-batch cut (integer
    arithmetic, exact everywhere). Used where verl draws tokens with the global RNG."""
    mask32 = 0xFFFFFFFF
    a = old_log_prob.detach().to(torch.float32).contiguous().view(torch.int32).to(torch.int64) & mask32
    b = advantages.detach().to(torch.float32).contiguous().view(torch.int32).to(torch.int64) & mask32
    pos = torch.arange(old_log_prob.shape[-1], device=old_log_prob.device, dtype=torch.int64).expand_as(a)
    key = (a * 0x9E3779B1 + b) & mask32  # products of two 32-bit values stay below 2^63
    key = (key ^ (pos * 0x85EBCA77 & mask32)) & mask32
    for mult, shift in ((0x7FEB352D, 15), (0x846CA68B, 16)):  # an integer hash's finaliser
        key = ((key ^ (key >> shift)) * mult) & mask32
    return key ^ (key >> 16)


def clip_cov_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    loss_agg_mode: str,
    *,
    clip_cov_ratio: float = 0.0002,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    **norms: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs",
    arXiv:2505.22617): PPO's clip, plus no gradient for a few tokens of large covariance
    between advantage and log-prob, the tokens that drive the entropy down.

    Per token, cov = (A - mean A) * (log_prob - mean log_prob) over this batch's valid
    tokens. Candidates: valid tokens that PPO's clip did not take, with clip_cov_lb < cov <
    clip_cov_ub; max(1, int(clip_cov_ratio * valid tokens)) of them, chosen at random, lose
    their loss (and gradient): L = max(-A r, -A clip(r)) * (0 if chosen else 1). verl draws
    the choice with torch.randperm from the global RNG; here it takes the candidates of
    lowest `token_priority` (a random order fixed by the data). No dual clip, no log-ratio
    clamp (as verl). Reduced by `agg_loss` (`norms` passed on). Stats: "clipfrac" the share
    of tokens chosen, "approx_kl" as `ppo_policy_loss`."""
    check_same_shape(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)
    if clip_cov_ratio <= 0:
        raise ValueError(f"clip_cov_ratio must be > 0; got {clip_cov_ratio}")
    log_ratio = log_prob - old_log_prob
    ratio = pinned_exp(log_ratio)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    valid = response_mask > 0
    with torch.no_grad():
        cov = (advantages - masked_mean(advantages, response_mask)) * (
            log_prob - masked_mean(log_prob, response_mask))
        candidates = valid & ~(loss_clipped > loss_unclipped) & (cov > clip_cov_lb) & (cov < clip_cov_ub)
        count = max(int(clip_cov_ratio * int(response_mask.sum().item())), 1)
        keep = torch.ones_like(advantages)
        keep.view(-1)[_lowest(token_priority(old_log_prob, advantages), candidates, count)] = 0.0
    loss_mat = torch.maximum(loss_unclipped, loss_clipped) * keep
    loss = agg_loss(loss_mat, response_mask, loss_agg_mode, **norms)
    with torch.no_grad():
        stats = {"clipfrac": masked_mean((keep == 0).to(loss_mat.dtype), response_mask),
                 "approx_kl": masked_mean(-log_ratio, response_mask)}
    return loss, stats


def kl_cov_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    *,
    kl_cov_ratio: float = 0.0002,
    ppo_kl_coef: float = 1.0,
    **norms: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-Cov (the paper of `clip_cov_policy_loss`): the unclipped policy gradient, plus a
    KL penalty on the tokens of largest covariance between advantage and log-prob.

    Per token, L = -A r, and for the max(1, int(kl_cov_ratio * valid tokens)) valid tokens
    of largest cov = (A - mean A) * (log_prob - mean log_prob) (this batch's valid tokens)
    L = -A r + ppo_kl_coef * |log_prob - old_log_prob|. Ties in cov go to the earlier token
    (a stable sort: verl's torch.topk leaves them to the kernel). No clip (as verl).
    Reduced by `agg_loss`. Stats: "clipfrac" the share of tokens penalised, "approx_kl" as
    `ppo_policy_loss` (verl logs the mean |log-ratio| here)."""
    check_same_shape(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)
    if kl_cov_ratio <= 0:
        raise ValueError(f"kl_cov_ratio must be > 0; got {kl_cov_ratio}")
    log_ratio = log_prob - old_log_prob
    ratio = pinned_exp(log_ratio)
    valid = response_mask > 0
    with torch.no_grad():
        cov = (advantages - masked_mean(advantages, response_mask)) * (
            log_prob - masked_mean(log_prob, response_mask))
        count = max(int(kl_cov_ratio * int(valid.sum().item())), 1)
        chosen = torch.zeros_like(valid)
        chosen.view(-1)[_lowest(-cov, valid, count)] = True
    loss_mat = -advantages * ratio + torch.where(chosen, ppo_kl_coef * log_ratio.abs(), torch.zeros_like(ratio))
    loss = agg_loss(loss_mat, response_mask, loss_agg_mode, **norms)
    with torch.no_grad():
        stats = {"clipfrac": masked_mean(chosen.to(loss_mat.dtype), response_mask),
                 "approx_kl": masked_mean(-log_ratio, response_mask)}
    return loss, stats


def _lowest(key: torch.Tensor, eligible: torch.Tensor, count: int) -> torch.Tensor:
    """Flat indices of the (at most) `count` eligible elements of lowest `key`, ties to the
    earlier index (a stable sort: the same choice on every device)."""
    index = torch.nonzero(eligible.reshape(-1)).squeeze(-1)
    order = torch.sort(key.reshape(-1)[index], stable=True).indices
    return index[order[:count]]


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str,
    *,
    global_num_tokens: Count | None = None,
    global_num_seqs: Count | None = None,
    max_response_length: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss of the PPO critic (OpenAI baselines' PPO2, as verl).

    V_clip = clip(values, old_values - cliprange_value, old_values + cliprange_value);
    per token max((values - returns)^2, (V_clip - returns)^2); the loss is 0.5 times its
    `agg_loss`.

    values (current critic), old_values (critic at rollout), returns, response_mask:
    `[B, T]`. Returns (loss, clipfrac): clipfrac is the share of valid tokens where the
    clipped error was the larger one (detached).
    """
    check_same_shape(values=values, old_values=old_values, returns=returns, response_mask=response_mask)
    clipped = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    err_unclipped = (values - returns) ** 2
    err_clipped = (clipped - returns) ** 2
    loss = 0.5 * agg_loss(
        torch.maximum(err_unclipped, err_clipped),
        response_mask,
        loss_agg_mode,
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
        max_response_length=max_response_length,
    )
    clipfrac = masked_mean((err_clipped > err_unclipped).to(values.dtype), response_mask).detach()
    return loss, clipfrac
