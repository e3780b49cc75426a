"""Masked reductions, loss aggregation and the shape checks every part of `reprorl.algos` uses.

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

import torch

from reprorl.kernels.pinned import pinned_exp, pinned_log_softmax, thread_free_sum

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

Count = int | float | torch.Tensor


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
    check_scores(scores, response_mask)
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
    check_same_shape(loss_mat=loss_mat, loss_mask=loss_mask)
    token_sums = masked_sum(loss_mat, loss_mask, dim=-1)  # [B]
    if mode == "token-mean":
        num_tokens = loss_mask.sum() if global_num_tokens is None else global_num_tokens
        return token_sums.sum() / at_least_one(num_tokens)
    num_seqs = at_least_one(loss_mat.shape[0] if global_num_seqs is None else global_num_seqs)
    if mode == "seq-mean-token-sum":
        return token_sums.sum() / num_seqs
    if mode == "seq-mean-token-mean":
        return (token_sums / loss_mask.sum(dim=-1).clamp(min=1)).sum() / num_seqs
    length = loss_mat.shape[1] if max_response_length is None else max_response_length
    return token_sums.sum() / (num_seqs * length)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax over the last dimension: `[B, T, V]` -> `[B, T]`.

    H = -sum p log p with log p = log_softmax (which subtracts the logsumexp): no exp
    overflow for large logits, and no cancellation between two large numbers. Logits
    must be finite (a -inf logit gives 0 * -inf = NaN).
    """
    log_p = pinned_log_softmax(logits)
    return -(pinned_exp(log_p) * log_p).sum(dim=-1)


def at_least_one(count: Count) -> Count:
    return count.clamp(min=1) if isinstance(count, torch.Tensor) else max(count, 1)


def check_same_shape(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1 or any(len(s) != 2 for s in shapes.values()):
        raise ValueError(f"expected tensors of one shape [B, T]; got {shapes}")


def check_scores(scores: torch.Tensor, response_mask: torch.Tensor) -> None:
    if scores.dim() != 1 or response_mask.dim() != 2 or scores.shape[0] != response_mask.shape[0]:
        raise ValueError(
            f"expected scores [B] and response_mask [B, T]; got {tuple(scores.shape)} and {tuple(response_mask.shape)}"
        )
