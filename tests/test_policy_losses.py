"""GSPO, CISPO, Clip-Cov and KL-Cov (reprorl/algos/policy_losses.py), SAPO, GMPO, DPPO and GPG
(reprorl/algos/gated_losses.py): literal examples worked by hand,
and a cross-check against verl's formulas (`compute_policy_loss_gspo` / `_cispo` /
`_clip_cov` / `_kl_cov` in verl's trainer/ppo/core_algos.py, transcribed below; clip_cov's
random choice of tokens given to both) on random inputs; the newer losses' cross-checks
against verl, TRL, AReaL and prime-rl are in tests/test_algos_verl.py."""

import math

import pytest
import torch

from reprorl.algos import (
    cispo_policy_loss,
    clip_cov_policy_loss,
    dppo_policy_loss,
    geo_mean_policy_loss,
    gpg_policy_loss,
    sapo_policy_loss,
    gspo_policy_loss,
    kl_cov_policy_loss,
    policy_loss,
    ppo_policy_loss,
    token_priority,
)

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


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


def test_sapo_gates_each_ratio_softly():
    new = t(NEW).requires_grad_()
    loss, stats = sapo_policy_loss(t(OLD), new, t(ADV), t(MASK), "token-mean", tau_pos=1.0, tau_neg=2.0)
    # f(r) = sigmoid(tau (r - 1)) * 4 / tau, tau 1 where A > 0, 2 elsewhere; L = -f(r) A
    terms = [-4 * sigmoid(1.0) * 1, 2 * sigmoid(-1.0) * 1, 2 * sigmoid(8.0) * 1,  # r = 2, 0.5, 5
             -4 * sigmoid(0.0) * 2, 2 * sigmoid(0.2) * 0.5]  # r = 1, 1.1
    torch.testing.assert_close(loss, torch.tensor(sum(terms) / 5, dtype=F64), rtol=0, atol=1e-15)
    assert stats["clipfrac"] == 0
    loss.backward()
    # at r = 1, f'(1) = 1: the token's gradient is the policy gradient's, -A r / 5
    torch.testing.assert_close(new.grad[1, 0], torch.tensor(-2.0 / 5, dtype=F64), rtol=0, atol=1e-15)
    assert new.grad[1, 2] == 0


def test_geo_mean_takes_the_geometric_mean_of_sign_clipped_log_ratios():
    new = t(NEW).requires_grad_()
    loss, stats = geo_mean_policy_loss(t(OLD), new, t(ADV), t(MASK), 0.4, 0.4)
    # row 0, d = ln 2, ln 0.5, ln 5 with A = 1, -1, -1: min(ln 2, 0.4) = 0.4, max(-ln 2, -0.4) = -0.4,
    # max(ln 5, 0.4) = ln 5: rho = exp(ln 5 / 3), mean A = -1/3. Row 1, d = 0, ln 1.1 inside: rho = 1.1 ** 0.5,
    # mean A = (2 - 0.5) / 2 = 0.75
    rho0, rho1 = 5 ** (1 / 3), 1.1 ** 0.5
    torch.testing.assert_close(loss, torch.tensor((rho0 / 3 - 0.75 * rho1) / 2, dtype=F64), rtol=0, atol=1e-15)
    torch.testing.assert_close(stats["clipfrac"], torch.tensor(1 / 5, dtype=F64))  # ln 2 > 0.4, A > 0
    torch.testing.assert_close(stats["clipfrac_lower"], torch.tensor(2 / 5, dtype=F64))  # -ln 2, ln 5; A < 0
    loss.backward()
    # d(-a rho) / d(d_t) = -a rho / len for a token whose clipped d is d itself, over 2 sequences
    expected = [[0.0, 0.0, rho0 / 18], [-0.75 * rho1 / 4, -0.75 * rho1 / 4, 0.0]]
    torch.testing.assert_close(new.grad, t(expected), rtol=0, atol=1e-15)


def test_geo_mean_sums_over_micro_batches():
    args = (t(OLD), t(NEW), t(ADV), t(MASK))
    whole, _ = geo_mean_policy_loss(*args, 0.4, 0.4)
    parts = [geo_mean_policy_loss(*(a[i : i + 1] for a in args), 0.4, 0.4, global_num_seqs=2)[0] for i in range(2)]
    torch.testing.assert_close(parts[0] + parts[1], whole, rtol=0, atol=1e-15)


def test_dppo_masks_tokens_whose_probability_moved_too_far():
    # row 0: p_old 0.5, 0.5, 0.1 -> p 0.8, 0.25, 0.05 with A = 1, -1, 1: +0.3 > 0.2 (A > 0) and
    # -0.25 < -0.2 (A <= 0) are masked, -0.05 (A > 0) kept with r = 0.5.
    # row 1: p_old 0.2, 0.4 -> p 0.3, 0.1 with A = -1, 0: +0.1 kept (r = 1.5), -0.3 masked (A <= 0)
    old = torch.log(t([[0.5, 0.5, 0.1], [0.2, 0.4, 0.5]]))
    new = torch.log(t([[0.8, 0.25, 0.05], [0.3, 0.1, 0.9]])).requires_grad_()
    adv, mask = t([[1.0, -1.0, 1.0], [-1.0, 0.0, 3.0]]), t(MASK)
    loss, stats = dppo_policy_loss(old, new, adv, mask, "token-mean", kl_tau=0.1)
    squares = sum(LN(r) ** 2 for r in (1.6, 0.5, 0.5, 1.5, 0.25))
    torch.testing.assert_close(loss, torch.tensor((-0.5 + 1.5 + 0.1 * squares) / 5, dtype=F64), rtol=0, atol=1e-15)
    torch.testing.assert_close(stats["clipfrac"], torch.tensor(3 / 5, dtype=F64))
    loss.backward()
    # masked tokens: the KL term's gradient alone, 2 kl_tau ln r / 5; kept ones add -A r / 5
    torch.testing.assert_close(new.grad[0, 0], torch.tensor(0.2 * LN(1.6) / 5, dtype=F64), rtol=0, atol=1e-15)
    torch.testing.assert_close(new.grad[0, 2], torch.tensor((-0.5 + 0.2 * LN(0.5)) / 5, dtype=F64),
                               rtol=0, atol=1e-15)


def test_gpg_is_the_plain_policy_gradient():
    new = t(NEW).requires_grad_()
    loss, stats = gpg_policy_loss(t(OLD), new, t(ADV), t(MASK), "token-mean")
    terms = [-1 * LN(2), 1 * LN(0.5), 1 * LN(5), -2 * -1.0, 0.5 * (-2 + LN(1.1))]
    torch.testing.assert_close(loss, torch.tensor(sum(terms) / 5, dtype=F64), rtol=0, atol=1e-15)
    assert stats["clipfrac"] == 0
    loss.backward()
    torch.testing.assert_close(new.grad, -t(ADV) * t(MASK) / 5, rtol=0, atol=1e-15)


def test_vanilla_is_ppo_and_an_unknown_mode_is_named():
    args = (t(OLD), t(NEW), t(ADV), t(MASK))
    got, _ = policy_loss("vanilla", *args, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
                         loss_agg_mode="token-mean")
    assert torch.equal(got, ppo_policy_loss(*args, 0.2, 0.28, 3.0, "token-mean")[0])
    with pytest.raises(ValueError, match="policy loss 'grpo'; expected one of vanilla, gspo, cispo, clip_cov, kl_cov"):
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


# ---------------------------------------------------------------- Clip-Cov and KL-Cov

# Four valid tokens of one row (and a padding token): ratios 1 (no PPO clip anywhere).
COV_OLD = [[-1.0, -1.0, -1.0, -1.0, -1.0]]
COV_NEW = [[-1.0, -3.0, -1.0, -5.0, 9.0]]
COV_ADV = [[3.0, 1.0, -1.0, -3.0, 7.0]]
COV_MASK = [[1, 1, 1, 1, 0]]
# mean A = 0, mean log_prob = -2.5: cov = A * (log_prob + 2.5) = 4.5, -0.5, -1.5, 7.5


def test_kl_cov_penalises_the_tokens_of_largest_covariance():
    new = t(COV_NEW).requires_grad_()
    loss, stats = kl_cov_policy_loss(t(COV_OLD), new, t(COV_ADV), t(COV_MASK), "token-mean", kl_cov_ratio=0.5,
                                     ppo_kl_coef=2.0)
    # 2 of 4 tokens: covs 7.5 (token 3) and 4.5 (token 0). r = exp(new - old).
    r = [1.0, math.exp(-2.0), 1.0, math.exp(-4.0)]
    terms = [-3.0 * r[0] + 2.0 * 0.0, -1.0 * r[1], 1.0 * r[2], 3.0 * r[3] + 2.0 * 4.0]
    torch.testing.assert_close(loss, torch.tensor(sum(terms) / 4, dtype=F64))
    torch.testing.assert_close(stats["clipfrac"], torch.tensor(0.5, dtype=F64))
    loss.backward()
    # d/dnew of -A r = -A r; of 2 |new - old| = 2 sign(new - old) (token 3: -2); / 4 tokens
    expected = [[-3.0 * r[0] / 4, -1.0 * r[1] / 4, 1.0 * r[2] / 4, (3.0 * r[3] - 2.0) / 4, 0.0]]
    torch.testing.assert_close(new.grad, t(expected))


def test_clip_cov_drops_chosen_tokens_in_the_band_and_chooses_by_priority():
    args = (t(COV_OLD), t(COV_NEW), t(COV_ADV), t(COV_MASK), 0.2, 10.0, "token-mean")
    # band (1, 5): only token 0 (cov 4.5); one token chosen (max(1, int(0.25 * 4)))
    new = t(COV_NEW).requires_grad_()
    loss, stats = clip_cov_policy_loss(*args[:1], new, *args[2:], clip_cov_ratio=0.25, clip_cov_lb=1.0,
                                       clip_cov_ub=5.0)
    # token 3's ratio e^-4 is clipped at 0.8 for A = -3 (PPO takes max(3 e^-4, 2.4) = 2.4)
    terms = [0.0, -1.0 * math.exp(-2.0), 1.0, 3.0 * 0.8]
    torch.testing.assert_close(loss, torch.tensor(sum(terms) / 4, dtype=F64))
    torch.testing.assert_close(stats["clipfrac"], torch.tensor(0.25, dtype=F64))
    loss.backward()
    assert new.grad[0, 0] == 0.0 and new.grad[0, 3] == 0.0  # chosen; PPO-clipped
    # band (-2, 8) holds tokens 0, 1, 2 (token 3 is PPO-clipped): two chosen, of lowest priority
    _, stats = clip_cov_policy_loss(*args, clip_cov_ratio=0.5, clip_cov_lb=-2.0, clip_cov_ub=8.0)
    torch.testing.assert_close(stats["clipfrac"], torch.tensor(0.5, dtype=F64))


def test_token_priority_is_a_function_of_the_data_alone():
    g = torch.Generator().manual_seed(0)
    old, adv = torch.randn(8, 64, generator=g), torch.randn(8, 1, generator=g).expand(8, 64)
    p = token_priority(old, adv)
    assert p.dtype == torch.int64 and bool(((p >= 0) & (p < 2**32)).all())
    assert torch.equal(p[2:5], token_priority(old[2:5], adv[2:5]))  # rows do not depend on the batch
    assert torch.equal(p, token_priority(old.double(), adv))  # the float32 bits
    assert len(set(p.flatten().tolist())) > 500  # spread over 512 tokens


def verl_clip_cov(old_log_prob, log_prob, advantages, response_mask, low, high, ratio_, lb, ub, choose):
    """verl's compute_policy_loss_clip_cov, `choose(candidate indices [n, 2], count)` in place
    of torch.randperm's pick."""
    negative_approx_kl = log_prob - old_log_prob
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    corr = torch.ones_like(advantages)
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    clip_by_origin = (pg_losses2 > pg_losses1) & (response_mask > 0)
    mm = lambda x: (x * response_mask).sum() / response_mask.sum()  # noqa: E731
    cov_all = (advantages - mm(advantages)) * (log_prob - mm(log_prob.detach()))
    cov_all[response_mask == 0] = -torch.inf
    cov_all[clip_by_origin] = -torch.inf
    clip_num = max(int(ratio_ * response_mask.sum().item()), 1)
    top_k_idx = torch.nonzero((cov_all < ub) & (cov_all > lb) & (response_mask > 0))
    top_k_idx = choose(top_k_idx, clip_num)
    corr[top_k_idx[:, 0], top_k_idx[:, 1]] = 0
    return verl_agg(torch.maximum(pg_losses1, pg_losses2) * corr, response_mask, "token-mean")


def verl_kl_cov(old_log_prob, log_prob, advantages, response_mask, kl_cov_ratio, ppo_kl_coef):
    negative_approx_kl = log_prob - old_log_prob
    abs_kl = negative_approx_kl.abs()
    ratio = torch.exp(negative_approx_kl)
    pg_losses = -advantages * ratio
    pg_losses_kl = -advantages * ratio + ppo_kl_coef * abs_kl
    all_valid = response_mask > 0
    all_valid_idx = torch.nonzero(all_valid.reshape(-1), as_tuple=True)[0]
    all_valid_adv = advantages[all_valid].detach().reshape(-1).cpu()
    all_valid_logp = log_prob[all_valid].detach().reshape(-1).cpu()
    cov_lst_all = (all_valid_adv - all_valid_adv.mean()) * (all_valid_logp - all_valid_logp.mean())
    k_percent_nums = max(1, int(len(cov_lst_all) * kl_cov_ratio))
    large_cov_idxs = all_valid_idx[torch.topk(cov_lst_all, k_percent_nums, largest=True).indices]
    rows, cols = large_cov_idxs // advantages.shape[1], large_cov_idxs % advantages.shape[1]
    pg_losses[rows, cols] = pg_losses_kl[rows, cols]
    return verl_agg(pg_losses, response_mask, "token-mean")


@pytest.mark.parametrize("name", ["clip_cov", "kl_cov"])
def test_cov_losses_and_gradients_match_verls_on_random_inputs(name):
    g = torch.Generator().manual_seed(1)
    for trial in range(20):
        b, r = 6, 40
        old = -torch.rand(b, r, generator=g, dtype=F64) * 3
        new = old + 0.3 * torch.randn(b, r, generator=g, dtype=F64)
        adv = torch.randn(b, 1, generator=g, dtype=F64).expand(b, r).contiguous()
        lengths = torch.randint(1, r + 1, (b,), generator=g)
        mask = (torch.arange(r)[None] < lengths[:, None]).to(F64)
        ratio_ = 0.05 * (trial % 3 + 1)
        priority = token_priority(old, adv)

        def choose(idx, count):  # ours: the candidates of lowest priority
            order = torch.sort(priority[idx[:, 0], idx[:, 1]], stable=True).indices
            return idx[order[:count]]

        if name == "clip_cov":
            ours = lambda x: clip_cov_policy_loss(old, x, adv, mask, 0.2, 0.28, "token-mean", clip_cov_ratio=ratio_,  # noqa: E731
                                                  clip_cov_lb=-0.5, clip_cov_ub=0.5)[0]
            verl = lambda x: verl_clip_cov(old, x, adv, mask, 0.2, 0.28, ratio_, -0.5, 0.5, choose)  # noqa: E731
        else:
            ours = lambda x: kl_cov_policy_loss(old, x, adv, mask, "token-mean", kl_cov_ratio=ratio_,  # noqa: E731
                                                ppo_kl_coef=1.5)[0]
            verl = lambda x: verl_kl_cov(old, x, adv, mask, ratio_, 1.5)  # noqa: E731
        losses, grads = [], []
        for fn in (ours, verl):
            x = new.clone().requires_grad_()
            loss = fn(x)
            loss.backward()
            losses.append(loss.detach())
            grads.append(x.grad * mask)
        assert (losses[0] - losses[1]).abs() <= 1e-6, (trial, losses)
        assert (grads[0] - grads[1]).abs().max() <= 1e-6, trial
