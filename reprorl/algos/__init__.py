"""The RL math, as pure functions, and the one table that describes its choices.

- `masked`: masked reductions, `agg_loss`, entropy, the shape conventions;
- `advantages`: the advantage estimators;
- `policy_losses`: the policy losses and the critic's value loss;
- `gated_losses`: the policy losses without PPO's hard clip (SAPO, GMPO, DPPO, GPG);
- `kl`: the KL estimators, the KL penalty in the reward, the KL controllers;
- `rollout_correction`: the off-policy correction (tis, mis) between behaviour and proximal policies;
- `registry`: `ESTIMATORS` and `POLICY_LOSSES`, each choice's function, flags and help.

The names are re-exported here, so `from reprorl import algos; algos.masked_mean(...)` reads.
"""

from reprorl.algos.advantages import (
    discounted_returns,
    gae_advantages,
    gdpo_advantages,
    gpg_advantages,
    grpo_outcome_advantages,
    grpo_passk_advantages,
    opo_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    remax_advantages,
    rloo_advantages,
)
from reprorl.algos.gated_losses import dppo_policy_loss, geo_mean_policy_loss, gpg_policy_loss, sapo_policy_loss
from reprorl.algos.kl import (
    KL_PENALTY_KINDS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_to_rewards,
    kl_penalty,
)
from reprorl.algos.masked import (
    LOSS_AGG_MODES,
    Count,
    agg_loss,
    entropy_from_logits,
    group_rows,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    scores_to_token_rewards,
)
from reprorl.algos.policy_losses import (
    cispo_policy_loss,
    clip_cov_policy_loss,
    gspo_policy_loss,
    kl_cov_policy_loss,
    ppo_policy_loss,
    token_priority,
    value_loss,
)
from reprorl.algos.rollout_correction import CORRECTIONS, Correction, rollout_correction
from reprorl.algos.registry import (
    ESTIMATORS,
    POLICY_LOSSES,
    AdvantageInputs,
    Estimator,
    PolicyLoss,
    PolicyLossSettings,
    estimator,
    policy_loss,
)

__all__ = [
    "CORRECTIONS", "Correction", "rollout_correction", "ESTIMATORS", "KL_PENALTY_KINDS", "LOSS_AGG_MODES", "POLICY_LOSSES", "AdaptiveKLController",
    "AdvantageInputs", "Count", "Estimator", "FixedKLController", "PolicyLoss", "PolicyLossSettings",
    "agg_loss", "apply_kl_to_rewards", "cispo_policy_loss", "clip_cov_policy_loss", "discounted_returns",
    "entropy_from_logits", "estimator", "gae_advantages", "group_rows", "grpo_outcome_advantages",
    "gspo_policy_loss", "kl_cov_policy_loss", "kl_penalty", "masked_mean", "masked_sum", "masked_var",
    "masked_whiten", "policy_loss", "ppo_policy_loss", "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages", "remax_advantages", "rloo_advantages", "scores_to_token_rewards",
    "token_priority", "value_loss", "gdpo_advantages", "gpg_advantages", "grpo_passk_advantages", "opo_advantages",
    "dppo_policy_loss", "geo_mean_policy_loss", "gpg_policy_loss", "sapo_policy_loss",
]
