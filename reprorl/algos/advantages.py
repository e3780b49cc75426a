"""Advantage estimators: pure functions of detached tensors (conventions in `reprorl.algos.masked`).

`reprorl.algos.registry.ESTIMATORS` describes each one (its flags, its help) and calls it.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from reprorl.algos.masked import check_same_shape, check_scores, group_rows, masked_whiten


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
    check_same_shape(token_rewards=token_rewards, values=values, response_mask=response_mask)
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
    check_same_shape(token_rewards=token_rewards, response_mask=response_mask)
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
    check_scores(scores, response_mask)
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
    check_scores(reward_baselines, response_mask)
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
    check_scores(scores, response_mask)
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
    check_scores(scores, response_mask)
    centered = torch.empty_like(scores)
    for rows in group_rows(group_ids, len(scores)):
        idx = torch.tensor(rows, device=scores.device)
        group = scores[idx]
        centered[idx] = group if len(rows) == 1 else group - group.mean()
    return masked_whiten(centered.unsqueeze(-1) * response_mask, response_mask)


def grpo_passk_advantages(
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: Sequence[Hashable],
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Pass@k advantages (Tang et al. 2025, "Optimizing Language Models for Inference Time
    Objectives using RL", arXiv:2503.19595; verl's `grpo_passk`), k the group's size.

    The reward of a group is its best score (pass@k), and each sample's share of it is its
    marginal contribution: only the group's best sample gets a nonzero advantage,
    A = s_max - s_second (over the group's std + eps if `norm_by_std`, as GRPO); every other
    sample gets 0. A group whose best score is shared by two samples gets 0 throughout, so
    which of them is "best" never matters (the first is taken).

    scores `[B]`, response_mask `[B, T]`, group_ids: B ids, every group of at least 2
    samples (ValueError otherwise, as verl). Returns `[B, T]`.
    """
    check_scores(scores, response_mask)
    advantages = torch.zeros_like(scores)
    for rows in group_rows(group_ids, len(scores)):
        if len(rows) < 2:
            raise ValueError(f"pass@k needs at least 2 samples a group; group of row {rows[0]} has 1")
        group = scores[torch.tensor(rows, device=scores.device)]
        top = torch.topk(group, 2).values
        best = rows[int(torch.argmax(group))]
        advantage = top[0] - top[1]
        advantages[best] = advantage / (group.std() + eps) if norm_by_std else advantage
    return advantages.unsqueeze(-1) * response_mask


def opo_advantages(scores: torch.Tensor, response_mask: torch.Tensor, group_ids: Sequence[Hashable]) -> torch.Tensor:
    """OPO advantages (Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline",
    arXiv:2505.23585; verl's `opo`).

    A_i = s_i - b with the length-weighted baseline b = sum_j |o_j| s_j / sum_j |o_j| over
    the group (|o_j| sample j's valid tokens): the variance-minimising baseline when each
    token's gradient has about the same norm. A group of one: b = 0, as verl.

    scores `[B]`, response_mask `[B, T]`, group_ids: B ids. Returns `[B, T]`.
    """
    check_scores(scores, response_mask)
    lengths = response_mask.sum(dim=-1)  # [B]
    advantages = torch.empty_like(scores)
    for rows in group_rows(group_ids, len(scores)):
        idx = torch.tensor(rows, device=scores.device)
        group, length = scores[idx], lengths[idx]
        advantages[idx] = group if len(rows) == 1 else group - (length * group).sum() / length.sum()
    return advantages.unsqueeze(-1) * response_mask


def gpg_advantages(scores: torch.Tensor, response_mask: torch.Tensor, group_ids: Sequence[Hashable]) -> torch.Tensor:
    """GPG advantages (Chu et al. 2025, "GPG: A Simple and Strong RL Baseline for Model
    Reasoning", arXiv:2504.02546; verl's `gpg`).

    A_i = alpha * (s_i - mean(group)), no std; alpha = B / (number of nonzero scores in the
    batch, at least 1) scales the batch's gradient up by how few samples carry a signal
    (the paper's correction for groups that are all wrong). A group of one: mean 0, as verl.

    scores `[B]`, response_mask `[B, T]`, group_ids: B ids. Returns `[B, T]`.
    """
    check_scores(scores, response_mask)
    alpha = len(scores) / torch.count_nonzero(scores).clamp(min=1)  # a float32 tensor, as verl's
    advantages = torch.empty_like(scores)
    for rows in group_rows(group_ids, len(scores)):
        idx = torch.tensor(rows, device=scores.device)
        group = scores[idx]
        advantages[idx] = alpha * (group if len(rows) == 1 else group - group.mean())
    return advantages.unsqueeze(-1) * response_mask


def gdpo_advantages(
    component_scores: torch.Tensor | Sequence[torch.Tensor],
    weights: Sequence[float],
    response_mask: torch.Tensor,
    group_ids: Sequence[Hashable],
    eps: float = 1e-6,
) -> torch.Tensor:
    """GDPO advantages (Liu et al. 2026, "GDPO: Group reward-Decoupled Normalization Policy
    Optimization for Multi-reward RL Optimization", arXiv:2601.05242; NVIDIA's verl fork,
    NVlabs/GDPO verl-GDPO/verl/trainer/ppo/ray_trainer.py).

    Each reward component k is normalised within the group on its own, as GRPO normalises
    one score: n_ki = (s_ki - mean_g(s_k)) / (std_g(s_k) + eps) (`grpo_outcome_advantages`:
    unbiased std; a group of one has mean 0, std 1; a component equal across a group gives
    it 0). Then A_i = sum_k w_k n_ki, whitened over all valid tokens of the batch
    (`masked_whiten`: unbiased variance, + 1e-8 under the root), as the fork does.
    Normalising before summing keeps a component of small spread from being drowned by one
    of large spread, and distinct combinations of rewards from collapsing to one advantage.
    One component: GRPO, then whitened over the batch.

    component_scores `[K, B]` (or K tensors `[B]`), weights: K floats, response_mask
    `[B, T]`, group_ids: B ids. Returns `[B, T]`.
    """
    scores = torch.stack(list(component_scores))  # [K, B]
    if len(weights) != len(scores):
        raise ValueError(f"gdpo: {len(scores)} reward components and {len(weights)} weights")
    total = torch.zeros_like(response_mask, dtype=scores.dtype)  # [B, T]
    for component, weight in zip(scores, weights):  # in the components' order: fixed bits
        total = total + weight * grpo_outcome_advantages(component, response_mask, group_ids, eps=eps)
    return masked_whiten(total, response_mask)
