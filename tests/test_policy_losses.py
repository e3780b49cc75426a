"""GSPO and CISPO (reprorl/algos.py): literal examples worked by hand, and a cross-check
against verl's formulas (`compute_policy_loss_gspo` / `_cispo` in verl's
trainer/ppo/core_algos.py at commit b178a3c, transcribed below) on random inputs."""

import math

import pytest
import torch

from reprorl.algos import cispo_policy_loss, gspo_policy_loss, policy_loss, ppo_policy_loss

F64 = torch.float64
LN = math.log
# The PPO tests' tokens (tests/test_algos.py): row 0 has ratios 2, 0.5, 5; row 1 ratios 1, 1.1
# and a padding token.
OLD = [[0.0, 0.0, 0.0], [-1.0, -2.0, -3.0]]
NEW = [[LN(2.0), LN(0.5), LN(5.0)], [-1.0, -2.0 + LN(1.1), 50.0]]
ADV = [[1.0, -1.0, -1.0], [2.0, -0.5, 4.0]]
MASK = [[1, 1, 1], [1, 1, 0]]


def t(rows):
    return torch.tensor(rows, dtype=F64)


def test_gspo_clips_the_sequence_ratio():
    new = t(NEW).requires_grad_()
    loss, stats = gspo_policy_loss(t(OLD), new, t(ADV), t(MASK), 0.2, 0.2)
    s0 = 5.0 ** (1 / 3)  # exp(mean(ln 2, ln 0.5, ln 5)): clipped to 1.2 for the A > 0 token only
    s1 = 1.1 ** 0.5  # exp(mean(0, ln 1.1)): inside the clip range
    row0 = (-1.2 + s0 + s0) / 3  # A=+1: max(-s0, -1.2) = -1.2; A=-1: max(s0, 1.2) = s0
    row1 = (-2.0 * s1 + 0.5 * s1) / 2
    torch.testing.assert_close(loss, torch.tensor((row0 + row1) / 2, dtype=F64))
    torch.testing.assert_close(stats["clipfrac"], torch.tensor(1 / 5, dtype=F64))
    loss.backward()
    # Each unclipped token's gradient is -A * s over (2 sequences x its sequence's length);
    # the clipped one and the padding get none.
    expected = [[0.0, s0 / 6, s0 / 6], [-2.0 * s1 / 4, 0.5 * s1 / 4, 0.0]]
    torch.testing.assert_close(new.grad, t(expected))


def test_gspo_ignores_the_loss_agg_mode_and_sums_over_micro_batches():
    args = (t(OLD), t(NEW), t(ADV), t(MASK))
    whole, _ = policy_loss("gspo", *args, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0,
                           loss_agg_mode="token-mean")
    expected, _ = gspo_policy_loss(*args, 0.2, 0.2)
    assert torch.equal(whole, expected)
    parts = [gspo_policy_loss(*(a[i : i + 1] for a in args), 0.2, 0.2, global_num_seqs=2)[0] for i in range(2)]
    torch.testing.assert_close(parts[0] + parts[1], whole, rtol=0, atol=1e-15)


def test_cispo_weights_every_token_by_its_clipped_stopped_ratio():
    new = t(NEW).requires_grad_()
    loss, stats = cispo_policy_loss(t(OLD), new, t(ADV), t(MASK), 0.2, 0.2, "token-mean")
    # weights clip(r): row 0 (2, 0.5, 5) -> (1.2, 0.8, 1.2); row 1 (1, 1.1) -> (1, 1.1)
    terms = [-1.2 * 1 * LN(2), -0.8 * -1 * LN(0.5), -1.2 * -1 * LN(5), -1 * 2 * -1.0, -1.1 * -0.5 * (-2 + LN(1.1))]
    torch.testing.assert_close(loss, torch.tensor(sum(terms) / 5, dtype=F64))
    torch.testing.assert_close(stats["clipfrac"], torch.tensor(3 / 5, dtype=F64))
    loss.backward()
    # Unlike PPO's clip, every valid token keeps a gradient: -weight * A / 5.
    expected = [[-1.2 / 5, 0.8 / 5, 1.2 / 5], [-2.0 / 5, 1.1 * 0.5 / 5, 0.0]]
    torch.testing.assert_close(new.grad, t(expected))


def test_vanilla_is_ppo_and_an_unknown_mode_is_named():
    args = (t(OLD), t(NEW), t(ADV), t(MASK))
    got, _ = policy_loss("vanilla", *args, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
                         loss_agg_mode="token-mean")
    assert torch.equal(got, ppo_policy_loss(*args, 0.2, 0.28, 3.0, "token-mean")[0])
    with pytest.raises(ValueError, match="policy loss 'grpo'; expected one of vanilla, gspo, cispo"):
        policy_loss("grpo", *args, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, loss_agg_mode="token-mean")


# ---------------------------------------------------------------- verl's formulas


def verl_agg(loss_mat, mask, mode):
    if mode == "token-mean":
        return (loss_mat * mask).sum() / mask.sum()
    return ((loss_mat * mask).sum(-1) / mask.sum(-1)).mean()  # seq-mean-token-mean


def verl_gspo(old_log_prob, log_prob, advantages, response_mask, low, high):
    negative_approx_kl = log_prob - old_log_prob
    seq_lengths = torch.sum(response_mask, dim=-1).clamp(min=1)
    negative_approx_kl_seq = torch.sum(negative_approx_kl * response_mask, dim=-1) / seq_lengths
    log_seq_importance_ratio = log_prob - log_prob.detach() + negative_approx_kl_seq.detach().unsqueeze(-1)
    log_seq_importance_ratio = torch.clamp(log_seq_importance_ratio, max=10.0)
    seq_importance_ratio = torch.exp(log_seq_importance_ratio)
    pg_losses1 = -advantages * seq_importance_ratio
    pg_losses2 = -advantages * torch.clamp(seq_importance_ratio, 1 - low, 1 + high)
    return verl_agg(torch.maximum(pg_losses1, pg_losses2), response_mask, "seq-mean-token-mean")


def verl_cispo(old_log_prob, log_prob, advantages, response_mask, low, high):
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    clipped_ratio_sg = torch.clamp(ratio, 1 - low, 1 + high).detach()
    return verl_agg(-clipped_ratio_sg * advantages * log_prob, response_mask, "token-mean")


@pytest.mark.parametrize("name", ["gspo", "cispo"])
def test_losses_and_gradients_match_verls_on_random_inputs(name):
    ours_fn = {"gspo": lambda *a: gspo_policy_loss(*a)[0],
               "cispo": lambda *a: cispo_policy_loss(*a, "token-mean")[0]}[name]
    verl_fn = {"gspo": verl_gspo, "cispo": verl_cispo}[name]
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        b, r = 6, 9
        old = -torch.rand(b, r, generator=g) * 3
        new = old + 0.3 * torch.randn(b, r, generator=g)
        adv = torch.randn(b, r, generator=g)
        lengths = torch.randint(1, r + 1, (b,), generator=g)
        mask = (torch.arange(r)[None] < lengths[:, None]).float()
        low, high = (3e-4, 4e-4) if name == "gspo" and trial % 2 else (0.2, 0.28)
        grads = []
        losses = []
        for fn in (ours_fn, verl_fn):
            x = new.clone().requires_grad_()
            loss = fn(old, x, adv, mask, low, high)
            loss.backward()
            losses.append(loss.detach())
            grads.append(x.grad * mask)  # valid tokens
        assert (losses[0] - losses[1]).abs() <= 1e-6, (trial, losses)
        assert (grads[0] - grads[1]).abs().max() <= 1e-6, trial
