"""The reward loop: one score per sample, from a rule function and/or a reward model.

    RewardLoop.compute(batch, tokenizer) -> Rewards(scores [B] float32, rule [B] | None, metrics)
      1. decode each response (model tokens only, no eos/pad) -> solution_str
      2. rule reward per sample, in sample order, in this process's main thread
         (math-verify's timeout needs signals); a function that raises, or returns NaN
         or an infinity, scores 0.0 and is counted
      3. reward-model scores of (prompt messages, response text), if a model is given
      4. score = rule_weight * rule + model_weight * model

The batch is the rollout's output (`reprorl.agent_loop.manager`): tensors `responses`
[B, R] and `response_mask` [B, R] (1 on model-generated tokens); non-tensor columns
`data_source`, `ground_truth`, optional `extra_info` (a dict or None) for the rule
function, and `raw_prompt` (chat messages) for the reward model.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import torch

from reprorl.errors import DataError, ReproRLError
from reprorl.protocol import Batch

logger = logging.getLogger(__name__)


class RewardModel(Protocol):
    """What the loop needs of a reward model: `RewardModelScorer` or `RewardModelPool`."""

    def score(self, prompts: Sequence[list[dict]], responses: Sequence[str]) -> torch.Tensor:
        """[B] float32 scores of (prompt messages, response text) pairs, in the order given."""
        ...


class Rewards(NamedTuple):
    """What `RewardLoop.compute` gives for a batch, in sample order."""

    scores: torch.Tensor
    """[B] float32: rule_weight * rule + model_weight * model, the reward that is trained on."""
    rule: torch.Tensor | None
    """[B] float32 rule scores alone (validation's accuracy); None when the rule function did not run."""
    metrics: dict[str, float]


def decode_responses(responses: torch.Tensor, response_mask: torch.Tensor, tokenizer: Any) -> list[str]:
    """The text of each response: its model tokens (mask 1), without eos and pad tokens.

    responses, response_mask: [B, R]. Tool outputs of a multi-turn loop (mask 0) are left
    out, as verl does; special tokens other than eos/pad (e.g. `<tool_call>`) are kept,
    so a rule function can check a format.
    """
    drop = {t for t in (tokenizer.eos_token_id, tokenizer.pad_token_id) if t is not None}
    texts = []
    for ids, mask in zip(responses.tolist(), response_mask.tolist()):
        kept = [t for t, m in zip(ids, mask) if m and t not in drop]
        texts.append(tokenizer.decode(kept, skip_special_tokens=False))
    return texts


class RewardLoop:
    """Scores a batch of rollouts; one instance per run.

    Args:
        reward_fn: the rule function (`resolve_reward_fn(cfg.reward.fn)`), called as
            `reward_fn(data_source=, solution_str=, ground_truth=, extra_info=)`; it
            returns a float (or verl's `{"score": float, ...}`).
        reward_model: scores (prompt messages, response) pairs; None for rules only.
        rule_weight, model_weight: weights of the two parts in the total. With a reward
            model and `rule_weight == 0`, the rule function is not called at all (a
            reward-model-only dataset may have no ground truth).

    A rule function that raises gives 0.0 for that sample and the run goes on: the
    count is the metric `reward/fn_errors`, and the FIRST such traceback of the run is
    logged (once per `RewardLoop`) with the sample's index, so a broken function is
    seen without flooding the log. A NaN or infinite return counts the same way (it
    would turn every advantage of its group, and the loss, into NaN). A reward model
    that gives a non-finite score is an error (`ReproRLError` naming the samples).
    """

    def __init__(
        self,
        reward_fn: Callable[..., Any],
        reward_model: RewardModel | None = None,
        rule_weight: float = 1.0,
        model_weight: float = 1.0,
    ) -> None:
        self.reward_fn = reward_fn
        self.reward_model = reward_model
        self.rule_weight = float(rule_weight)
        self.model_weight = float(model_weight)
        self.fn_errors_total = 0  # over the run, for the log line

    def _rule_scores(self, batch: Batch, solutions: Sequence[str]) -> tuple[torch.Tensor, int]:
        """([B] float32 rule scores, number of samples whose function raised), in sample order."""
        for key in ("data_source", "ground_truth"):
            if key not in batch.non_tensors:
                raise DataError(f"reward batch has no non-tensor column {key!r}; columns: {batch.keys()}")
        data_sources = batch.non_tensors["data_source"]
        ground_truths = batch.non_tensors["ground_truth"]
        extra_infos = batch.non_tensors.get("extra_info")
        scores, errors = [], 0
        for i, solution in enumerate(solutions):
            try:
                result = self.reward_fn(
                    data_source=data_sources[i],
                    solution_str=solution,
                    ground_truth=ground_truths[i],
                    extra_info=None if extra_infos is None else extra_infos[i],
                )
                # verl's reward functions may return {"score": ..., other diagnostics}.
                score = float(result["score"] if isinstance(result, dict) else result)
                if not math.isfinite(score):
                    raise ValueError(f"reward function returned {score}; expected a finite number")
            except Exception:  # any failure of user code: 0 for this sample, the run goes on
                errors += 1
                if self.fn_errors_total + errors == 1:
                    logger.exception(
                        "reward function raised on sample %d (data_source=%r); it scores 0.0. "
                        "Later errors are only counted (metric reward/fn_errors).", i, data_sources[i]
                    )
                score = 0.0
            scores.append(score)
        self.fn_errors_total += errors
        return torch.tensor(scores, dtype=torch.float32), errors

    def compute(self, batch: Batch, tokenizer: Any) -> Rewards:
        """The batch's `Rewards` (scores, rule scores, metrics), in sample order.

        `tokenizer` is the policy's (it decodes the responses); the reward model tokenizes
        the text with its own. Metrics: `reward/rule_mean` (when rules run),
        `reward/model_mean` (with a reward model), `reward/fn_errors`, `reward/mean`.
        """
        for key in ("responses", "response_mask"):
            if key not in batch.tensors:
                raise DataError(f"reward batch has no tensor {key!r}; tensors: {list(batch.tensors)}")
        solutions = decode_responses(batch["responses"], batch["response_mask"], tokenizer)
        B = len(solutions)
        total = torch.zeros(B, dtype=torch.float32)
        metrics: dict[str, float] = {"reward/fn_errors": 0.0}
        rule = None
        if self.reward_model is None or self.rule_weight != 0.0:
            rule, errors = self._rule_scores(batch, solutions)
            total = total + self.rule_weight * rule
            metrics["reward/rule_mean"] = _mean(rule)
            metrics["reward/fn_errors"] = float(errors)
        if self.reward_model is not None:
            if "raw_prompt" not in batch.non_tensors:
                raise DataError(f"reward model needs the non-tensor column 'raw_prompt'; columns: {batch.keys()}")
            model = self.reward_model.score(list(batch.non_tensors["raw_prompt"]), solutions)
            if model.shape != (B,):
                raise RuntimeError(f"reward model returned scores of shape {list(model.shape)}, expected [{B}]")
            bad = (~torch.isfinite(model)).nonzero().flatten().tolist()
            if bad:
                raise ReproRLError(
                    f"reward model returned non-finite scores for samples {bad[:8]} of {B} (first: "
                    f"{model[bad[0]].item()}); expected finite scores: check reward.model_path's weights"
                )
            total = total + self.model_weight * model.float()
            metrics["reward/model_mean"] = _mean(model)
        metrics["reward/mean"] = _mean(total)
        return Rewards(total, rule, metrics)


def _mean(x: torch.Tensor) -> float:
    """Mean of a [B] tensor, exact and independent of summation order (fsum)."""
    return math.fsum(x.tolist()) / len(x) if len(x) else 0.0
