"""Policy losses that replace PPO's hard clip: SAPO's soft gate, GMPO's geometric mean,
DPPO's probability-difference mask, and GPG's plain policy gradient.

Conventions in `reprorl.algos.masked`; each is differentiable in `log_prob` and returns
(loss, stats) with "clipfrac" and "approx_kl", as `reprorl.algos.policy_losses`.
`reprorl.algos.registry.POLICY_LOSSES` describes each and calls it with one signature.
"""

from __future__ import annotations

from typing import Any

import torch

from reprorl.algos.masked import Count, agg_loss, at_least_one, check_same_shape, masked_mean, masked_sum
from reprorl.kernels.pinned import pinned_exp


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    # Through pinned_exp, so that a pinned CPU process gets the same bits on every machine
    # (torch.sigmoid has no pinned twin). x >= -tau here: exp(-x) cannot overflow.
    return 1.0 / (1.0 + pinned_exp(-x))


def sapo_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    **norms: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization", arXiv:2511.20347): a
    smooth gate on the ratio instead of PPO's hard clip.

    Per token, with r = exp(clamp(log_prob - old_log_prob, -20, 20)) and tau = tau_pos
    where A > 0, tau_neg elsewhere:
        f(r) = sigmoid(tau * (r - 1)) * 4 / tau,   L = -f(r) * A
    f(1) = 2 / tau and f'(1) = 1, so near r = 1 the gradient is the policy gradient's, and
    it fades smoothly as r leaves 1 (faster for the larger tau: tau_neg > tau_pos damps
    negative updates more, the paper's asymmetry). Reduced by `agg_loss` in
    `loss_agg_mode` (`norms` passed on): the paper and verl reduce "seq-mean-token-mean"
    (verl whatever its loss_agg_mode), AReaL "token-mean". Stats: "clipfrac" 0 (no
    clip, as verl logs), "approx_kl" as `ppo_policy_loss`.
    """
    check_same_shape(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"SAPO's temperatures must be > 0; got tau_pos={tau_pos}, tau_neg={tau_neg}")
    log_ratio = (log_prob - old_log_prob).clamp(min=-20.0, max=20.0)
    ratio = pinned_exp(log_ratio)
    pos, neg = (torch.as_tensor(t, dtype=advantages.dtype, device=advantages.device) for t in (tau_pos, tau_neg))
    tau = torch.where(advantages > 0, pos, neg)
    gate = _sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    loss_mat = -gate * advantages
    loss = agg_loss(loss_mat, response_mask, loss_agg_mode, **norms)
    with torch.no_grad():
        stats = {"clipfrac": torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device),
                 "approx_kl": masked_mean(-log_ratio, response_mask)}
    return loss, stats


def geo_mean_policy_loss(
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
    """GMPO (Zhao et al. 2025, "Geometric-Mean Policy Optimization", arXiv:2507.20673;
    verl's `geo_mean`, TRL's `GMPOTrainer`): the geometric mean of the token ratios,
    clipped per token in log space.

    Per token, d = log_prob - old_log_prob is clipped on the side its advantage's sign
    points to, PPO's trust region in log space: min(d, clamp(d, -low, high)) where A > 0,
    max(d, clamp(d, -low, high)) where A < 0 (A = 0: no term). Per sequence,
    rho = exp(mean over its valid tokens of the clipped d), a = mean of its advantages
    (GMPO takes one advantage a sequence: the config refuses estimators that give one per
    token), and L = -a * rho; the loss is the mean over sequences (`global_num_seqs`, so
    micro-batches add up; the token counts are taken and unused). The clip ratios are in
    log space: the paper uses 0.4 (ratios in (e^-0.4, e^0.4)). No log-ratio clamp (as verl).
    Stats: "clipfrac" the share of valid tokens with A > 0 whose d left [-low, high],
    "clipfrac_lower" those with A < 0 (verl's), "approx_kl" as `ppo_policy_loss`.
    """
    check_same_shape(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)
    log_ratio = log_prob - old_log_prob
    clamped = log_ratio.clamp(min=-clip_ratio_low, max=clip_ratio_high)
    clipped = torch.where(advantages > 0, torch.minimum(log_ratio, clamped),
                          torch.where(advantages < 0, torch.maximum(log_ratio, clamped), 0.0))
    lengths = response_mask.sum(dim=-1).clamp(min=1)  # [B]
    rho = pinned_exp(masked_sum(clipped, response_mask, dim=-1) / lengths)  # [B]
    seq_adv = masked_sum(advantages, response_mask, dim=-1) / lengths  # [B]
    num_seqs = at_least_one(log_prob.shape[0] if global_num_seqs is None else global_num_seqs)
    loss = (-seq_adv * rho).sum() / num_seqs
    with torch.no_grad():
        out = log_ratio != clamped
        stats = {"clipfrac": masked_mean((out & (advantages > 0)).to(log_ratio.dtype), response_mask),
                 "clipfrac_lower": masked_mean((out & (advantages < 0)).to(log_ratio.dtype), response_mask),
                 "approx_kl": masked_mean(-log_ratio, response_mask)}
    return loss, stats


def dppo_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    *,
    dppo_mask_low: float = 0.2,
    dppo_mask_high: float = 0.2,
    adv_tau: float = 1.0,
    kl_tau: float = 1e-3,
    **norms: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO with a KL term, prime-rl's default RL loss (DPPO-Binary TV, arXiv:2602.04879;
    the squared log-ratio regulariser of Kimi K2.5, arXiv:2602.02276).

    The trust region is on the change of each token's PROBABILITY, not its ratio: with
    delta = p - p_old (p = exp(log_prob)), a token whose advantage is > 0 and delta >
    dppo_mask_high, or whose advantage is <= 0 and delta < -dppo_mask_low, leaves the
    policy-gradient term (a rare token may move far in ratio, but not far in probability).
    Per token, with r = exp(clamp(log_prob - old_log_prob, -20, 20)) (prime-rl does not
    clamp; the two agree below |20|),
        L = -keep * adv_tau * A * r + kl_tau * (log_prob - old_log_prob)^2,
    reduced by `agg_loss` in `loss_agg_mode` (prime-rl: "token-mean"). Stats: "clipfrac"
    the share of valid tokens left out, "approx_kl" as `ppo_policy_loss`.
    """
    check_same_shape(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)
    log_ratio = log_prob - old_log_prob
    ratio = pinned_exp(log_ratio.clamp(min=-20.0, max=20.0))
    with torch.no_grad():
        delta = pinned_exp(log_prob) - pinned_exp(old_log_prob)
        masked = torch.where(advantages > 0, delta > dppo_mask_high, delta < -dppo_mask_low)
    policy_gradient = torch.where(masked, 0.0, adv_tau * advantages * ratio)
    loss_mat = -policy_gradient + kl_tau * log_ratio**2
    loss = agg_loss(loss_mat, response_mask, loss_agg_mode, **norms)
    with torch.no_grad():
        stats = {"clipfrac": masked_mean(masked.to(loss_mat.dtype), response_mask),
                 "approx_kl": masked_mean(-log_ratio, response_mask)}
    return loss, stats


def gpg_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    **norms: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GPG's loss (Chu et al. 2025, arXiv:2504.02546; verl's `gpg`): the plain policy
    gradient, L = -A * log_prob per token, no ratio and no clip (so no trust region: one
    update per batch, `actor.ppo_epochs=1` and one mini-batch, is the paper's setting).
    Reduced by `agg_loss` (`norms` passed on). Stats: "clipfrac" 0, "approx_kl" as
    `ppo_policy_loss` (old_log_prob is read for it alone)."""
    check_same_shape(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)
    loss_mat = -advantages * log_prob
    loss = agg_loss(loss_mat, response_mask, loss_agg_mode, **norms)
    with torch.no_grad():
        stats = {"clipfrac": torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device),
                 "approx_kl": masked_mean(old_log_prob - log_prob, response_mask)}
    return loss, stats
