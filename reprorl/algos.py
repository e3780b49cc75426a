"""The RL math: advantage estimators, losses, KL and loss aggregation, as pure functions.

Conventions (shared with the trainer):
- B samples, T response tokens; every per-token tensor is `[B, T]`.
- `response_mask` `[B, T]` holds 0/1 floats: 1 for tokens the policy generated, 0 for
  padding and for tokens it did not generate (a tool's output in a multi-turn sample).
- `group_ids` is a sequence of B hashable ids; the samples of one prompt share one id
  (verl's `uid`). Groups are visited in first-appearance order, never in set or hash
  order, so every reduction runs in the same order on every run.
- Advantages, returns and token rewards are exactly 0 where `response_mask` is 0.
- Inputs are plain tensors: call the advantage functions on detached tensors (the
  trainer does so under `torch.no_grad()`); the losses are differentiable in the
  current policy's `log_prob` / the critic's `values`.

Time loops (GAE, discounted returns) are the plain reverse loop over T: it is the
definition, it is exact and its order is fixed, and T is only the response length.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch

from reprorl.kernels.cpu_math import pinned_exp, pinned_log_softmax, thread_free_sum

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# k1/k2/k3 as in Schulman's note, and abs; "kl", "mse" and "low_var_kl" are verl's names
# for k1/k2/k3. A trailing "+" (k1+, k3+, ...) is the straight-through variant, as in verl.
_KL_ESTIMATORS = ("k1", "k2", "k3", "abs", "kl", "mse", "low_var_kl")
KL_PENALTY_KINDS = _KL_ESTIMATORS + tuple(kind + "+" for kind in _KL_ESTIMATORS)
_KL_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}

Count = int | float | torch.Tensor


# ---------------------------------------------------------------- masked helpers


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `values` where `mask` is 1: over all entries (a scalar), or along `dim`.

    Masked entries contribute exactly nothing, even NaN or inf (`torch.where`, not
    `values * mask`, where 0 * nan = nan); the result has the dtype `values * mask` has.
    The sum over all entries is the same bits at any CPU thread count (`thread_free_sum`:
    a whitened batch's tokens can be more than one thread's share of a torch sum).
    """
    kept = torch.where(mask > 0, values, 0.0).to(torch.promote_types(values.dtype, mask.dtype))
    return thread_free_sum(kept) if dim is None else kept.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `values` where `mask` is 1: over all entries (a scalar), or along `dim`.

    An empty selection gives 0, not NaN (its count is taken as 1): a micro-batch or row
    with no valid token contributes nothing.
    """
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of `values` over all entries where `mask` is 1 (a scalar).

    `unbiased=True` applies Bessel's correction n / (n - 1), as verl does; it needs at
    least two valid entries and raises ValueError otherwise.
    """
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        n = int(mask.sum().item())
        if n < 2:
            raise ValueError(f"masked_var(unbiased=True) needs at least 2 valid entries; got {n}")
        var = var * (n / (n - 1))
    return var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Shift and scale the valid entries of `values` `[B, T]` to mean 0, variance 1.

    (x - mean) / sqrt(var + eps) with the unbiased variance over all valid entries of the
    batch (so a long response weighs more than a short one, as in verl). Masked entries
    become 0, whatever they held.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask, unbiased=True)
    return torch.where(mask > 0, (values - mean) * torch.rsqrt(var + eps), 0.0)


def scores_to_token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each sample's scalar score `[B]` at its last valid token: `[B, T]`, 0 elsewhere.

    Every row must have at least one valid token (a response has at least one token).
    """
    _check_scores(scores, response_mask)
    valid = response_mask > 0  # [B, T]
    empty = (~valid.any(dim=-1)).nonzero().flatten()
    if len(empty) > 0:
        raise ValueError(f"response_mask row {int(empty[0])} has no valid token to carry its score")
    positions = torch.arange(response_mask.shape[1], device=response_mask.device)
    last = torch.where(valid, positions, -1).max(dim=-1).values  # [B]
    rewards = torch.zeros(response_mask.shape, dtype=scores.dtype, device=scores.device)
    rewards[torch.arange(len(scores), device=scores.device), last] = scores
    return rewards


def group_rows(group_ids: Sequence[Hashable], batch_size: int) -> list[list[int]]:
    """Row indices of each group of `group_ids`, groups in first-appearance order (dicts keep
    insertion order), never set or hash order: the group loops of the estimators below."""
    if len(group_ids) != batch_size:
        raise ValueError(f"group_ids has {len(group_ids)} ids for a batch of {batch_size} samples")
    rows: dict[Hashable, list[int]] = {}
    for i, gid in enumerate(group_ids):
        rows.setdefault(gid, []).append(i)
    return list(rows.values())


# ---------------------------------------------------------------- advantage estimators


def gae_advantages(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016, arXiv:1506.02438) for PPO.

    delta_t = r_t + gamma * V_{t+1} - V_t;  A_t = delta_t + gamma * lam * A_{t+1};
    returns = A + V (the critic's targets, computed before whitening).
    Masked tokens are skipped: the next valid token's value and advantage are carried
    across them, so a tool's output inside a multi-turn response is neither a step nor
    a discount (verl does the same). After the last valid token V and A are 0.

    token_rewards, values, response_mask: `[B, T]`.
    Returns (advantages `[B, T]`, whitened over the batch if `whiten`, as verl does;
    returns `[B, T]`), both 0 at masked tokens.
    """
    _check_same_shape(token_rewards=token_rewards, values=values, response_mask=response_mask)
    batch_size, length = token_rewards.shape
    valid = response_mask > 0
    next_value = token_rewards.new_zeros(batch_size)  # [B]
    next_adv = token_rewards.new_zeros(batch_size)  # [B]
    advantages = torch.zeros_like(token_rewards)
    for t in reversed(range(length)):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        # torch.where, not a 0/1 blend: garbage (even inf) at padded positions cannot leak.
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        next_adv = torch.where(valid[:, t], adv, next_adv)
        advantages[:, t] = torch.where(valid[:, t], adv, 0.0)
    returns = torch.where(valid, advantages + values, 0.0)
    if whiten:
        advantages = masked_whiten(advantages, response_mask)
    return advantages, returns


def discounted_returns(token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Return-to-go G_t = r_t + gamma * G_{t+1} over valid tokens: `[B, T]` -> `[B, T]`.

    Masked tokens are skipped like in `gae_advantages` (their reward is ignored and they
    are not a discount step); the result is 0 at them.
    """
    _check_same_shape(token_rewards=token_rewards, response_mask=response_mask)
    valid = response_mask > 0
    running = token_rewards.new_zeros(token_rewards.shape[0])  # [B]
    returns = torch.zeros_like(token_rewards)
    for t in reversed(range(token_rewards.shape[1])):
        running = torch.where(valid[:, t], token_rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(valid[:, t], running, 0.0)
    return returns


def grpo_outcome_advantages(
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: Sequence[Hashable],
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO outcome advantages (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300).

    A_i = (s_i - mean(group)) / (std(group) + eps), std unbiased (torch.std, as verl);
    with `norm_by_std=False`, A_i = s_i - mean(group) (Dr. GRPO, Liu et al. 2025,
    arXiv:2503.20783). Every token of a sample gets its A_i.
    A group of one sample has no baseline: as in verl its mean is taken as 0 and its std
    as 1, so its advantage is its raw score (divided by 1 + eps). A group whose scores
    are all equal gets 0.

    scores `[B]`, response_mask `[B, T]`, group_ids: B ids. Returns `[B, T]`.
    """
    _check_scores(scores, response_mask)
    advantages = torch.empty_like(scores)
    for rows in group_rows(group_ids, len(scores)):
        idx = torch.tensor(rows, device=scores.device)
        group = scores[idx]
        if len(rows) == 1:
            mean, std = 0.0, 1.0
        else:
            mean, std = group.mean(), group.std()
        advantages[idx] = (group - mean) / (std + eps) if norm_by_std else group - mean
    return advantages.unsqueeze(-1) * response_mask


def remax_advantages(
    token_rewards: torch.Tensor, reward_baselines: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """ReMax advantages (Li et al. 2023, arXiv:2310.10505).

    A_t = (undiscounted return-to-go from t) - b, where b is the reward of the greedy
    response to the same prompt.

    token_rewards `[B, T]` (the score at the last token, plus any per-token KL penalty),
    reward_baselines `[B]` (each sample's greedy baseline reward), response_mask `[B, T]`.
    Returns `[B, T]`.
    """
    _check_scores(reward_baselines, response_mask)
    returns = discounted_returns(token_rewards, response_mask, gamma=1.0)
    return (returns - reward_baselines.unsqueeze(-1)) * response_mask


def rloo_advantages(
    scores: torch.Tensor, response_mask: torch.Tensor, group_ids: Sequence[Hashable]
) -> torch.Tensor:
    """RLOO advantages (Ahmadian et al. 2024, arXiv:2402.14740).

    A_i = s_i - mean of the other samples' scores in its group. A group of one sample has
    no others: as in verl its advantage is its raw score.

    scores `[B]`, response_mask `[B, T]`, group_ids: B ids. Returns `[B, T]`.
    """
    _check_scores(scores, response_mask)
    advantages = torch.empty_like(scores)
    for rows in group_rows(group_ids, len(scores)):
        idx = torch.tensor(rows, device=scores.device)
        group = scores[idx]
        n = len(rows)
        advantages[idx] = group if n == 1 else group - (group.sum() - group) / (n - 1)
    return advantages.unsqueeze(-1) * response_mask


def reinforce_pp_advantages(token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """REINFORCE++ advantages (Hu 2025, arXiv:2501.03262).

    Discounted return-to-go of the per-token rewards (score plus KL penalty), whitened
    over all valid tokens of the batch.

    token_rewards, response_mask `[B, T]`. Returns `[B, T]`.
    """
    return masked_whiten(discounted_returns(token_rewards, response_mask, gamma), response_mask)


def reinforce_pp_baseline_advantages(
    scores: torch.Tensor, response_mask: torch.Tensor, group_ids: Sequence[Hashable]
) -> torch.Tensor:
    """REINFORCE++ with a group baseline (Hu 2025, arXiv:2501.03262; verl's
    `reinforce_plus_plus_baseline`).

    Subtract the group's mean score (a group of one: mean 0, as verl), give each token
    its sample's value, then whiten over all valid tokens of the batch.

    scores `[B]`, response_mask `[B, T]`, group_ids: B ids. Returns `[B, T]`.
    """
    _check_scores(scores, response_mask)
    centered = torch.empty_like(scores)
    for rows in group_rows(group_ids, len(scores)):
        idx = torch.tensor(rows, device=scores.device)
        group = scores[idx]
        centered[idx] = group if len(rows) == 1 else group - group.mean()
    return masked_whiten(centered.unsqueeze(-1) * response_mask, response_mask)


# ---------------------------------------------------------------- losses


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    mode: str,
    *,
    global_num_tokens: Count | None = None,
    global_num_seqs: Count | None = None,
    max_response_length: int | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss `[B, T]` to a scalar.

    Modes (verl's names):
    - "token-mean": sum over valid tokens / number of valid tokens.
    - "seq-mean-token-sum": mean over sequences of each sequence's token sum.
    - "seq-mean-token-mean": mean over sequences of each sequence's token mean.
    - "seq-mean-token-sum-norm": mean over sequences of token sum / max_response_length
      (Dr. GRPO, Liu et al. 2025: a constant divisor, so a response's weight does not
      depend on its length). Older verl divides the batch's token sum by T and not by the
      number of sequences; here it is a mean over sequences like the other seq modes.

    The divisors are the number of valid tokens (`global_num_tokens`), the number of
    sequences (`global_num_seqs`, rows with no valid token included) and
    `max_response_length`. Left None they are taken from this batch (and T). For
    gradient accumulation pass the values of the whole mini-batch: each micro-batch then
    returns its share, and the SUM over micro-batches equals the full-batch loss however
    the batch is cut (pass `max_response_length` too if micro-batches are trimmed to
    different T). A count of 0 is taken as 1, so an empty batch gives 0, not NaN.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {', '.join(LOSS_AGG_MODES)}; got {mode!r}")
    _check_same_shape(loss_mat=loss_mat, loss_mask=loss_mask)
    token_sums = masked_sum(loss_mat, loss_mask, dim=-1)  # [B]
    if mode == "token-mean":
        num_tokens = loss_mask.sum() if global_num_tokens is None else global_num_tokens
        return token_sums.sum() / _at_least_one(num_tokens)
    num_seqs = _at_least_one(loss_mat.shape[0] if global_num_seqs is None else global_num_seqs)
    if mode == "seq-mean-token-sum":
        return token_sums.sum() / num_seqs
    if mode == "seq-mean-token-mean":
        return (token_sums / loss_mask.sum(dim=-1).clamp(min=1)).sum() / num_seqs
    length = loss_mat.shape[1] if max_response_length is None else max_response_length
    return token_sums.sum() / (num_seqs * length)


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
    _check_same_shape(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)
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
    _check_same_shape(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)
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
    _check_same_shape(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)
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
    _check_same_shape(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)
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
    _check_same_shape(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)
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


POLICY_LOSSES = ("vanilla", "gspo", "cispo", "clip_cov", "kl_cov")
"""`actor.policy_loss`: verl's `policy_loss.loss_mode` names."""


def policy_loss(
    mode: str,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float,
    loss_agg_mode: str,
    cov: dict[str, float] | None = None,
    **norms: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy loss `mode` names ("vanilla": `ppo_policy_loss`; "gspo"; "cispo";
    "clip_cov"; "kl_cov"), with the actor's settings; `cov`: clip_cov's or kl_cov's own
    keywords (their defaults: verl's); `norms` are `agg_loss`'s global_* keywords. Every
    mode's stats have "clipfrac" and "approx_kl" (the trainer logs those); vanilla's also
    "clipfrac_lower"."""
    args = (old_log_prob, log_prob, advantages, response_mask, clip_ratio_low, clip_ratio_high)
    if mode == "vanilla":
        return ppo_policy_loss(*args, clip_ratio_c, loss_agg_mode, **norms)
    if mode == "gspo":
        return gspo_policy_loss(*args, **norms)
    if mode == "cispo":
        return cispo_policy_loss(*args, loss_agg_mode, **norms)
    if mode == "clip_cov":
        return clip_cov_policy_loss(*args, loss_agg_mode, **(cov or {}), **norms)
    if mode == "kl_cov":
        return kl_cov_policy_loss(*args[:4], loss_agg_mode, **(cov or {}), **norms)
    raise ValueError(f"policy loss {mode!r}; expected one of {', '.join(POLICY_LOSSES)}")


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
    _check_same_shape(values=values, old_values=old_values, returns=returns, response_mask=response_mask)
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


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax over the last dimension: `[B, T, V]` -> `[B, T]`.

    H = -sum p log p with log p = log_softmax (which subtracts the logsumexp): no exp
    overflow for large logits, and no cancellation between two large numbers. Logits
    must be finite (a -inf logit gives 0 * -inf = NaN).
    """
    log_p = pinned_log_softmax(logits)
    return -(pinned_exp(log_p) * log_p).sum(dim=-1)


# ---------------------------------------------------------------- KL


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens: `[B, T]`.

    Schulman 2020, "Approximating KL Divergence", with d = ref_log_prob - log_prob:
    - "k1": -d = log_prob - ref_log_prob (unbiased, can be negative);
    - "k2": 0.5 * d^2 (biased, low variance, >= 0);
    - "k3": exp(d) - d - 1 (unbiased, low variance, >= 0); d is clamped to [-20, 20] so
      exp cannot overflow and the result to [-10, 10], as verl's "low_var_kl";
    - "abs": |d|.
    A "+" after any of them ("k1+", "k3+", ...) gives its value with the gradient of k2:
    the expected gradient of k1 and k3 is not the gradient of the KL, k2's is (verl's
    straight-through estimators). The value is the plain one, bit for bit.
    verl's names "kl", "mse", "low_var_kl" are accepted for k1, k2, k3 (with or without "+").
    Used for the KL penalty in the reward and for the KL loss.
    """
    if kind not in KL_PENALTY_KINDS:
        raise ValueError(f"kl penalty kind must be one of {', '.join(KL_PENALTY_KINDS)}; got {kind!r}")
    _check_same_shape(log_prob=log_prob, ref_log_prob=ref_log_prob)
    base = kind.removesuffix("+")
    base = _KL_ALIASES.get(base, base)
    log_ratio = log_prob - ref_log_prob
    if base == "k1":
        value = log_ratio
    elif base == "k2":
        value = 0.5 * log_ratio.square()
    elif base == "abs":
        value = log_ratio.abs()
    else:
        d = (-log_ratio).clamp(min=-20.0, max=20.0)
        value = (pinned_exp(d) - d - 1.0).clamp(min=-10.0, max=10.0)
    if not kind.endswith("+"):
        return value
    k2 = 0.5 * log_ratio.square()
    return k2 - k2.detach() + value.detach()  # (k2 - k2) is exactly 0: the value is `value`'s bits


def apply_kl_to_rewards(
    token_scores: torch.Tensor, kl: torch.Tensor, kl_coef: float, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """KL penalty in the reward (Ziegler et al. 2019): r_t = score_t - kl_coef * kl_t.

    token_scores, kl (from `kl_penalty`), response_mask: `[B, T]`.
    Returns (token_rewards `[B, T]`, 0 at masked tokens; mean_kl, a scalar: the mean over
    samples of each sample's token-mean KL, as verl, which feeds the KL controller).
    """
    _check_same_shape(token_scores=token_scores, kl=kl, response_mask=response_mask)
    kl = torch.where(response_mask > 0, kl, 0.0)
    token_rewards = (token_scores - kl_coef * kl) * response_mask
    mean_kl = masked_mean(kl, response_mask, dim=-1).mean()
    return token_rewards, mean_kl


class FixedKLController:
    """A constant KL coefficient; `update` does nothing."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, arXiv:1909.08593, section 2.2).

    After each step: e = clip(current_kl / target_kl - 1, -0.2, 0.2);
    value *= 1 + e * n_steps / horizon. The coefficient grows while the measured KL is
    above the target and shrinks while it is below. Plain Python floats, so the update is
    the same on every machine; `state_dict` goes into checkpoints.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"target_kl and horizon must be > 0; got target_kl={target_kl}, horizon={horizon}")
        self.value = float(init_kl_coef)
        self.target_kl = float(target_kl)
        self.horizon = horizon

    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> None:
        error = min(max(float(current_kl) / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


# ---------------------------------------------------------------- private checks


def _at_least_one(count: Count) -> Count:
    return count.clamp(min=1) if isinstance(count, torch.Tensor) else max(count, 1)


def _check_same_shape(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1 or any(len(s) != 2 for s in shapes.values()):
        raise ValueError(f"expected tensors of one shape [B, T]; got {shapes}")


def _check_scores(scores: torch.Tensor, response_mask: torch.Tensor) -> None:
    if scores.dim() != 1 or response_mask.dim() != 2 or scores.shape[0] != response_mask.shape[0]:
        raise ValueError(
            f"expected scores [B] and response_mask [B, T]; got {tuple(scores.shape)} and {tuple(response_mask.shape)}"
        )
