"""The reward loop: one score per sample, from a rule function and/or a reward model.

    RewardLoop.compute(batch, tokenizer) -> Rewards(scores [B] float32, rule [B] | None, metrics)
      1. decode each response (model tokens only, no eos/pad) -> solution_str
      2. rule reward per sample, in sample order, in a main thread (math-verify's
         timeout needs signals): a child process's under a per-call time limit
         (`rule_worker`), or this process's without one; a function that raises, or
         returns NaN or an infinity, scores 0.0 and is counted; failing on more than
         `max_error_rate` of the samples is an error
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
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import torch

from reprorl.errors import DataError, ReproRLError
from reprorl.protocol import Batch
from reprorl.reward.rule_worker import START_TIMEOUT_S, Outcome, RuleWorker, call_rule_fn

logger = logging.getLogger(__name__)


class RewardTimeoutError(ReproRLError):
    """A rule function passed `reward.timeout_s` with full determinism on: scoring it 0
    would make the run's result depend on timing, so the run stops."""


class RewardFnError(ReproRLError):
    """The rule function failed (raised, or timed out) on more than `max_error_rate` of a
    batch's samples: their 0s would be trained on as rewards, so the run stops."""


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

        timeout_s: the most seconds one rule-function call may take; the calls then run
            in a child process (`RuleWorker`) that is killed at the limit. None: no limit,
            the calls run in this process.
        timeout_is_error: a timed-out call raises `RewardTimeoutError` naming the sample,
            its data source and the limit (full determinism: a 0 would depend on timing);
            False: it scores 0.0 and is counted (`reward/fn_timeouts`).
        start_timeout_s: how long the child may take to load the function (its imports;
            `RuleWorker`); `trainer.part_timeout_s` in a run.
        max_error_rate: the largest share of a batch's samples on which the rule function
            may fail (raise, or time out) and score 0; more raises `RewardFnError` naming
            the function, the count and the first failure. None: no limit.

    A rule function that raises gives 0.0 for that sample and the run goes on (while
    within `max_error_rate`): the count is the metric `reward/fn_errors`, and the
    FIRST such traceback of the run is logged (once per `RewardLoop`) with the sample's
    index, so a broken function is seen without flooding the log; the first timeout is
    logged the same way. A NaN or infinite return counts as an error (it would turn every advantage of its group, and
    the loss, into NaN). A reward model that gives a non-finite score is an error
    (`ReproRLError` naming the samples). `close()` stops the child process.
    """

    def __init__(
        self,
        reward_fn: Callable[..., Any],
        reward_model: RewardModel | None = None,
        rule_weight: float = 1.0,
        model_weight: float = 1.0,
        *,
        timeout_s: float | None = None,
        timeout_is_error: bool = True,
        start_timeout_s: float = START_TIMEOUT_S,
        max_error_rate: float | None = None,
    ) -> None:
        self.reward_fn = reward_fn
        self.max_error_rate = max_error_rate
        self.reward_model = reward_model
        self.rule_weight = float(rule_weight)
        self.model_weight = float(model_weight)
        self.timeout_s = timeout_s
        self.timeout_is_error = timeout_is_error
        self.fn_errors_total = 0  # over the run, for the log line
        self.fn_timeouts_total = 0
        self._worker = None
        if timeout_s is not None:
            try:
                self._worker = RuleWorker(reward_fn, start_timeout_s)
            except Exception as err:  # cloudpickle refuses some objects (locks, generators)
                raise ReproRLError(
                    f"reward.fn {getattr(reward_fn, '__name__', reward_fn)!r} cannot be sent to a rule-reward "
                    f"process ({type(err).__name__}: {err}); set reward.timeout_s=null to call it in the "
                    "trainer's process, without a time limit"
                ) from err

    def close(self) -> None:
        """Stop the rule-reward process, if one runs."""
        if self._worker is not None:
            self._worker.close()

    def _rule_scores(self, batch: Batch, solutions: Sequence[str]) -> tuple[torch.Tensor, int, int]:
        """([B] float32 rule scores, samples whose function raised, samples that timed out), in sample order."""
        for key in ("data_source", "ground_truth"):
            if key not in batch.non_tensors:
                raise DataError(f"reward batch has no non-tensor column {key!r}; columns: {batch.keys()}")
        data_sources = batch.non_tensors["data_source"]
        ground_truths = batch.non_tensors["ground_truth"]
        extra_infos = batch.non_tensors.get("extra_info")
        calls = [
            {"data_source": data_sources[i], "solution_str": solution, "ground_truth": ground_truths[i],
             "extra_info": None if extra_infos is None else extra_infos[i]}
            for i, solution in enumerate(solutions)
        ]
        if self._worker is None:
            outcomes = [self._call_here(call) for call in calls]
        else:
            outcomes = self._worker.run(calls, self.timeout_s, stop_at_timeout=self.timeout_is_error)
        scores, errors, timeouts = [], 0, 0
        for i, outcome in enumerate(outcomes):
            if outcome.kind == "timeout":
                if self.timeout_is_error:
                    raise RewardTimeoutError(
                        f"the reward function did not return within reward.timeout_s={self.timeout_s:g} s on "
                        f"sample {i} (data_source={data_sources[i]!r}); with full_determinism a timed-out sample "
                        "cannot score 0 (the result would depend on timing): fix the function or raise the limit"
                    )
                timeouts += 1
                if self.fn_timeouts_total + timeouts == 1:
                    logger.warning(
                        "reward function did not return within reward.timeout_s=%g s on sample %d (data_source=%r); "
                        "it scores 0.0. Later timeouts are only counted (metric reward/fn_timeouts).",
                        self.timeout_s, i, data_sources[i])
            elif outcome.kind == "error":
                errors += 1
                if self.fn_errors_total + errors == 1:
                    logger.error(
                        "reward function raised on sample %d (data_source=%r); it scores 0.0. "
                        "Later errors are only counted (metric reward/fn_errors).\n%s", i, data_sources[i],
                        outcome.error)
            scores.append(outcome.score)
        self._check_failures(outcomes, data_sources)
        self.fn_errors_total += errors
        self.fn_timeouts_total += timeouts
        return torch.tensor(scores, dtype=torch.float32), errors, timeouts

    def _check_failures(self, outcomes: Sequence[Outcome], data_sources: Sequence[str]) -> None:
        """Raise `RewardFnError` if more than `max_error_rate` of `outcomes` failed."""
        failed = [i for i, outcome in enumerate(outcomes) if outcome.kind != "ok"]
        if self.max_error_rate is None or len(failed) <= self.max_error_rate * len(outcomes):
            return
        first = outcomes[failed[0]]
        if first.kind == "timeout":
            why = f"timed out (reward.timeout_s={self.timeout_s:g} s)"
        else:
            why = _exception(first.error)
        name = getattr(self.reward_fn, "__name__", repr(self.reward_fn))
        raise RewardFnError(
            f"the reward function {name!r} failed on {len(failed)} of {len(outcomes)} samples, more than "
            f"reward.max_error_rate={self.max_error_rate:g}; the first, sample {failed[0]} (data_source="
            f"{data_sources[failed[0]]!r}): {why}"
        )

    def _call_here(self, call: dict[str, Any]) -> Outcome:
        try:
            return Outcome("ok", score=call_rule_fn(self.reward_fn, call))
        except Exception:  # any failure of user code: 0 for this sample, the run goes on
            return Outcome("error", error=traceback.format_exc())

    def compute(self, batch: Batch, tokenizer: Any) -> Rewards:
        """The batch's `Rewards` (scores, rule scores, metrics), in sample order.

        `tokenizer` is the policy's (it decodes the responses); the reward model tokenizes
        the text with its own. Metrics: `reward/rule_mean`, `reward/fn_timeouts` (when
        rules run), `reward/model_mean` (with a reward model), `reward/fn_errors`,
        `reward/mean`.
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
            rule, errors, timeouts = self._rule_scores(batch, solutions)
            total = total + self.rule_weight * rule
            metrics["reward/rule_mean"] = _mean(rule)
            metrics["reward/fn_errors"] = float(errors)
            metrics["reward/fn_timeouts"] = float(timeouts)
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


def _exception(error: str) -> str:
    """The exception of a traceback as one line: its lines after the last indented one
    (the frames), joined; a text that is no traceback, whole."""
    lines = error.strip().splitlines()
    last_frame = max((i for i, line in enumerate(lines) if line.startswith(" ")), default=-1)
    return " ".join(line.strip() for line in lines[last_frame + 1 :])


def _mean(x: torch.Tensor) -> float:
    """Mean of a [B] tensor, exact and independent of summation order (fsum)."""
    return math.fsum(x.tolist()) / len(x) if len(x) else 0.0
