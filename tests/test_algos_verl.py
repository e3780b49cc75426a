"""The newer estimators and losses against their reference implementations, on random inputs.

Each reference below is a transcription of the named function (the trainer's config object
replaced by plain arguments, logging and the rollout-correction weights left out), with the
repository, path and commit it was read at:

- verl: volcengine/verl verl/trainer/ppo/core_algos.py @ b178a3cd56f58b2d502255daba591e92833930a7
  (0.8.0.dev, January 2026; the newest verl this project could read); `verl_F.masked_*` from
  verl/utils/torch_functional.py at the same commit;
- TRL: huggingface/trl trl/experimental/gmpo/gmpo_trainer.py @ f2cd57710ae345ea6428ae95363267fcf38a3dc8;
- AReaL: inclusionAI/AReaL areal/utils/functional/functional.py @ 4aef98d8d818af55b43621aaadba047ae10f4e77;
- prime-rl: PrimeIntellect-ai/prime-rl src/prime_rl/trainer/rl/loss.py @ 559b44772e471d1538537b8805cc77f3824a5e64;
- GDPO: no release of verl has it; the reference composes upstream verl's
  compute_grpo_outcome_advantage and masked_whiten (volcengine/verl
  b178a3cd56f58b2d502255daba591e92833930a7, Apache-2.0) as the paper (arXiv:2601.05242)
  and NVIDIA's own verl fork (NVlabs/GDPO verl-GDPO, read at b080e63d, not copied: its
  license is non-commercial) combine them: each term normalised in its group, weighted,
  summed, then whitened over the batch's tokens.
Where the bits differ, the test says why and holds the difference under 1e-6.
"""

from collections import defaultdict

import numpy as np
import pytest
import torch

from reprorl.algos import (
    dppo_policy_loss,
    gdpo_advantages,
    geo_mean_policy_loss,
    gpg_advantages,
    gpg_policy_loss,
    grpo_passk_advantages,
    opo_advantages,
    sapo_policy_loss,
)
from reprorl.kernels import pinned


@pytest.fixture(autouse=True)
def _torch_host_math(monkeypatch):
    """Ours in torch's own host math, as the transcriptions are, whether or not a run earlier
    in this process pinned it (kernels.pinned's exp differs from torch.exp in the last bits):
    what is compared is the algorithm, not the exp (the pinned math has tests of its own)."""
    monkeypatch.setattr(pinned, "_pinned", False)

# ---------------------------------------------------------------- verl (core_algos.py)


def verl_masked_sum(values, mask, axis=None):
    valid_values = torch.where(mask.bool(), values, 0.0)
    return (valid_values * mask).sum(axis=axis)


def verl_masked_mean(values, mask, axis=None):
    return verl_masked_sum(values, mask, axis) / (mask.sum(axis=axis) + 1e-8)


def verl_agg_loss(loss_mat, loss_mask, loss_agg_mode):  # dp_size 1, no global batch info
    if loss_agg_mode == "token-mean":
        return verl_masked_sum(loss_mat, loss_mask) / loss_mask.sum()
    if loss_agg_mode == "seq-mean-token-mean":
        seq_mask = torch.sum(loss_mask, dim=-1)
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (seq_mask + 1e-8)
        seq_mask = (seq_mask > 0).float()
        return verl_masked_sum(seq_losses, seq_mask) / seq_mask.sum()
    raise ValueError(loss_agg_mode)


def verl_grpo_passk(token_level_rewards, response_mask, index, epsilon=1e-6, norm_adv_by_std_in_grpo=True):
    scores = token_level_rewards.sum(dim=-1)
    advantages = torch.zeros_like(scores)
    id2scores = defaultdict(list)
    id2indices = defaultdict(list)
    with torch.no_grad():
        bsz = scores.shape[0]
        for i in range(bsz):
            idx = index[i]
            id2scores[idx].append(scores[i])
            id2indices[idx].append(i)
        for idx in id2scores:
            rewards = torch.stack(id2scores[idx])
            if rewards.numel() < 2:
                raise ValueError(f"Pass@k requires at least 2 samples per group. Got {rewards.numel()}")
            topk, topk_idx = torch.topk(rewards, 2)
            r_max, r_second_max = topk[0], topk[1]
            i_max = id2indices[idx][topk_idx[0].item()]
            advantage = r_max - r_second_max
            if norm_adv_by_std_in_grpo:
                std = torch.std(rewards)
                advantage = advantage / (std + epsilon)
            advantages[i_max] = advantage
    advantages = advantages.unsqueeze(-1) * response_mask
    return advantages, advantages


def verl_opo(token_level_rewards, response_mask, index):
    response_length = response_mask.sum(dim=-1)
    scores = token_level_rewards.sum(dim=-1)
    id2score = defaultdict(list)
    id2len = defaultdict(list)
    id2bsl = {}
    with torch.no_grad():
        bsz = scores.shape[0]
        for i in range(bsz):
            id2score[index[i]].append(scores[i])
            id2len[index[i]].append(response_length[i])
        for idx in id2score:
            if len(id2score[idx]) == 1:
                id2bsl[idx] = torch.tensor(0.0)
            elif len(id2score[idx]) > 1:
                score_tensor = torch.stack(id2score[idx])
                len_tensor = torch.stack(id2len[idx])
                id2bsl[idx] = (len_tensor * score_tensor).sum() / len_tensor.sum()
        for i in range(bsz):
            scores[i] = scores[i] - id2bsl[index[i]]
        scores = scores.unsqueeze(-1) * response_mask
    return scores, scores


def verl_gpg(token_level_rewards, response_mask, index, epsilon=1e-6, f_norm=1.0, alpha=1.0):
    scores = token_level_rewards.sum(dim=-1)
    id2score = defaultdict(list)
    id2mean = {}
    id2std = {}
    with torch.no_grad():
        bsz = scores.shape[0]
        m = torch.count_nonzero(scores)
        alpha = bsz / m.clamp(min=1)
        for i in range(bsz):
            id2score[index[i]].append(scores[i])
        for idx in id2score:
            if len(id2score[idx]) == 1:
                id2mean[idx] = torch.tensor(0.0)
                id2std[idx] = torch.tensor(1.0)
            elif len(id2score[idx]) > 1:
                scores_tensor = torch.stack(id2score[idx])
                id2mean[idx] = torch.mean(scores_tensor)
                id2std[idx] = torch.std(scores_tensor)
        for i in range(bsz):
            scores[i] = alpha * (scores[i] - id2mean[index[i]]) / (f_norm)
        scores = scores.unsqueeze(-1) * response_mask
    return scores, scores


def verl_sapo(old_log_prob, log_prob, advantages, response_mask, tau_pos, tau_neg):
    tau_pos = torch.as_tensor(tau_pos, dtype=advantages.dtype, device=advantages.device)
    tau_neg = torch.as_tensor(tau_neg, dtype=advantages.dtype, device=advantages.device)

    def gate_function(x, tau):
        return torch.sigmoid(tau * (x - 1.0)) * (4.0 / tau)

    negative_approx_kl = log_prob - old_log_prob
    negative_approx_kl = torch.clamp(negative_approx_kl, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    taus = torch.where(condition=advantages > 0, input=tau_pos, other=tau_neg)
    gates = gate_function(ratio, taus)
    pg_losses = -gates * advantages
    return verl_agg_loss(pg_losses, response_mask, "seq-mean-token-mean")


def verl_geo_mean(old_log_prob, log_prob, advantages, response_mask, clip_ratio_low, clip_ratio_high):
    cliprange_low, cliprange_high = clip_ratio_low, clip_ratio_high
    negative_approx_kl = log_prob - old_log_prob
    sgn_advantage = torch.sign(advantages)
    negative_approx_kl_clamp = torch.clamp(negative_approx_kl, -cliprange_low, cliprange_high)
    negative_approx_kl_min = torch.min(sgn_advantage * negative_approx_kl, sgn_advantage * negative_approx_kl_clamp)
    negative_approx_kl_min = sgn_advantage * negative_approx_kl_min
    response_mask_sum = response_mask.sum(dim=-1)
    ratio = torch.exp((negative_approx_kl_min * response_mask).sum(dim=-1) / (response_mask_sum + 1e-8))
    advantage = (advantages * response_mask).sum(dim=-1) / (response_mask_sum + 1e-8)
    pg_losses = -advantage * ratio
    pg_loss = torch.mean(pg_losses)
    clipped = torch.ne(negative_approx_kl, negative_approx_kl_clamp)
    pg_clipfrac = verl_masked_mean((clipped * (advantages > 0)).float(), response_mask)
    pg_clipfrac_lower = verl_masked_mean((clipped * (advantages < 0)).float(), response_mask)
    return pg_loss, pg_clipfrac, pg_clipfrac_lower


def verl_gpg_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode):
    pg_losses = -log_prob * advantages
    return verl_agg_loss(pg_losses, response_mask, loss_agg_mode)


# ---------------------------------------------------------------- TRL, AReaL, prime-rl


def trl_gmpo(per_token_logps, old_per_token_logps, advantages, mask, epsilon_low, epsilon_high):
    """GMPOTrainer._compute_loss's objective (`advantages` `(B,)`, no entropy mask, beta 0, no
    gradient accumulation)."""
    log_ratio = per_token_logps - old_per_token_logps
    clamped_log_ratio = torch.clamp(log_ratio, min=-epsilon_low, max=epsilon_high)
    advantages_col = advantages.unsqueeze(1)
    clipped_log_ratio = torch.where(
        advantages_col > 0,
        torch.minimum(log_ratio, clamped_log_ratio),
        torch.maximum(log_ratio, clamped_log_ratio),
    )
    seq_mask = mask
    log_importance_weights = (clipped_log_ratio * seq_mask).sum(-1) / seq_mask.sum(-1).clamp(min=1.0)
    coef = torch.exp(log_importance_weights)
    per_sequence_loss = -coef * advantages
    return per_sequence_loss.mean()


def areal_sapo(logprobs, old_logprobs, advantages, tau_pos, tau_neg, loss_mask):
    """sapo_loss_fn, importance_sampling_level "token"."""
    loss_mask_count = loss_mask.count_nonzero() or 1
    advantages = advantages.detach()
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    gate_pos = torch.sigmoid(tau_pos * (ratio - 1.0))
    gate_neg = torch.sigmoid(tau_neg * (ratio - 1.0))
    scale_pos = 4.0 / tau_pos
    scale_neg = 4.0 / tau_neg
    scaled_gate_pos = gate_pos * scale_pos
    scaled_gate_neg = gate_neg * scale_neg
    is_positive = advantages > 0
    soft_gate = torch.where(is_positive, scaled_gate_pos, scaled_gate_neg)
    pg_loss = -soft_gate * advantages
    return torch.where(loss_mask, pg_loss, 0).sum() / loss_mask_count


def prime_rl_dppo(trainer_logprobs, inference_logprobs, advantages, loss_mask, dppo_mask_low, dppo_mask_high,
                  adv_tau, kl_tau):
    """default_loss_fn on one sample (1-D tensors); returns (per-token loss summed, is_masked)."""
    log_importance_ratio = trainer_logprobs - inference_logprobs
    importance_ratio = torch.exp(log_importance_ratio)
    probs_diff = torch.exp(trainer_logprobs) - torch.exp(inference_logprobs)
    dppo_invalid_mask_high = probs_diff > dppo_mask_high
    dppo_invalid_mask_low = probs_diff < -dppo_mask_low
    positive_advantages = advantages > 0
    dppo_invalid_mask = torch.where(positive_advantages, dppo_invalid_mask_high, dppo_invalid_mask_low)
    is_masked = dppo_invalid_mask
    keep_mask = loss_mask & ~is_masked
    advantages = adv_tau * advantages
    pg_loss = keep_mask * advantages * importance_ratio
    kl_loss = loss_mask * log_importance_ratio**2
    per_token_loss = -pg_loss + kl_tau * kl_loss
    return per_token_loss.sum(), is_masked


def prime_rl_dppo_batch(old, new, adv, mask, *args):
    """prime-rl's rl component over a batch: per-sample sums over the batch's token count."""
    sums = [prime_rl_dppo(new[i], old[i], adv[i], mask[i] > 0, *args)[0] for i in range(len(old))]
    return torch.stack(sums).sum() / mask.sum()


# ---------------------------------------------------------------- GDPO (upstream verl's pieces)


def verl_grpo(token_level_rewards, response_mask, index, epsilon=1e-6):
    """verl's core_algos.compute_grpo_outcome_advantage (norm_adv_by_std_in_grpo=True), its first return."""
    scores = token_level_rewards.sum(dim=-1)
    id2score = defaultdict(list)
    id2mean = {}
    id2std = {}
    with torch.no_grad():
        bsz = scores.shape[0]
        for i in range(bsz):
            id2score[index[i]].append(scores[i])
        for idx in id2score:
            if len(id2score[idx]) == 1:
                id2mean[idx] = torch.tensor(0.0)
                id2std[idx] = torch.tensor(1.0)
            elif len(id2score[idx]) > 1:
                scores_tensor = torch.stack(id2score[idx])
                id2mean[idx] = torch.mean(scores_tensor)
                id2std[idx] = torch.std(scores_tensor)
        for i in range(bsz):
            scores[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + epsilon)
        scores = scores.unsqueeze(-1) * response_mask
    return scores


def verl_masked_whiten(values, mask):
    """verl's torch_functional.masked_whiten (shift_mean=True) with its masked_var (unbiased)."""
    mean = verl_masked_mean(values, mask)
    centered_values = values - mean
    variance = verl_masked_mean(centered_values**2, mask)
    mask_sum = mask.sum()
    variance = variance * (mask_sum / (mask_sum - 1))
    return (values - mean) * torch.rsqrt(variance + 1e-8)


def gdpo_reference(components, weights, response_mask, index):
    """GDPO from verl's pieces: each term [B] through verl's GRPO, weighted and summed in the
    terms' order, whitened over the batch's valid tokens (masked to the response)."""
    total = 0
    for scores, weight in zip(components, weights):
        total = total + weight * verl_grpo(token_rewards(scores, response_mask), response_mask, index)
    return verl_masked_whiten(total, response_mask) * response_mask


# ---------------------------------------------------------------- random inputs


def random_scores(g, trial):
    """Scores `[B]` float32 of 3 groups of 4 interleaved, binary on even trials (ties, zeros);
    group ids as numpy's, as verl's `index`; and a mask with lengths 1..6."""
    b, r = 12, 6
    if trial % 2 == 0:
        scores = (torch.rand(b, generator=g) < 0.4).float()
    else:
        scores = torch.randn(b, generator=g)
    ids = np.array([f"p{i % 3}" for i in range(b)], dtype=object)
    lengths = torch.randint(1, r + 1, (b,), generator=g)
    mask = (torch.arange(r)[None] < lengths[:, None]).float()
    return scores, ids, mask


def token_rewards(scores, mask):
    """Each score at its row's last valid token (as the trainer's token rewards)."""
    rewards = torch.zeros_like(mask)
    rewards[torch.arange(len(scores)), mask.sum(-1).long() - 1] = scores
    return rewards


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_passk_equals_verls_bits(norm_by_std):
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        scores, ids, mask = random_scores(g, trial)
        ours = grpo_passk_advantages(scores, mask, list(ids), norm_by_std=norm_by_std)
        ref, _ = verl_grpo_passk(token_rewards(scores, mask), mask, ids, norm_adv_by_std_in_grpo=norm_by_std)
        assert torch.equal(ours, ref), trial


@pytest.mark.parametrize("name", ["opo", "gpg"])
def test_opo_and_gpg_equal_verls_bits(name):
    ours_fn, ref_fn = {"opo": (opo_advantages, verl_opo), "gpg": (gpg_advantages, verl_gpg)}[name]
    g = torch.Generator().manual_seed(1)
    for trial in range(20):
        scores, ids, mask = random_scores(g, trial)
        if trial % 4 == 1:  # a group of one: verl's baseline 0
            ids[5] = "alone"
        ours = ours_fn(scores, mask, list(ids))
        ref, _ = ref_fn(token_rewards(scores, mask), mask, ids)
        assert torch.equal(ours, ref), trial


def random_loss_inputs(g):
    b, r = 6, 9
    old = -torch.rand(b, r, generator=g) * 3
    new = old + 0.3 * torch.randn(b, r, generator=g)
    adv = torch.randn(b, r, generator=g)
    lengths = torch.randint(1, r + 1, (b,), generator=g)
    mask = (torch.arange(r)[None] < lengths[:, None]).float()
    return old, new, adv, mask


def loss_and_grad(fn, old, new, adv, mask):
    x = new.clone().requires_grad_()
    loss = fn(old, x, adv, mask)
    loss.backward()
    return loss.detach(), x.grad * mask  # valid tokens' gradients


# The tolerance of each comparison (0: equal bits), and why the bits may differ:
# - sapo: torch.sigmoid there, 1 / (1 + exp(-x)) here (the form pinned_exp serves, for the same
#   bits on any CPU), and AReaL sums all tokens at once (below);
# - gpg (verl): the same per-token terms; verl's token-mean sums all tokens at once, agg_loss each
#   row's, then the rows' (the order that makes micro-batches add up): the last bits differ;
# - geo_mean (verl), dppo (prime-rl): the same operations in the same order: equal bits (verl's
#   + 1e-8 on a length of at least 1 rounds away in float32).
REFERENCES = {
    "verl sapo": (lambda o, n, a, m: sapo_policy_loss(o, n, a, m, "seq-mean-token-mean", tau_pos=1.0, tau_neg=1.05)[0],
                  lambda o, n, a, m: verl_sapo(o, n, a, m, 1.0, 1.05), 1e-6),
    "AReaL sapo": (lambda o, n, a, m: sapo_policy_loss(o, n, a, m, "token-mean", tau_pos=1.0, tau_neg=1.05)[0],
                   lambda o, n, a, m: areal_sapo(n, o, a, 1.0, 1.05, m > 0), 1e-6),
    "verl geo_mean": (lambda o, n, a, m: geo_mean_policy_loss(o, n, a, m, 0.4, 0.3)[0],
                      lambda o, n, a, m: verl_geo_mean(o, n, a, m, 0.4, 0.3)[0], 0.0),
    "verl gpg": (lambda o, n, a, m: gpg_policy_loss(o, n, a, m, "token-mean")[0],
                 lambda o, n, a, m: verl_gpg_loss(o, n, a, m, "token-mean"), 1e-6),
    "prime-rl dppo": (lambda o, n, a, m: dppo_policy_loss(o, n, a, m, "token-mean", dppo_mask_low=0.05,
                                                         dppo_mask_high=0.1, adv_tau=0.7, kl_tau=0.01)[0],
                      lambda o, n, a, m: prime_rl_dppo_batch(o, n, a, m, 0.05, 0.1, 0.7, 0.01), 0.0),
}


@pytest.mark.parametrize("name", list(REFERENCES))
def test_losses_and_gradients_match_the_references(name):
    ours_fn, ref_fn, tol = REFERENCES[name]
    g = torch.Generator().manual_seed(2)
    for trial in range(20):
        args = random_loss_inputs(g)
        (loss, grad), (ref_loss, ref_grad) = loss_and_grad(ours_fn, *args), loss_and_grad(ref_fn, *args)
        assert (loss - ref_loss).abs() <= tol, (trial, loss, ref_loss)
        assert (grad - ref_grad).abs().max() <= tol, trial


def test_geo_mean_equals_trls_gmpo_on_sequence_advantages():
    g = torch.Generator().manual_seed(3)
    for trial in range(20):
        old, new, _, mask = random_loss_inputs(g)
        seq_adv = torch.randn(len(old), generator=g)
        if trial % 2:
            seq_adv[0] = 0.0  # no term: both give it no gradient
        adv = seq_adv[:, None] * mask  # one advantage a sequence, 0 at padding (as the estimators give)
        ours = loss_and_grad(lambda o, n, a, m: geo_mean_policy_loss(o, n, a, m, 0.4, 0.4)[0], old, new, adv, mask)
        ref = loss_and_grad(lambda o, n, a, m: trl_gmpo(n, o, seq_adv, m, 0.4, 0.4), old, new, adv, mask)
        # The mean advantage of a sequence (sum / length) is its advantage up to rounding: within 1e-6
        # (measured: 8e-8 in the loss).
        assert (ours[0] - ref[0]).abs() <= 1e-6, trial
        assert (ours[1] - ref[1]).abs().max() <= 1e-6, trial


def test_geo_mean_clip_fractions_equal_verls():
    g = torch.Generator().manual_seed(4)
    for _ in range(10):
        old, new, adv, mask = random_loss_inputs(g)
        _, stats = geo_mean_policy_loss(old, new, adv, mask, 0.2, 0.2)
        _, clipfrac, clipfrac_lower = verl_geo_mean(old, new, adv, mask, 0.2, 0.2)
        # verl's masked_mean divides by (count + 1e-8): rounds away in float32
        assert torch.equal(stats["clipfrac"], clipfrac) and torch.equal(stats["clipfrac_lower"], clipfrac_lower)


def test_dppo_masks_the_tokens_prime_rl_masks():
    g = torch.Generator().manual_seed(5)
    for _ in range(10):
        old, new, adv, mask = random_loss_inputs(g)
        _, stats = dppo_policy_loss(old, new, adv, mask, "token-mean", dppo_mask_low=0.05, dppo_mask_high=0.1)
        masked = torch.stack([prime_rl_dppo(new[i], old[i], adv[i], mask[i] > 0, 0.05, 0.1, 1.0, 1e-3)[1]
                              for i in range(len(old))])
        assert stats["clipfrac"] == (masked.float() * mask).sum() / mask.sum()


def random_components(g, trial):
    """Two reward components `[2, B]` as `random_scores` makes one: binary on even trials
    (groups of equal scores, whose normalised term is 0), normal on odd ones."""
    first, ids, mask = random_scores(g, trial)
    second, _, _ = random_scores(g, trial + 1)
    return torch.stack([first, second]), ids, mask


def test_gdpo_equals_verls_grpo_and_whitening_composed():
    g = torch.Generator().manual_seed(6)
    for trial in range(20):
        scores, ids, mask = random_components(g, trial)
        if trial % 4 == 1:  # a group of one: mean 0, std 1 in both
            ids[5] = "alone"
        weights = [1.0, 1.0] if trial % 2 == 0 else (torch.rand(2, generator=g) * 2 - 0.5).tolist()  # one may be < 0
        ours = gdpo_advantages(scores, weights, mask, list(ids))
        ref = gdpo_reference(scores, weights, mask, ids)
        # The same operations in the same order: the whitening's sums over the batch's tokens are
        # one torch sum in both at this size (thread_free_sum cuts only longer tensors)
        assert torch.equal(ours, ref), trial
