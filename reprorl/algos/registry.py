"""The one table of the advantage estimators and policy losses: each described once.

The config's choices (`algorithm.adv_estimator`, `actor.policy_loss`) are these tables'
keys (tests/test_algos_registry.py holds the schema's `Literal`s to them), and every check
that depends on the estimator asks its flags here instead of comparing names.
Names are verl's (`algorithm.adv_estimator`, `policy_loss.loss_mode`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from reprorl.algos import advantages as adv
from reprorl.algos import gated_losses as gl
from reprorl.algos import policy_losses as pl


@dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator may read (each reads its own share). Tensors `[B, T]` unless said."""

    token_rewards: torch.Tensor
    """The score at each sample's last token, plus any per-token KL penalty."""
    response_mask: torch.Tensor
    group_ids: Sequence[Hashable]
    """B ids, one per prompt (verl's `uid`)."""
    gamma: float
    lam: float
    norm_by_std: bool
    """Divide by the group's std (grpo, grpo_passk)."""
    values: torch.Tensor | None = None
    """The critic's values (gae only)."""
    reward_baselines: torch.Tensor | None = None
    """`[B]`: the reward of the greedy response to each sample's prompt (remax only)."""
    reward_components: torch.Tensor | None = None
    """`[B, K]`: each term of the reward on its own (`reprorl.reward.loop.Rewards.components`; gdpo only)."""
    component_weights: Sequence[float] = ()
    """The K weights of those terms (`RewardLoop.component_weights`)."""


def _gae(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    return adv.gae_advantages(x.token_rewards, x.values, x.response_mask, x.gamma, x.lam)


def _grpo(x: AdvantageInputs) -> torch.Tensor:
    scores = x.token_rewards.sum(-1)  # [B]
    return adv.grpo_outcome_advantages(scores, x.response_mask, list(x.group_ids), norm_by_std=x.norm_by_std)


def _remax(x: AdvantageInputs) -> torch.Tensor:
    return adv.remax_advantages(x.token_rewards, x.reward_baselines, x.response_mask)


def _rloo(x: AdvantageInputs) -> torch.Tensor:
    return adv.rloo_advantages(x.token_rewards.sum(-1), x.response_mask, list(x.group_ids))


def _reinforce_pp(x: AdvantageInputs) -> torch.Tensor:
    return adv.reinforce_pp_advantages(x.token_rewards, x.response_mask, x.gamma)


def _reinforce_pp_baseline(x: AdvantageInputs) -> torch.Tensor:
    return adv.reinforce_pp_baseline_advantages(x.token_rewards.sum(-1), x.response_mask, list(x.group_ids))


def _grpo_passk(x: AdvantageInputs) -> torch.Tensor:
    scores = x.token_rewards.sum(-1)  # [B]
    return adv.grpo_passk_advantages(scores, x.response_mask, list(x.group_ids), norm_by_std=x.norm_by_std)


def _gdpo(x: AdvantageInputs) -> torch.Tensor:
    if x.reward_components is None:
        raise ValueError("gdpo reads each reward term on its own: AdvantageInputs.reward_components is None")
    return adv.gdpo_advantages(x.reward_components.T, x.component_weights, x.response_mask, list(x.group_ids))


def _opo(x: AdvantageInputs) -> torch.Tensor:
    return adv.opo_advantages(x.token_rewards.sum(-1), x.response_mask, list(x.group_ids))


def _gpg(x: AdvantageInputs) -> torch.Tensor:
    return adv.gpg_advantages(x.token_rewards.sum(-1), x.response_mask, list(x.group_ids))


@dataclass(frozen=True)
class Estimator:
    name: str
    fn: Callable[..., Any]
    """The math (`reprorl.algos.advantages`)."""
    call: Callable[[AdvantageInputs], torch.Tensor | tuple[torch.Tensor, torch.Tensor]]
    """`fn` called on `AdvantageInputs`: advantages, or (advantages, returns) with a critic."""
    help: str
    needs_critic: bool = False
    """Trains a critic (its model, workers and batch sizes): its call returns the returns too."""
    group_based: bool = False
    """Compares the samples of one prompt: needs rollout.n >= 2 and samples that differ."""
    greedy_baseline: bool = False
    """Rolls out one greedy response per prompt as the baseline (ReMax)."""
    token_rewards: bool = True
    """Reads the per-token rewards; False: each sample's sum of them, its sequence score, and
    so gives every token of a sample one same advantage."""
    divides_by_group_std: bool = False
    """Reads `algorithm.norm_adv_by_std` (whether to divide by the group's std); the others
    refuse it set to false, which they would ignore."""
    reward_components: bool = False
    """Reads each term of the reward on its own (`AdvantageInputs.reward_components`), not their
    weighted sum: the batch carries them from the reward loop, and the KL penalty cannot be in
    the reward (it is none of the terms)."""

    def advantages(self, inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """(advantages, returns) `[B, T]`; without a critic the returns are the advantages."""
        out = self.call(inputs)
        if self.needs_critic:
            return out
        return out, out


ESTIMATORS: dict[str, Estimator] = {e.name: e for e in (
    Estimator("gae", adv.gae_advantages, _gae, "PPO's GAE on the critic's values (trains a critic)",
              needs_critic=True),
    Estimator("grpo", adv.grpo_outcome_advantages, _grpo,
              "GRPO: the score minus its group's mean, over the group's std (norm_adv_by_std)",
              group_based=True, token_rewards=False, divides_by_group_std=True),
    Estimator("remax", adv.remax_advantages, _remax,
              "ReMax: the return-to-go minus the greedy response's reward", greedy_baseline=True),
    Estimator("rloo", adv.rloo_advantages, _rloo, "RLOO: the score minus the mean of the group's other scores",
              group_based=True, token_rewards=False),
    Estimator("reinforce_pp", adv.reinforce_pp_advantages, _reinforce_pp,
              "REINFORCE++: the discounted return-to-go, whitened over the batch"),
    Estimator("reinforce_pp_baseline", adv.reinforce_pp_baseline_advantages, _reinforce_pp_baseline,
              "REINFORCE++ with a baseline: the score minus its group's mean, whitened over the batch",
              group_based=True, token_rewards=False),
    Estimator("grpo_passk", adv.grpo_passk_advantages, _grpo_passk,
              "pass@k (k = rollout.n): only a group's best sample gets an advantage, its score minus the "
              "second best (over the group's std with norm_adv_by_std)", group_based=True, token_rewards=False,
              divides_by_group_std=True),
    Estimator("opo", adv.opo_advantages, _opo,
              "OPO: the score minus the group's length-weighted mean score (the optimal baseline)",
              group_based=True, token_rewards=False),
    Estimator("gpg", adv.gpg_advantages, _gpg,
              "GPG: the score minus its group's mean, times batch size / nonzero scores", group_based=True,
              token_rewards=False),
    Estimator("gdpo", adv.gdpo_advantages, _gdpo,
              "GDPO: each reward term (each reward.fns function, the reward model, the overlong penalty) minus "
              "its group's mean over its group's std, summed with its weight, then whitened over the batch's "
              "tokens; one term: grpo then whitened", group_based=True, token_rewards=False,
              reward_components=True),
)}


def estimator(name: str) -> Estimator:
    """The record of `algorithm.adv_estimator` `name`."""
    if name not in ESTIMATORS:
        raise ValueError(f"advantage estimator {name!r}; expected one of {', '.join(ESTIMATORS)}")
    return ESTIMATORS[name]


# ---------------------------------------------------------------- policy losses


@dataclass(frozen=True)
class PolicyLossSettings:
    """The actor's loss settings a policy loss reads (`actor.*`)."""

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    cov: Mapping[str, float] | None = None
    """The loss's own keywords (`PolicyLoss.cov_keywords`: clip_cov's, kl_cov's, sapo's, dppo's);
    None: their defaults (verl's, prime-rl's for dppo)."""


LossResult = tuple[torch.Tensor, dict[str, torch.Tensor]]


def _vanilla(old_log_prob, log_prob, advantages, response_mask, s: PolicyLossSettings, **norms) -> LossResult:
    return pl.ppo_policy_loss(old_log_prob, log_prob, advantages, response_mask, s.clip_ratio_low,
                              s.clip_ratio_high, s.clip_ratio_c, s.loss_agg_mode, **norms)


def _gspo(old_log_prob, log_prob, advantages, response_mask, s: PolicyLossSettings, **norms) -> LossResult:
    return pl.gspo_policy_loss(old_log_prob, log_prob, advantages, response_mask, s.clip_ratio_low,
                               s.clip_ratio_high, **norms)


def _cispo(old_log_prob, log_prob, advantages, response_mask, s: PolicyLossSettings, **norms) -> LossResult:
    return pl.cispo_policy_loss(old_log_prob, log_prob, advantages, response_mask, s.clip_ratio_low,
                                s.clip_ratio_high, s.loss_agg_mode, **norms)


def _clip_cov(old_log_prob, log_prob, advantages, response_mask, s: PolicyLossSettings, **norms) -> LossResult:
    return pl.clip_cov_policy_loss(old_log_prob, log_prob, advantages, response_mask, s.clip_ratio_low,
                                   s.clip_ratio_high, s.loss_agg_mode, **(s.cov or {}), **norms)


def _kl_cov(old_log_prob, log_prob, advantages, response_mask, s: PolicyLossSettings, **norms) -> LossResult:
    return pl.kl_cov_policy_loss(old_log_prob, log_prob, advantages, response_mask, s.loss_agg_mode,
                                 **(s.cov or {}), **norms)


def _sapo(old_log_prob, log_prob, advantages, response_mask, s: PolicyLossSettings, **norms) -> LossResult:
    return gl.sapo_policy_loss(old_log_prob, log_prob, advantages, response_mask, s.loss_agg_mode, **(s.cov or {}),
                               **norms)


def _geo_mean(old_log_prob, log_prob, advantages, response_mask, s: PolicyLossSettings, **norms) -> LossResult:
    return gl.geo_mean_policy_loss(old_log_prob, log_prob, advantages, response_mask, s.clip_ratio_low,
                                   s.clip_ratio_high, **norms)


def _dppo(old_log_prob, log_prob, advantages, response_mask, s: PolicyLossSettings, **norms) -> LossResult:
    return gl.dppo_policy_loss(old_log_prob, log_prob, advantages, response_mask, s.loss_agg_mode, **(s.cov or {}),
                               **norms)


def _gpg_loss(old_log_prob, log_prob, advantages, response_mask, s: PolicyLossSettings, **norms) -> LossResult:
    return gl.gpg_policy_loss(old_log_prob, log_prob, advantages, response_mask, s.loss_agg_mode, **norms)


@dataclass(frozen=True)
class PolicyLoss:
    name: str
    fn: Callable[..., LossResult]
    """The math (`reprorl.algos.policy_losses`)."""
    call: Callable[..., LossResult]
    """The one signature: `call(old_log_prob, log_prob, advantages, response_mask, settings, **norms)`,
    `norms` `agg_loss`'s global_* keywords. Stats have "clipfrac" and "approx_kl"."""
    help: str
    cov_keywords: tuple[str, ...] = ()
    """The `actor.*` keys of this loss alone, passed as `settings.cov` (named for clip_cov and kl_cov,
    the first losses that had any; reprorl/trainer/parts.py reads them)."""
    sequence_advantages: bool = False
    """Takes one advantage a sequence: refused with estimators that give one a token."""
    token_weightable: bool = True
    """Its policy-gradient term is linear in each token's advantage with the same selection for
    any positive scaling of it, so an off-policy correction's token weights may scale the
    advantages (`actor.off_policy_correction`, reprorl/algos/rollout_correction.py); False:
    refused with one (the covariance losses select tokens by the advantages' values)."""


POLICY_LOSSES: dict[str, PolicyLoss] = {p.name: p for p in (
    PolicyLoss("vanilla", pl.ppo_policy_loss, _vanilla, "PPO's clip with dual-clip"),
    PolicyLoss("gspo", pl.gspo_policy_loss, _gspo,
               "PPO's clip on a sequence-level ratio, reduced seq-mean-token-mean whatever loss_agg_mode (set small "
               "clip ratios, e.g. 3e-4 / 4e-4)"),
    PolicyLoss("cispo", pl.cispo_policy_loss, _cispo,
               "the clipped ratio as a stopped weight on log-prob, every token keeps a gradient"),
    PolicyLoss("clip_cov", pl.clip_cov_policy_loss, _clip_cov,
               "PPO's clip, and a few tokens of advantage-log-prob covariance in (clip_cov_lb, clip_cov_ub) get no "
               "gradient (chosen at random by a hash of the data)",
               cov_keywords=("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"), token_weightable=False),
    PolicyLoss("kl_cov", pl.kl_cov_policy_loss, _kl_cov,
               "the unclipped surrogate plus ppo_kl_coef * |log-ratio| on the tokens of largest covariance",
               cov_keywords=("kl_cov_ratio", "ppo_kl_coef"), token_weightable=False),
    PolicyLoss("sapo", gl.sapo_policy_loss, _sapo,
               "SAPO: a smooth sigmoid gate on the ratio (temperatures tau_pos, tau_neg) instead of the hard clip",
               cov_keywords=("tau_pos", "tau_neg")),
    PolicyLoss("geo_mean", gl.geo_mean_policy_loss, _geo_mean,
               "GMPO: the geometric mean of a sequence's token ratios, each clipped in log space by clip_ratio_low / "
               "clip_ratio_high (the paper's 0.4), one advantage a sequence, reduced over sequences",
               sequence_advantages=True, token_weightable=False),
    PolicyLoss("dppo", gl.dppo_policy_loss, _dppo,
               "prime-rl's DPPO: tokens whose probability moved past dppo_mask_low / dppo_mask_high leave the "
               "policy gradient, plus kl_tau * squared log-ratio", cov_keywords=("dppo_mask_low", "dppo_mask_high",
                                                                               "adv_tau", "kl_tau")),
    PolicyLoss("gpg", gl.gpg_policy_loss, _gpg_loss, "GPG: the plain policy gradient -A * log_prob, no ratio, no clip"),
)}


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
) -> LossResult:
    """The policy loss `mode` names (`POLICY_LOSSES`; "vanilla": `ppo_policy_loss`), with the
    actor's settings; `cov`: the loss's own keywords (`PolicyLoss.cov_keywords`; their
    defaults: verl's); `norms` are `agg_loss`'s global_* keywords. Every
    mode's stats have "clipfrac" and "approx_kl" (the trainer logs those); vanilla's also
    "clipfrac_lower"."""
    if mode not in POLICY_LOSSES:
        raise ValueError(f"policy loss {mode!r}; expected one of {', '.join(POLICY_LOSSES)}")
    settings = PolicyLossSettings(clip_ratio_low, clip_ratio_high, clip_ratio_c, loss_agg_mode, cov)
    return POLICY_LOSSES[mode].call(old_log_prob, log_prob, advantages, response_mask, settings, **norms)
