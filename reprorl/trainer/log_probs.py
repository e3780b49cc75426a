"""A step's log-probs and values: old (the engine's or recomputed), reference, the critic's;
the check that the engine's equal the trainer's; the off-policy correction.

Old log-probs (`actor.old_log_probs`) come from the engine where they are the trainer's bit
for bit (the built-in engine under full determinism), or where the batch is stale
(`trainer.max_staleness` > 0 without a correction: the PPO ratio is then taken against the
behaviour policy, verl's bypass mode); otherwise the trainer recomputes them. With
`actor.off_policy_correction` tis or mis they are always recomputed (the proximal policy),
and each token's loss is weighted by proximal / behaviour (reprorl/algos/rollout_correction.py).

The exact check (`check_log_prob_gap`) compares the engine's log-probs with the trainer's
on the steps whose batch the current weights generated (staleness 0): with a stale batch the
trainer holds newer weights than the engine used, and their gap is the policy's drift.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from reprorl import algos
from reprorl.config import Config
from reprorl.errors import DeterminismError
from reprorl.protocol import Batch
from reprorl.resources.placement import uses_kl
from reprorl.workers.policy import mask_truncated


def engine_log_probs_exact(cfg: Config) -> bool:
    """The engine's log-probs are the trainer's bit for bit by construction: the built-in
    engine under full determinism (docs/design.md, contract point 2)."""
    return cfg.full_determinism and cfg.rollout.backend == "native"


def old_log_probs_from_rollout(cfg: Config) -> bool:
    """Whether the loss's old log-probs are the engine's (`actor.old_log_probs`); `auto` takes
    them where they are exact, which saves the trainer a forward pass over the batch a step,
    and with stale batches (the behaviour policy's); a correction needs them recomputed."""
    if cfg.actor.off_policy_correction != "none":
        return False
    if cfg.actor.old_log_probs == "auto":
        return engine_log_probs_exact(cfg) or cfg.trainer.max_staleness > 0
    return cfg.actor.old_log_probs == "rollout"


def add_log_probs_and_values(cfg: Config, parts: Any, batch: Batch, mask: torch.Tensor, metrics: dict[str, float],
                             *, step: int, check_due: bool, staleness: int) -> algos.Correction | None:
    """Add `old_log_probs`, and `ref_log_probs` and `values` where those workers exist, to
    `batch` (`mask`: its response mask, float); returns the off-policy correction, or None.
    `check_due`: with old log-probs from the rollout, whether this step recomputes them to
    check (`actor.log_prob_check_freq`); `staleness`: the versions between the batch's and
    the actor's weights."""
    t0 = time.perf_counter()
    temperature = cfg.rollout.temperature
    micro = {"micro_batch_size": cfg.actor.ppo_micro_batch_size,
             "max_token_len": cfg.actor.ppo_max_token_len_per_micro_batch}  # the reference's too
    from_rollout = old_log_probs_from_rollout(cfg)
    check = staleness == 0 and (not from_rollout or check_due)
    if not from_rollout or check:
        trainer_log_probs = parts.actor.compute_log_probs(batch, temperature=temperature, **micro)
    if check:
        # 0 when the engine's log-probs equal the trainer's bit for bit (batch-invariant paths).
        gap = (batch["rollout_log_probs"] - trainer_log_probs).abs() * mask
        metrics["rollout/log_prob_max_gap"] = gap.max().item()
        check_log_prob_gap(cfg, step, metrics["rollout/log_prob_max_gap"], batch["rollout_log_probs"],
                           trainer_log_probs, from_rollout)
    # From the rollout: the trainer's bits under full determinism (checked on the check steps).
    batch["old_log_probs"] = batch["rollout_log_probs"].clone() if from_rollout else trainer_log_probs
    correction = None
    if cfg.actor.off_policy_correction != "none":
        a = cfg.actor
        correction = algos.rollout_correction(
            batch["old_log_probs"], batch["rollout_log_probs"], mask, a.off_policy_correction,
            is_threshold=a.rollout_is_threshold, rs_threshold=a.rollout_rs_threshold,
            rs_threshold_lower=a.rollout_rs_threshold_lower)
        metrics.update(correction.metrics)
    elif staleness > 0 and not from_rollout:  # recomputed: the drift since the behaviour policy
        gap = (batch["old_log_probs"] - batch["rollout_log_probs"]).abs() * mask
        metrics["rollout_corr/log_prob_gap_mean"] = algos.masked_mean(gap, mask).item()
        metrics["rollout_corr/log_prob_gap_max"] = gap.max().item()
    if uses_kl(cfg.actor, cfg.algorithm):  # the ref group, or with LoRA the actor with its adapters off
        ref = parts.ref if parts.ref is not None else parts.actor
        batch["ref_log_probs"] = ref.compute_log_probs(batch, temperature=temperature, base=parts.ref is None,
                                                       **micro)
    if parts.critic is not None:
        batch["values"] = parts.critic.compute_values(
            batch, micro_batch_size=cfg.critic.ppo_micro_batch_size,
            max_token_len=cfg.critic.ppo_max_token_len_per_micro_batch)
    metrics["timing/old_log_prob_s"] = time.perf_counter() - t0
    return correction


def check_log_prob_gap(cfg: Config, step: int, gap: float, rollout: torch.Tensor, trainer: torch.Tensor,
                       exact: bool) -> None:
    """Under full determinism the built-in engine's log-probs ARE the trainer's (docs/design.md,
    contract point 2): a gap means a kernel or the engine broke that, and every step
    after it would train on a mismatch, so the run stops here. vLLM's kernels are not
    ours: its gap is only reported. A gap that is not finite is left to the finiteness
    check, which names the non-finite log-probs (diverged weights) right after. `exact`: the
    run takes the engine's log-probs for the trainer's, so they must match in every bit,
    the sign of a zero included (a gap of 0 does not show -0.0 against 0.0)."""
    promised = engine_log_probs_exact(cfg)
    if promised and exact and gap == 0.0 and not torch.equal(rollout.view(torch.int32), trainer.view(torch.int32)):
        raise DeterminismError(
            f"step {step}: the engine's log-probs equal the trainer's in value but not in every bit (a zero's "
            "sign) with actor.old_log_probs taking the engine's; set actor.old_log_probs=recompute"
        )
    if math.isfinite(gap) and gap != 0.0 and promised:
        raise DeterminismError(
            f"step {step}: the engine's log-probs differ from the trainer's by up to {gap:.3g} "
            "(rollout/log_prob_max_gap) with full_determinism=true and rollout.backend=native, where they are "
            "equal bit for bit by construction; the run stops (set full_determinism=false to run without the "
            "promise)"
        )


def actor_batch(cfg: Config, batch: Batch, correction: algos.Correction | None) -> Batch:
    """The batch the actor's update reads: with `actor.mask_truncated` the truncated responses
    masked out, with a correction the rejected tokens too and each token's advantage times its
    IS weight (the same as weighting its loss: every policy loss allowed with a correction is
    linear in a token's advantage for a positive weight, config/checks.py). A shallow copy:
    the critic and the fingerprint keep the real mask and advantages."""
    if not cfg.actor.mask_truncated and correction is None:
        return batch
    out = batch.slice(0, len(batch))
    mask = batch["response_mask"]
    if cfg.actor.mask_truncated:
        mask = mask_truncated(mask, batch.non_tensors["finish_reason"])
    if correction is not None:
        mask = mask * correction.mask.to(mask.dtype)
        out["advantages"] = batch["advantages"] * correction.weights
    out["response_mask"] = mask
    return out
