"""Tests of reprorl.algos against hand-computed literal examples.

Expected numbers are written out (worked by hand in the comments), never recomputed with
the formula under test. float64 is used where a tight tolerance is meant.
"""

import math

import pytest
import torch

from reprorl import algos
from reprorl.algos import (
    LOSS_AGG_MODES,
    AdaptiveKLController,
    FixedKLController,
    agg_loss,
    apply_kl_to_rewards,
    discounted_returns,
    entropy_from_logits,
    gae_advantages,
    gdpo_advantages,
    gpg_advantages,
    grpo_outcome_advantages,
    grpo_passk_advantages,
    kl_penalty,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    opo_advantages,
    ppo_policy_loss,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    remax_advantages,
    rloo_advantages,
    scores_to_token_rewards,
    value_loss,
)

F64 = torch.float64


def t(rows):
    return torch.tensor(rows, dtype=F64)


def assert_close(actual, expected, tol=1e-12):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), rtol=tol, atol=tol)


# ---------------------------------------------------------------- masked helpers


def test_masked_helpers():
    values = t([[1.0, 2.0, 100.0], [3.0, 0.0, 0.0]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    assert_close(masked_sum(values, mask), 6.0)
    assert_close(masked_sum(values, mask, dim=-1), [3.0, 3.0])
    assert_close(masked_mean(values, mask), 2.0)
    assert_close(masked_mean(values, mask, dim=-1), [1.5, 3.0])
    # valid entries 1, 2, 3: squared deviations 1 + 0 + 1 = 2, over 3 (biased) or 2.
    assert_close(masked_var(values, mask, unbiased=False), 2.0 / 3.0)
    assert_close(masked_var(values, mask), 1.0)
    # (x - 2) / sqrt(1 + 1e-8); the masked 100 becomes 0.
    assert_close(masked_whiten(values, mask), [[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]], tol=1e-7)


def test_masked_entries_contribute_nothing_even_nan_or_inf():
    nan, inf = math.nan, math.inf
    values = t([[1.0, nan], [3.0, -inf]])
    mask = t([[1, 0], [1, 0]])
    assert_close(masked_sum(values, mask), 4.0)
    assert_close(masked_mean(values, mask, dim=-1), [1.0, 3.0])
    # valid 1 and 3: mean 2, unbiased var 2; (x - 2) / sqrt(2 + 1e-8) = +-(1 / sqrt(2)) * (1 - 2.5e-9)
    assert_close(masked_whiten(values, mask), [[-0.7071067794187805, 0.0], [0.7071067794187805, 0.0]])
    # verl gives 1.0 here; 1 * 1 + nan * 0 would be nan.
    for mode in LOSS_AGG_MODES:
        assert agg_loss(t([[1.0, nan]]), t([[1.0, 0.0]]), mode, max_response_length=1) == 1.0, mode
    # A float32 loss with a float mask stays float32; a bool mask works too.
    assert masked_sum(torch.tensor([2.0, nan]), torch.tensor([True, False])).dtype == torch.float32
    assert masked_sum(torch.tensor([2.0, nan]), torch.tensor([True, False])).item() == 2.0


def test_masked_mean_of_nothing_is_zero_and_unbiased_var_needs_two():
    values = t([[5.0, 6.0], [7.0, 8.0]])
    mask = t([[0, 0], [1, 0]])
    assert_close(masked_mean(values, mask, dim=-1), [0.0, 7.0])
    assert_close(masked_mean(values, torch.zeros_like(mask)), 0.0)
    with pytest.raises(ValueError, match="at least 2"):
        masked_var(values, mask)


def test_scores_to_token_rewards():
    scores = t([0.5, 2.0, -1.0])
    mask = t([[1, 1, 1, 0], [1, 0, 0, 0], [1, 0, 1, 0]])  # row 2: a tool output at t=1
    expected = t([[0, 0, 0.5, 0], [2.0, 0, 0, 0], [0, 0, -1.0, 0]])
    assert torch.equal(scores_to_token_rewards(scores, mask), expected)
    with pytest.raises(ValueError, match="row 1 has no valid token"):
        scores_to_token_rewards(t([1.0, 2.0]), t([[1, 1], [0, 0]]))
    with pytest.raises(ValueError, match="expected scores"):
        scores_to_token_rewards(t([1.0]), t([[1, 1], [1, 0]]))


# ---------------------------------------------------------------- GAE and returns


def test_gae_gamma_lam_one():
    # delta_2 = 1 - 0.7 = 0.3; delta_1 = 0.7 - 0.6 = 0.1; delta_0 = 0.6 - 0.5 = 0.1
    # A = [0.1 + 0.1 + 0.3, 0.1 + 0.3, 0.3]; returns = A + V = [1, 1, 1]
    adv, ret = gae_advantages(t([[0, 0, 1]]), t([[0.5, 0.6, 0.7]]), t([[1, 1, 1]]), 1.0, 1.0, whiten=False)
    assert_close(adv, [[0.5, 0.4, 0.3]])
    assert_close(ret, [[1.0, 1.0, 1.0]])
    # whitened: mean 0.4, unbiased var (0.01 + 0 + 0.01) / 2 = 0.01 -> [1, 0, -1]
    adv, _ = gae_advantages(t([[0, 0, 1]]), t([[0.5, 0.6, 0.7]]), t([[1, 1, 1]]), 1.0, 1.0)
    assert_close(adv, [[1.0, 0.0, -1.0]], tol=1e-6)


def test_gae_discounted_with_padding_and_tool_tokens():
    inf = math.inf
    rewards = t([[0, 0, 1], [0, 1, 5], [0, 7, 1]])
    values = t([[0.5, 0.6, 0.7], [0.2, 0.4, inf], [0.5, 9.0, 0.7]])
    mask = t([[1, 1, 1], [1, 1, 0], [1, 0, 1]])
    # gamma = lam = 0.5, so gamma * lam = 0.25
    # row 0: delta_2 = 0.3, A_2 = 0.3; delta_1 = 0.35 - 0.6 = -0.25, A_1 = -0.25 + 0.075 = -0.175;
    #        delta_0 = 0.3 - 0.5 = -0.2, A_0 = -0.2 - 0.04375 = -0.24375
    # row 1: t=2 is padding (reward 5, value inf: ignored); delta_1 = 1 - 0.4 = 0.6;
    #        delta_0 = 0.2 - 0.2 = 0, A_0 = 0.25 * 0.6 = 0.15
    # row 2: t=1 is a tool output, skipped: delta_2 = 0.3; delta_0 = 0.5 * 0.7 - 0.5 = -0.15,
    #        A_0 = -0.15 + 0.25 * 0.3 = -0.075
    adv, ret = gae_advantages(rewards, values, mask, 0.5, 0.5, whiten=False)
    assert_close(adv, [[-0.24375, -0.175, 0.3], [0.15, 0.6, 0.0], [-0.075, 0.0, 0.3]])
    assert_close(ret, [[0.25625, 0.425, 1.0], [0.35, 1.0, 0.0], [0.425, 0.0, 1.0]])


def test_gae_lam_one_gives_discounted_returns_and_lam_zero_gives_td_errors():
    # Two identities of GAE, checked on random inputs with right padding:
    # lam = 1: A_t + V_t = sum_k gamma^k r_{t+k};  lam = 0: A_t = r_t + gamma V_{t+1} - V_t.
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randn(4, 6, generator=gen, dtype=F64)
    values = torch.randn(4, 6, generator=gen, dtype=F64)
    mask = t([[1] * 6, [1] * 4 + [0] * 2, [1] + [0] * 5, [1] * 5 + [0]])
    _, ret = gae_advantages(rewards, values, mask, 0.9, 1.0, whiten=False)
    assert_close(ret, discounted_returns(rewards, mask, 0.9))
    adv, _ = gae_advantages(rewards, values, mask, 0.9, 0.0, whiten=False)
    next_values = torch.cat([values[:, 1:] * mask[:, 1:], torch.zeros(4, 1, dtype=F64)], dim=1)
    assert_close(adv, (rewards + 0.9 * next_values - values) * mask)


def test_discounted_returns():
    # row 0: [0.25 * 1, 0.5 * 1, 1]; row 1: padding at t=2 ignored; row 2: t=1 skipped, G_0 = 1 + 0.5 * 2
    rewards = t([[0, 0, 1], [0, 1, 3], [1, 9, 2]])
    mask = t([[1, 1, 1], [1, 1, 0], [1, 0, 1]])
    assert_close(discounted_returns(rewards, mask, 0.5), [[0.25, 0.5, 1.0], [0.5, 1.0, 0.0], [2.0, 0.0, 2.0]])


# ---------------------------------------------------------------- outcome estimators

IDS = ["p0", "p0", "p0", "p1", "p1", "p2"]
SCORES = [1.0, 0.0, 0.0, 2.0, 4.0, 5.0]
MASK6 = [[1, 1], [1, 0], [1, 1], [1, 1], [1, 0], [1, 1]]


def test_grpo_outcome_advantages():
    # p0: mean 1/3, unbiased std sqrt((4/9 + 1/9 + 1/9) / 2) = sqrt(1/3) = 0.5773502691896258
    #     -> (2/3) / 0.57735 = 1.1547005383792515, (-1/3) / 0.57735 = -0.5773502691896258
    # p1: mean 3, std sqrt(2) -> -+0.7071067811865476;  p2 (alone): mean 0, std 1 -> 5
    adv = grpo_outcome_advantages(t(SCORES), t(MASK6), IDS, eps=0.0)
    a, b, c = 1.1547005383792515, -0.5773502691896258, 0.7071067811865476
    assert_close(adv, [[a, a], [b, 0], [b, b], [-c, -c], [c, 0], [5.0, 5.0]])
    # the default eps = 1e-6 is added to the std: the lone sample gets 5 / (1 + 1e-6)
    adv = grpo_outcome_advantages(t(SCORES), t(MASK6), IDS)
    assert_close(adv[5], [4.999995000005, 4.999995000005])


def test_grpo_without_std_is_dr_grpo():
    adv = grpo_outcome_advantages(t(SCORES), t(MASK6), IDS, norm_by_std=False)
    assert_close(adv, [[2 / 3, 2 / 3], [-1 / 3, 0], [-1 / 3, -1 / 3], [-1, -1], [1, 0], [5, 5]])


def test_grpo_interleaved_groups_of_any_hashable_ids():
    # group (0, "x") = rows 0, 2 (scores 1, 3); group 7 = rows 1, 3 (scores 2, 6)
    # (1 - 2) / sqrt(2), (2 - 4) / sqrt(8), (3 - 2) / sqrt(2), (6 - 4) / sqrt(8)
    ids = [(0, "x"), 7, (0, "x"), 7]
    adv = grpo_outcome_advantages(t([1.0, 2.0, 3.0, 6.0]), torch.ones(4, 1, dtype=F64), ids, eps=0.0)
    r = 0.7071067811865476
    assert_close(adv, [[-r], [-r], [r], [r]])


def test_grpo_group_of_equal_scores_gets_zero():
    adv = grpo_outcome_advantages(t([4.0, 4.0, 1.0, 0.0]), torch.ones(4, 1, dtype=F64), [0, 0, 1, 1])
    assert torch.equal(adv[:2], torch.zeros(2, 1, dtype=F64))


def test_group_rows_are_in_first_appearance_order():
    assert algos.group_rows(["b", "a", "b", "c", "a"], 5) == [[0, 2], [1, 4], [3]]
    with pytest.raises(ValueError, match="3 ids for a batch of 2"):
        algos.group_rows(["a", "b", "c"], 2)


def test_rloo_advantages():
    # p0 [1, 0, 0]: 1 - (0 + 0) / 2 = 1, 0 - (1 + 0) / 2 = -0.5; p1 [2, 4]: -2, 2; p2 alone: its score
    adv = rloo_advantages(t(SCORES), t(MASK6), IDS)
    assert_close(adv, [[1, 1], [-0.5, 0], [-0.5, -0.5], [-2, -2], [2, 0], [5, 5]])


def test_remax_advantages():
    # row 0: return-to-go [1, 1, 1] - 0.4; row 1: [0.7 - 0.1, 0.7] - 0.5, padding reward 3 ignored
    rewards = t([[0, 0, 1], [-0.1, 0.7, 3]])
    adv = remax_advantages(rewards, t([0.4, 0.5]), t([[1, 1, 1], [1, 1, 0]]))
    assert_close(adv, [[0.6, 0.6, 0.6], [0.1, 0.2, 0.0]])


def test_reinforce_pp_advantages():
    # returns (gamma 0.5): [0.25, 0.5, 1 | 0.5, 1]; mean 3.25 / 5 = 0.65;
    # squared deviations 0.16 + 0.0225 + 0.1225 + 0.0225 + 0.1225 = 0.45, var 0.45 / 4 = 0.1125,
    # std 0.33541019662496846: -0.4 / std, -0.15 / std, 0.35 / std
    adv = reinforce_pp_advantages(t([[0, 0, 1], [0, 1, 0]]), t([[1, 1, 1], [1, 1, 0]]), 0.5)
    a, b, c = -1.1925695879998877, -0.4472135954999579, 1.0434983894999017
    assert_close(adv, [[a, b, c], [b, c, 0.0]], tol=1e-7)


def test_reinforce_pp_baseline_advantages():
    # groups a [3, 1] -> [1, -1], b [0, 2] -> [-1, 1]; per token (6 valid): 1, 1, -1, -1, -1, 1
    # mean 0, unbiased var 6 / 5 = 1.2 -> +-1 / sqrt(1.2) = +-0.9128709291752769
    mask = t([[1, 1], [1, 1], [1, 0], [1, 0]])
    adv = reinforce_pp_baseline_advantages(t([3.0, 1.0, 0.0, 2.0]), mask, ["a", "a", "b", "b"])
    w = 0.9128709291752769
    assert_close(adv, [[w, w], [-w, -w], [-w, 0.0], [w, 0.0]], tol=1e-7)


def test_grpo_passk_gives_the_best_sample_its_margin_over_the_second():
    # group a [1, 3, 2]: row 1 is best, 3 - 2 = 1, std of (1, 3, 2) = 1; group b [0.5, 0.5]:
    # the best is shared, margin 0 (over std 0 + eps: 0)
    mask = t([[1, 1], [1, 0], [1, 1], [1, 1], [1, 0]])
    scores, ids = t([1.0, 3.0, 2.0, 0.5, 0.5]), ["a", "a", "a", "b", "b"]
    adv = grpo_passk_advantages(scores, mask, ids)
    w = 0.999999000001  # 1 / (1 + 1e-6)
    assert_close(adv, [[0, 0], [w, 0], [0, 0], [0, 0], [0, 0]])
    adv = grpo_passk_advantages(t([1.0, 5.0, 2.0, 0.5, 0.5]), mask, ids, norm_by_std=False)
    assert_close(adv, [[0, 0], [3, 0], [0, 0], [0, 0], [0, 0]])
    with pytest.raises(ValueError, match="at least 2 samples a group; group of row 2 has 1"):
        grpo_passk_advantages(t([1.0, 2.0, 3.0]), torch.ones(3, 1, dtype=F64), ["a", "a", "b"])


def test_opo_subtracts_the_length_weighted_mean():
    # group a: scores 1, 0, 2 of lengths 1, 3, 2: b = (1 + 0 + 4) / 6 = 5/6 -> 1/6, -5/6, 7/6;
    # group b alone: baseline 0
    mask = t([[1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 1, 0]])
    adv = opo_advantages(t([1.0, 0.0, 2.0, 4.0]), mask, ["a", "a", "a", "b"])
    assert_close(adv, [[1 / 6, 0, 0], [-5 / 6, -5 / 6, -5 / 6], [7 / 6, 7 / 6, 0], [4, 4, 0]])


def test_gpg_scales_the_centred_score_by_the_share_of_nonzero_scores():
    # 2 of 5 scores nonzero: alpha = 5 / 2; group a [1, 0] mean 0.5 -> +-1.25; group b [0, 2]
    # mean 1 -> -+2.5; group c alone [0]: 0
    adv = gpg_advantages(t([1.0, 0.0, 0.0, 2.0, 0.0]), t([[1, 1], [1, 0], [1, 1], [1, 0], [1, 1]]),
                         ["a", "a", "b", "b", "c"])
    assert_close(adv, [[1.25, 1.25], [-1.25, 0], [-2.5, -2.5], [2.5, 0], [0, 0]])
    # all scores 0: alpha = 5 / 1, every advantage 0
    assert torch.equal(gpg_advantages(torch.zeros(2, dtype=F64), torch.ones(2, 1, dtype=F64), [0, 0]),
                       torch.zeros(2, 1, dtype=F64))


def test_gdpo_normalises_each_component_in_its_group_then_whitens_the_weighted_sum():
    # component 1 (weight 1): group a [1, 0] -> mean 0.5, unbiased std sqrt(0.5) -> +-1/sqrt(2);
    #   group b [1, 1] all equal -> 0 (0 over std 0 + eps)
    # component 2 (weight 0.5): group a [0.2, 0.2] -> 0; group b [0, 1] -> -+1/sqrt(2)
    # sums a = 1/sqrt(2), -a, -c, c with c = 0.5/sqrt(2); tokens (rows b have one each):
    # a, a, -a, -a, -c, c: mean 0, unbiased var (4 * 0.5 + 2 * 0.125) / 5 = 0.45
    # -> a / sqrt(0.45) = sqrt(10/9) = 1.0540925533894598, c / sqrt(0.45) = sqrt(5/18) = 0.5270462766947299
    mask = t([[1, 1], [1, 1], [1, 0], [1, 0]])
    scores = t([[1.0, 0.0, 1.0, 1.0], [0.2, 0.2, 0.0, 1.0]])
    adv = gdpo_advantages(scores, [1.0, 0.5], mask, ["a", "a", "b", "b"])
    a, c = 1.0540925533894598, 0.5270462766947299
    # eps = 1e-6 on both groups' std 1/sqrt(2) scales both terms alike, which the whitening undoes
    # up to its 1e-8 under the root: within 1e-7
    assert_close(adv, [[a, a], [-a, -a], [-c, 0], [c, 0]], tol=1e-7)
    # K tensors [B] are the same input as one [K, B]
    assert torch.equal(gdpo_advantages([scores[0], scores[1]], [1.0, 0.5], mask, ["a", "a", "b", "b"]), adv)


def test_gdpo_of_one_component_is_grpo_whitened_over_the_batch():
    mask = t(MASK6)
    adv = gdpo_advantages(t([SCORES]), [1.0], mask, IDS)
    assert torch.equal(adv, masked_whiten(grpo_outcome_advantages(t(SCORES), mask, IDS), mask))
    with pytest.raises(ValueError, match="gdpo: 1 reward components and 2 weights"):
        gdpo_advantages(t([SCORES]), [1.0, 0.5], mask, IDS)


# ---------------------------------------------------------------- aggregation

LOSS = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
LOSS_MASK = [[1, 1, 0], [1, 1, 1]]


def test_agg_loss_modes():
    loss, mask = t(LOSS), t(LOSS_MASK)
    assert_close(agg_loss(loss, mask, "token-mean"), 18 / 5)  # (1 + 2 + 4 + 5 + 6) / 5
    assert_close(agg_loss(loss, mask, "seq-mean-token-sum"), 9.0)  # (3 + 15) / 2
    assert_close(agg_loss(loss, mask, "seq-mean-token-mean"), 3.25)  # (1.5 + 5) / 2
    assert_close(agg_loss(loss, mask, "seq-mean-token-sum-norm"), 3.0)  # (3 + 15) / (2 * T=3)
    assert_close(agg_loss(loss, mask, "seq-mean-token-sum-norm", max_response_length=4), 2.25)
    assert_close(agg_loss(loss, mask, "token-mean", global_num_tokens=10), 1.8)
    assert_close(agg_loss(loss, mask, "seq-mean-token-sum", global_num_seqs=torch.tensor(6.0)), 3.0)
    with pytest.raises(ValueError, match="token-mean, seq-mean-token-sum, .*got 'mean'"):
        agg_loss(loss, mask, "mean")


def test_agg_loss_of_no_tokens_is_zero():
    loss, mask = t(LOSS), torch.zeros(2, 3, dtype=F64)
    for mode in LOSS_AGG_MODES:
        assert torch.equal(agg_loss(loss, mask, mode), torch.tensor(0.0, dtype=F64)), mode


CUTS = [[8], [4, 4], [2, 2, 2, 2], [1] * 8, [3, 5], [1, 2, 5], [5, 2, 1], [7, 1]]


def micro_batch_sum(loss, mask, mode, cut, trim=False):
    """The sum over micro-batches of `cut` sizes, each with the whole batch's normalisers."""
    total = torch.zeros((), dtype=loss.dtype)
    start = 0
    for size in cut:
        mb_loss, mb_mask = loss[start : start + size], mask[start : start + size]
        start += size
        if trim:  # each micro-batch padded only to its own longest response
            width = max(int(mb_mask.sum(-1).max()), 1)
            mb_loss, mb_mask = mb_loss[:, :width], mb_mask[:, :width]
        total = total + agg_loss(
            mb_loss,
            mb_mask,
            mode,
            global_num_tokens=mask.sum(),
            global_num_seqs=loss.shape[0],
            max_response_length=loss.shape[1],
        )
    return total


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batch_sum_equals_full_batch(mode):
    gen = torch.Generator().manual_seed(1)
    loss = torch.randn(8, 7, generator=gen, dtype=F64)
    lengths = [7, 3, 1, 0, 5, 7, 2, 4]  # right padding; one row has no valid token
    mask = t([[1] * n + [0] * (7 - n) for n in lengths])
    full = agg_loss(loss, mask, mode)
    for cut in CUTS:
        torch.testing.assert_close(micro_batch_sum(loss, mask, mode, cut), full, rtol=1e-12, atol=0)
        torch.testing.assert_close(micro_batch_sum(loss, mask, mode, cut, trim=True), full, rtol=1e-12, atol=0)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batch_sum_is_exact_when_the_sums_are(mode):
    # Small integers, response lengths in {0, 1, 2, 4}, 16 valid tokens, 8 rows, T = 4:
    # every divisor is a power of two, so every partial sum is exact and so is the total.
    lengths = [4, 2, 1, 1, 4, 2, 2, 0]
    mask = t([[1] * n + [0] * (4 - n) for n in lengths])
    loss = torch.arange(32, dtype=F64).reshape(8, 4) % 7 - 3
    full = agg_loss(loss, mask, mode)
    for cut in CUTS:
        assert torch.equal(micro_batch_sum(loss, mask, mode, cut), full), cut
        assert torch.equal(micro_batch_sum(loss, mask, mode, cut, trim=True), full), cut


# ---------------------------------------------------------------- PPO losses

LN = math.log
# tokens (clip 0.2 / 0.2, dual-clip c = 3):
#   row 0: A=+1 r=2: max(-2, -1.2) = -1.2 (clipped) | A=-1 r=0.5: max(0.5, 0.8) = 0.8 (clipped)
#          | A=-1 r=5: max(5, 1.2) = 5, capped at 3 (dual-clip)
#   row 1: A=+2 r=1: -2 | A=-0.5 r=1.1: 0.55 (inside the clip range) | padding
OLD = [[0.0, 0.0, 0.0], [-1.0, -2.0, -3.0]]
NEW = [[LN(2.0), LN(0.5), LN(5.0)], [-1.0, -2.0 + LN(1.1), 50.0]]
ADV = [[1.0, -1.0, -1.0], [2.0, -0.5, 4.0]]
PPO_MASK = [[1, 1, 1], [1, 1, 0]]


def test_ppo_policy_loss_clip_and_dual_clip():
    loss, stats = ppo_policy_loss(t(OLD), t(NEW), t(ADV), t(PPO_MASK), 0.2, 0.2, 3.0, "token-mean")
    assert_close(loss, (-1.2 + 0.8 + 3.0 - 2.0 + 0.55) / 5)  # 0.23
    assert_close(stats["clipfrac"], 2 / 5)
    assert_close(stats["clipfrac_lower"], 1 / 5)
    assert_close(stats["approx_kl"], -(LN(5.0) + LN(1.1)) / 5)  # mean of old - new; ln 2 + ln 0.5 = 0
    loss, _ = ppo_policy_loss(t(OLD), t(NEW), t(ADV), t(PPO_MASK), 0.2, 0.2, 3.0, "seq-mean-token-sum")
    assert_close(loss, ((-1.2 + 0.8 + 3.0) + (-2.0 + 0.55)) / 2)  # 0.575


def test_ppo_policy_loss_gradient_only_through_unclipped_tokens():
    new = t(NEW).requires_grad_()
    loss, _ = ppo_policy_loss(t(OLD), new, t(ADV), t(PPO_MASK), 0.2, 0.2, 3.0, "token-mean")
    loss.backward()
    # d(-A r)/d log_prob = -A r: -2 * 1 for row 1 t=0, 0.5 * 1.1 for row 1 t=1; over 5 tokens.
    # Clipped, dual-clipped and padded tokens get no gradient.
    assert_close(new.grad, [[0.0, 0.0, 0.0], [-0.4, 0.11, 0.0]])


def test_ppo_policy_loss_clip_higher_and_validation():
    # A=+1, r=1.25: inside clip_ratio_high 0.28 (loss -1.25), clipped by 0.2 (loss -1.2)
    args = (t([[0.0]]), t([[LN(1.25)]]), t([[1.0]]), t([[1.0]]))
    assert_close(ppo_policy_loss(*args, 0.2, 0.28, 3.0, "token-mean")[0], -1.25)
    assert_close(ppo_policy_loss(*args, 0.2, 0.2, 3.0, "token-mean")[0], -1.2)
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1.0"):
        ppo_policy_loss(*args, 0.2, 0.2, 1.0, "token-mean")


def test_ppo_policy_loss_huge_log_ratio_stays_finite():
    # float32: exp(100) would be inf; clamped to exp(20) the loss and its gradient stay finite.
    new = torch.tensor([[100.0, 100.0]], requires_grad=True)
    old, mask = torch.zeros(1, 2), torch.ones(1, 2)
    loss, stats = ppo_policy_loss(old, new, torch.tensor([[1.0, -1.0]]), mask, 0.2, 0.2, 3.0, "token-mean")
    loss.backward()
    assert_close(loss.detach(), (-1.2 + 3.0) / 2)
    assert torch.isfinite(new.grad).all()
    # approx_kl is what the loss used: old - new with the log-ratio clamped to 20, not -100.
    assert stats["approx_kl"].item() == -20.0


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_ppo_policy_loss_micro_batches_sum_to_full_batch(mode):
    gen = torch.Generator().manual_seed(2)
    old = torch.randn(6, 5, generator=gen, dtype=F64) * 0.1 - 2
    new = old + torch.randn(6, 5, generator=gen, dtype=F64) * 0.3
    adv = torch.randn(6, 5, generator=gen, dtype=F64)
    mask = t([[1] * n + [0] * (5 - n) for n in [5, 2, 4, 1, 3, 5]])
    full, _ = ppo_policy_loss(old, new, adv, mask, 0.2, 0.28, 3.0, mode)
    norms = dict(global_num_tokens=mask.sum(), global_num_seqs=6, max_response_length=5)
    parts = [ppo_policy_loss(old[s], new[s], adv[s], mask[s], 0.2, 0.28, 3.0, mode, **norms)[0]
             for s in (slice(0, 1), slice(1, 4), slice(4, 6))]
    torch.testing.assert_close(sum(parts), full, rtol=1e-12, atol=0)


def test_value_loss_clipped():
    # clip range 0.2 around the old value 1.0 -> [0.8, 1.2]
    #   v=1.5 R=2: (1.5-2)^2 = 0.25, (1.2-2)^2 = 0.64 -> 0.64 (clipped is larger)
    #   v=1.1 R=0: 1.21 both (inside the range)
    #   v=1.5 R=0: 2.25 vs (1.2)^2 = 1.44 -> 2.25
    #   v=0.5 R=0: 0.25 vs (0.8)^2 = 0.64 -> 0.64 (clipped is larger)
    values = t([[1.5, 1.1, 1.5], [0.5, 7.0, 7.0]])
    old = t([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    returns = t([[2.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = t([[1, 1, 1], [1, 0, 0]])
    loss, clipfrac = value_loss(values, old, returns, mask, 0.2, "token-mean")
    assert_close(loss, 0.5 * (0.64 + 1.21 + 2.25 + 0.64) / 4)  # 0.5925
    assert_close(clipfrac, 0.5)
    loss, _ = value_loss(values, old, returns, mask, 0.2, "seq-mean-token-sum")
    assert_close(loss, 0.5 * ((0.64 + 1.21 + 2.25) + 0.64) / 2)


def test_entropy_from_logits():
    # [0, 0]: ln 2; [0, ln 3]: p = (1/4, 3/4), H = 0.25 ln 4 + 0.75 ln(4/3) = 0.5623351446188083
    logits = t([[[0.0, 0.0], [0.0, LN(3.0)]]])
    assert_close(entropy_from_logits(logits), [[LN(2.0), 0.5623351446188083]])
    # huge and very unequal logits, float32: no overflow, no NaN
    big = torch.tensor([[[1000.0, 1000.0, 1000.0, 1000.0], [0.0, -1e4, -1e4, -1e4]]])
    assert_close(entropy_from_logits(big), [[LN(4.0), 0.0]], tol=1e-6)


def test_entropy_matches_plain_reference():
    logits = torch.randn(3, 4, 11, generator=torch.Generator().manual_seed(3), dtype=F64) * 4
    p = torch.exp(logits) / torch.exp(logits).sum(-1, keepdim=True)
    assert_close(entropy_from_logits(logits), -(p * torch.log(p)).sum(-1))


# ---------------------------------------------------------------- KL


def test_kl_penalty_kinds():
    log_prob = t([[-1.0, -2.0, 0.0, -1.0]])
    ref = t([[-2.0, -1.0, 0.0, 4.0]])  # d = ref - log_prob = [-1, 1, 0, 5]
    assert_close(kl_penalty(log_prob, ref, "k1"), [[1.0, -1.0, 0.0, -5.0]])
    assert_close(kl_penalty(log_prob, ref, "k2"), [[0.5, 0.5, 0.0, 12.5]])
    # exp(-1) + 1 - 1 = 0.36787944117144233; e - 1 - 1 = 0.7182818284590451; exp(5) - 6 = 142.4 -> 10
    assert_close(kl_penalty(log_prob, ref, "k3"), [[0.36787944117144233, 0.7182818284590451, 0.0, 10.0]])
    for alias, kind in [("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3")]:
        assert torch.equal(kl_penalty(log_prob, ref, alias), kl_penalty(log_prob, ref, kind))
    assert_close(kl_penalty(log_prob, ref, "abs"), [[1.0, 1.0, 0.0, 5.0]])
    with pytest.raises(ValueError, match="k1, k2, k3, abs.*got 'k4'"):
        kl_penalty(log_prob, ref, "k4")


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "abs", "kl", "low_var_kl"])
def test_straight_through_kl_has_the_value_of_its_kind_and_the_gradient_of_k2(kind):
    ref = t([[-2.0, -1.0, 0.0, 4.0]])  # d = ref - log_prob = [-1, 1, 0, 5]
    plain = t([[-1.0, -2.0, 0.0, -1.0]]).requires_grad_()
    through = t([[-1.0, -2.0, 0.0, -1.0]]).requires_grad_()
    value = kl_penalty(through, ref, kind + "+")
    assert torch.equal(value.detach(), kl_penalty(plain, ref, kind).detach())  # the same bits
    value.sum().backward()
    # d(0.5 (log_prob - ref)^2) / d log_prob = log_prob - ref = -d
    assert_close(through.grad, [[1.0, -1.0, 0.0, -5.0]])


def test_k3_far_from_the_reference_stays_finite():
    # float32, d = 100: exp(100) = inf; with d clamped to 20 the value is capped at 10 and
    # the gradient is 0 instead of 0 * inf = NaN.
    log_prob = torch.tensor([[-100.0, -1.0]], requires_grad=True)
    kl = kl_penalty(log_prob, torch.tensor([[0.0, -2.0]]), "k3")
    kl.sum().backward()
    assert_close(kl.detach(), [[10.0, 0.36787944117144233]], tol=1e-6)
    # d(exp(d) - d - 1)/d log_prob = 1 - exp(d) = 1 - exp(-1) for the second token
    assert_close(log_prob.grad, [[0.0, 0.6321205588285577]], tol=1e-6)


def test_apply_kl_to_rewards():
    scores = t([[0, 0, 1], [0, 2, 0]])
    kl = t([[0.1, 0.2, 0.3], [0.4, 0.5, math.nan]])  # garbage on padding is ignored
    mask = t([[1, 1, 1], [1, 1, 0]])
    rewards, mean_kl = apply_kl_to_rewards(scores, kl, 0.5, mask)
    assert_close(rewards, [[-0.05, -0.1, 0.85], [-0.2, 1.75, 0.0]])
    assert_close(mean_kl, (0.2 + 0.45) / 2)  # per-sample token means 0.2 and 0.45


def test_adaptive_kl_controller():
    ctl = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    ctl.update(current_kl=9.0, n_steps=256)  # error 0.5 clipped to 0.2: x (1 + 0.2 * 0.0256)
    assert ctl.value == pytest.approx(0.100512, rel=1e-12)
    ctl.update(current_kl=torch.tensor(6.6), n_steps=1000)  # error 0.1: x 1.01
    assert ctl.value == pytest.approx(0.10151712, rel=1e-6)  # 6.6 in float32 is 6.5999999
    ctl.update(current_kl=0.0, n_steps=5000)  # error -1 clipped to -0.2: x 0.9
    assert ctl.value == pytest.approx(0.091365408, rel=1e-6)
    resumed = AdaptiveKLController(init_kl_coef=0.5, target_kl=6.0, horizon=10000)
    resumed.load_state_dict(ctl.state_dict())
    ctl.update(7.0, 64)
    resumed.update(7.0, 64)
    assert resumed.value == ctl.value
    with pytest.raises(ValueError, match="target_kl and horizon must be > 0"):
        AdaptiveKLController(0.1, 0.0, 10000)


def test_fixed_kl_controller():
    ctl = FixedKLController(0.05)
    ctl.update(100.0, 256)
    assert ctl.value == 0.05
    other = FixedKLController(1.0)
    other.load_state_dict(ctl.state_dict())
    assert other.value == 0.05


def test_shape_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="one shape"):
        gae_advantages(t([[0.0, 1.0]]), t([[0.0]]), t([[1.0, 1.0]]), 1.0, 1.0)
