"""KL: the per-token estimators, the KL penalty in the reward and the KL coefficient's controllers."""

from __future__ import annotations

from typing import Any

import torch

from reprorl.algos.masked import check_same_shape, masked_mean
from reprorl.kernels.pinned import pinned_exp

# k1/k2/k3 as in Schulman's note, and abs; "kl", "mse" and "low_var_kl" are verl's names
# for k1/k2/k3. A trailing "+" (k1+, k3+, ...) is the straight-through variant, as in verl.
_KL_ESTIMATORS = ("k1", "k2", "k3", "abs", "kl", "mse", "low_var_kl")
KL_PENALTY_KINDS = _KL_ESTIMATORS + tuple(kind + "+" for kind in _KL_ESTIMATORS)
_KL_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}


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
    check_same_shape(log_prob=log_prob, ref_log_prob=ref_log_prob)
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
    check_same_shape(token_scores=token_scores, kl=kl, response_mask=response_mask)
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
