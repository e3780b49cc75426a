"""The reward loop: one score per sample, from a rule function and/or a reward model.

    RewardLoop.compute(batch, tokenizer) -> Rewards(scores [B] float32, rule [B] | None, metrics, answers,
                                                    components [B, K])
      1. decode each response (model tokens only, no eos/pad) -> solution_str
      2. rule reward per sample, in sample order, in a main thread (math-verify's
         timeout needs signals): a child process's under a per-call time limit
         (`rule_worker`), or this process's without one; a function that raises, or
         returns NaN or an infinity, scores 0.0 and is counted; failing on more than
         `max_error_rate` of the samples is an error. Several weighted functions: the
         rule reward is their weighted sum (`weighted_sum`); a batch function is called
         once with lists instead of once per sample
      3. reward-model scores of (prompt messages, response text), if a model is given
      4. score = rule_weight * rule + model_weight * model (+ DAPO's `overlong_penalty`);
         each of its terms is also kept on its own (`Rewards.components`, for GDPO)
      5. each sample's final answer, when a rule function reports one (verl's "pred" in
         its result dict; the built-in rewards do): validation's majority vote (maj@n)

The batch is the rollout's output (`reprorl.agent_loop.manager`): tensors `responses`
[B, R] and `response_mask` [B, R] (1 on model-generated tokens); non-tensor columns
`data_source`, `ground_truth`, optional `extra_info` (a dict or None) for the rule
function, and `raw_prompt` (chat messages) for the reward model.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import torch

from reprorl.errors import DataError, ReproRLError
from reprorl.protocol import Batch
from reprorl.reward.rule_worker import START_TIMEOUT_S, Outcome, RuleWorker, call_batch_fn, call_rule_fn

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


class WeightedFn(NamedTuple):
    """One of several rule functions: its metric name (`reward/<name>/mean`), the function, its weight."""

    name: str
    fn: Callable[..., Any]
    weight: float


class Rewards(NamedTuple):
    """What `RewardLoop.compute` gives for a batch, in sample order."""

    scores: torch.Tensor
    """[B] float32: rule_weight * rule + model_weight * model (+ the overlong penalty), the reward trained on."""
    rule: torch.Tensor | None
    """[B] float32 rule scores alone, weighted sum of several functions (validation's accuracy); None when no rule
    function ran."""
    metrics: dict[str, float]
    answers: list[str | None] | None = None
    """Each sample's final answer as the first rule function that reports answers gave it
    (None where it gave none); None when no function reports any."""
    components: torch.Tensor | None = None
    """[B, K] float32: each term of `scores` on its own, in the order of `RewardLoop.component_weights`:
    each rule function's score, the reward model's, the overlong penalty (those that run)."""


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


def weighted_sum(scores: Sequence[Sequence[float]], weights: Sequence[float]) -> list[float]:
    """Per sample i, `weights[0] * scores[0][i] + weights[1] * scores[1][i] + ...`, added
    left to right in float64 (a fixed order, so the same bits every run).

    scores: one [B] list per function, in the config's order.

    >>> weighted_sum([[1.0, 0.0], [0.5, 0.25]], [1.0, 2.0])
    [2.0, 0.5]
    """
    total = [0.0] * len(scores[0])
    for fn_scores, weight in zip(scores, weights, strict=True):
        total = [t + weight * x for t, x in zip(total, fn_scores, strict=True)]
    return total


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer_len: int, penalty_factor: float) -> torch.Tensor:
    """DAPO's overlong reward shaping (Yu et al. 2025, arXiv:2503.14476, eq. 13; verl's DAPO
    reward manager): `min(-(L - (M - B)) / B * penalty_factor, 0)` for a response of L
    tokens, M = `max_length`, B = `buffer_len`: 0 up to M - B tokens, then falling
    linearly to -penalty_factor at M.

    lengths: [B] response lengths; returns [B] float32 (computed in float64, as verl's
    Python floats).

    >>> overlong_penalty(torch.tensor([4, 6, 7, 8]), max_length=8, buffer_len=4, penalty_factor=1.0).tolist()
    [0.0, -0.5, -0.75, -1.0]
    """
    exceed = lengths.to(torch.float64) - (max_length - buffer_len)  # [B]
    # 0.0 itself where the response is short enough (min() would give -0.0 at exceed 0)
    return torch.where(exceed > 0, -exceed / buffer_len * penalty_factor, 0.0).to(torch.float32)


def response_lengths(batch: Batch) -> torch.Tensor:
    """[B] tokens of each response, model and tool tokens alike (verl's DAPO reward manager
    counts the response's attention mask): the columns of `attention_mask` after the prompt's."""
    for key in ("prompts", "attention_mask"):
        if key not in batch.tensors:
            raise DataError(f"reward batch has no tensor {key!r}; tensors: {list(batch.tensors)}")
    return batch["attention_mask"][:, batch["prompts"].shape[1] :].sum(-1)


class RewardLoop:
    """Scores a batch of rollouts; one instance per run.

    Args:
        reward_fn: the rule function (`resolve_reward_fn(cfg.reward.fn)`), called as
            `reward_fn(data_source=, solution_str=, ground_truth=, extra_info=)`; it
            returns a float (or verl's `{"score": float, "pred": answer, ...}`; the
            "pred" is the sample's final answer, for validation's maj@n). Or several, a list of
            `WeightedFn`: the rule reward is their `weighted_sum`, and each function's
            mean is the metric `reward/<name>/mean`; each one's failures are counted
            (and checked against `max_error_rate`) on their own.
        batch: call each rule function once per batch with lists, as verl's batch reward
            manager does: `fn(data_sources=, solution_strs=, ground_truths=, extra_infos=)`
            returning one score per sample; a failure (or time-out) of that call fails
            every sample of the batch.
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
        num_workers: child processes per rule function (`reward.num_workers`): a batch's
            calls are cut into this many contiguous runs of samples, scored side by side
            (code rewards, which run programs, gain from it) and put back in sample order,
            so the scores do not depend on the count.
        max_error_rate: the largest share of a batch's samples on which the rule function
            may fail (raise, or time out) and score 0; more raises `RewardFnError` naming
            the function, the count and the first failure. None: no limit.
        overlong_buffer: DAPO's buffer length B (`overlong_penalty`, with `max_length` and
            `overlong_penalty_factor`), its penalty added to each sample's score; None: off.

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
        reward_fn: Callable[..., Any] | Sequence[WeightedFn],
        reward_model: RewardModel | None = None,
        rule_weight: float = 1.0,
        model_weight: float = 1.0,
        *,
        batch: bool = False,
        timeout_s: float | None = None,
        timeout_is_error: bool = True,
        start_timeout_s: float = START_TIMEOUT_S,
        num_workers: int = 1,
        max_error_rate: float | None = None,
        overlong_buffer: int | None = None,
        overlong_penalty_factor: float = 0.0,
        max_length: int | None = None,
    ) -> None:
        # One function alone is not named: its metrics stay those of a plain run.
        self.named = not callable(reward_fn)
        self.fns = list(reward_fn) if self.named else [WeightedFn("", reward_fn, 1.0)]
        if not self.fns:
            raise ValueError("RewardLoop: an empty list of reward functions")
        if overlong_buffer is not None and (max_length is None or not 1 <= overlong_buffer <= max_length):
            raise ValueError(f"RewardLoop: overlong_buffer={overlong_buffer} needs 1 <= it <= max_length={max_length}")
        self.batch = batch
        self.overlong_buffer = overlong_buffer
        self.overlong_penalty_factor = float(overlong_penalty_factor)
        self.max_length = max_length
        self.max_error_rate = max_error_rate
        self.reward_model = reward_model
        self.rule_weight = float(rule_weight)
        self.model_weight = float(model_weight)
        self.rule_runs = reward_model is None or self.rule_weight != 0.0
        # The weight of each column of Rewards.components: the score is their weighted sum (up to rounding).
        weights = [self.rule_weight * weight for _, _, weight in self.fns] if self.rule_runs else []
        if reward_model is not None:
            weights.append(self.model_weight)
        if overlong_buffer is not None:
            weights.append(1.0)
        self.component_weights = tuple(weights)
        self.timeout_s = timeout_s
        self.timeout_is_error = timeout_is_error
        self.fn_errors_total = 0  # over the run, for the log line
        self.fn_timeouts_total = 0
        if num_workers < 1:
            raise ValueError(f"RewardLoop: num_workers={num_workers}; expected >= 1")
        self._workers: list[list[RuleWorker]] = [[] for _ in self.fns]  # child processes per function
        if timeout_s is not None:
            ids, lock = itertools.count(len(self.fns) * num_workers), threading.Lock()

            def next_id() -> int:  # a replacement's id, new across the loop's workers
                with lock:
                    return next(ids)

            for k, (_, fn, _) in enumerate(self.fns):
                try:
                    self._workers[k] = [RuleWorker(fn, start_timeout_s, batch=batch, worker_id=k * num_workers + j,
                                                   next_id=next_id) for j in range(num_workers)]
                except Exception as err:  # cloudpickle refuses some objects (locks, generators)
                    raise ReproRLError(
                        f"reward.fn {_fn_name(fn)!r} cannot be sent to a rule-reward "
                        f"process ({type(err).__name__}: {err}); set reward.timeout_s=null to call it in the "
                        "trainer's process, without a time limit"
                    ) from err

    def close(self) -> None:
        """Stop the rule-reward processes, if any run."""
        for workers in self._workers:
            for worker in workers:
                worker.close()

    def _rule_scores(self, batch: Batch, solutions: Sequence[str]
                     ) -> tuple[torch.Tensor, torch.Tensor, int, int, dict[str, float], list[str | None] | None]:
        """([B] float32 rule scores, [B, K] float32 each function's, samples on which a function
        raised, samples on which one timed out, {"reward/<name>/mean": ...} of several functions,
        the answers of the first function that reports any), in sample order. The rule scores are
        the one function's, or the weighted sum of several."""
        calls = self._rule_calls(batch, solutions)
        data_sources = batch.non_tensors["data_source"]
        per_fn, errors, timeouts, fn_means, answers = [], 0, 0, {}, None
        for k, (name, _, _) in enumerate(self.fns):
            scores, preds, fn_errors, fn_timeouts = self._fn_scores(k, calls, data_sources)
            per_fn.append(scores)
            if answers is None and any(pred is not None for pred in preds):
                answers = preds
            errors, timeouts = errors + fn_errors, timeouts + fn_timeouts
            if self.named:
                fn_means[f"reward/{name}/mean"] = math.fsum(scores) / len(scores) if scores else 0.0
        self.fn_errors_total += errors
        self.fn_timeouts_total += timeouts
        rule = weighted_sum(per_fn, [w for _, _, w in self.fns]) if self.named else per_fn[0]
        each = torch.tensor(per_fn, dtype=torch.float32).T.contiguous()  # [K, B] -> [B, K]
        return torch.tensor(rule, dtype=torch.float32), each, errors, timeouts, fn_means, answers

    def _rule_calls(self, batch: Batch, solutions: Sequence[str]) -> list[dict[str, Any]]:
        """The keyword arguments of each sample's call, in sample order; with `batch`, ONE
        call whose arguments are the lists (verl's batch names: data_sources, ...)."""
        for key in ("data_source", "ground_truth"):
            if key not in batch.non_tensors:
                raise DataError(f"reward batch has no non-tensor column {key!r}; columns: {batch.keys()}")
        data_sources = batch.non_tensors["data_source"]
        ground_truths = batch.non_tensors["ground_truth"]
        extra_infos = batch.non_tensors.get("extra_info")
        if self.batch:
            return [{"data_sources": list(data_sources), "solution_strs": list(solutions),
                     "ground_truths": list(ground_truths),
                     "extra_infos": [None] * len(solutions) if extra_infos is None else list(extra_infos)}]
        return [
            {"data_source": data_sources[i], "solution_str": solution, "ground_truth": ground_truths[i],
             "extra_info": None if extra_infos is None else extra_infos[i]}
            for i, solution in enumerate(solutions)
        ]

    def _fn_scores(self, k: int, calls: Sequence[dict[str, Any]], data_sources: Sequence[str]
                   ) -> tuple[list[float], list[str | None], int, int]:
        """(function k's scores, the answers it reported, samples on which it raised,
        samples on which it timed out), in sample order; a failed call has no answer."""
        if not self._workers[k]:
            outcomes = [self._call_here(self.fns[k].fn, call) for call in calls]
        else:
            outcomes = self._run_in_workers(self._workers[k], calls)
        if self.batch:  # the one call's outcome is every sample's
            (outcome,) = outcomes
            if outcome.kind == "ok":
                return list(outcome.score), list(outcome.pred), 0, 0
            outcomes = [Outcome(outcome.kind, error=outcome.error)] * len(data_sources)
        label = "reward function" + (f" {self.fns[k].name!r}" if self.named else "")
        scores, preds, errors, timeouts = [], [], 0, 0
        for i, outcome in enumerate(outcomes):
            if outcome.kind == "timeout":
                if self.timeout_is_error:
                    raise RewardTimeoutError(
                        f"the {label} did not return within reward.timeout_s={self.timeout_s:g} s on "
                        f"sample {i} (data_source={data_sources[i]!r}); with full_determinism a timed-out sample "
                        "cannot score 0 (the result would depend on timing): fix the function or raise the limit"
                    )
                timeouts += 1
                if self.fn_timeouts_total + timeouts == 1:
                    logger.warning(
                        "%s did not return within reward.timeout_s=%g s on sample %d (data_source=%r); "
                        "it scores 0.0. Later timeouts are only counted (metric reward/fn_timeouts).",
                        label, self.timeout_s, i, data_sources[i])
            elif outcome.kind == "error":
                errors += 1
                if self.fn_errors_total + errors == 1:
                    logger.error(
                        "%s raised on sample %d (data_source=%r); it scores 0.0. "
                        "Later errors are only counted (metric reward/fn_errors).\n%s", label, i, data_sources[i],
                        outcome.error)
            scores.append(outcome.score)
            preds.append(outcome.pred)
        self._check_failures(self.fns[k].fn, outcomes, data_sources)
        return scores, preds, errors, timeouts

    def _run_in_workers(self, workers: Sequence[RuleWorker], calls: Sequence[dict[str, Any]]) -> list[Outcome]:
        """The outcomes of `calls` in sample order, contiguous runs of them scored side by side,
        one run a worker; with `timeout_is_error` they end at the first timeout, as one worker's do."""
        size = -(-len(calls) // len(workers))  # ceil: the first workers take one more
        chunks = [calls[i : i + size] for i in range(0, len(calls), size)]
        results: list[list[Outcome]] = [[] for _ in chunks]
        errors: list[BaseException] = []

        def score(j: int) -> None:
            try:
                results[j] = workers[j].run(chunks[j], self.timeout_s, stop_at_timeout=self.timeout_is_error)
            except BaseException as err:  # noqa: BLE001 - a worker that cannot start: raised below
                errors.append(err)

        threads = [threading.Thread(target=score, args=(j,)) for j in range(1, len(chunks))]
        for thread in threads:
            thread.start()
        if chunks:
            score(0)  # the first run in this thread
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        outcomes = []
        for chunk, result in zip(chunks, results):
            outcomes += result
            if len(result) < len(chunk):  # stopped at a timeout: nothing after it counts
                break
        return outcomes

    def _check_failures(self, fn: Callable[..., Any], outcomes: Sequence[Outcome], data_sources: Sequence[str]) -> None:
        """Raise `RewardFnError` if more than `max_error_rate` of `outcomes` failed."""
        failed = [i for i, outcome in enumerate(outcomes) if outcome.kind != "ok"]
        if self.max_error_rate is None or len(failed) <= self.max_error_rate * len(outcomes):
            return
        first = outcomes[failed[0]]
        if first.kind == "timeout":
            why = f"timed out (reward.timeout_s={self.timeout_s:g} s)"
        else:
            why = _exception(first.error)
        name = _fn_name(fn)
        raise RewardFnError(
            f"the reward function {name!r} failed on {len(failed)} of {len(outcomes)} samples, more than "
            f"reward.max_error_rate={self.max_error_rate:g}; the first, sample {failed[0]} (data_source="
            f"{data_sources[failed[0]]!r}): {why}"
        )

    def _call_here(self, fn: Callable[..., Any], call: dict[str, Any]) -> Outcome:
        try:
            score, pred = (call_batch_fn if self.batch else call_rule_fn)(fn, call)
            return Outcome("ok", score=score, pred=pred)
        except Exception:  # any failure of user code: 0 for this sample, the run goes on
            return Outcome("error", error=traceback.format_exc())

    def compute(self, batch: Batch, tokenizer: Any) -> Rewards:
        """The batch's `Rewards` (scores, rule scores, metrics), in sample order.

        `tokenizer` is the policy's (it decodes the responses); the reward model tokenizes
        the text with its own. Metrics: `reward/rule_mean`, `reward/fn_timeouts` (when
        rules run), `reward/<name>/mean` (each of several functions), `reward/model_mean`
        (with a reward model), `reward/overlong_penalty_mean` (with the overlong buffer),
        `reward/fn_errors`, `reward/mean`.
        """
        for key in ("responses", "response_mask"):
            if key not in batch.tensors:
                raise DataError(f"reward batch has no tensor {key!r}; tensors: {list(batch.tensors)}")
        solutions = decode_responses(batch["responses"], batch["response_mask"], tokenizer)
        B = len(solutions)
        total = torch.zeros(B, dtype=torch.float32)
        metrics: dict[str, float] = {"reward/fn_errors": 0.0}
        rule, answers, components = None, None, []  # components: [B, k] parts of Rewards.components
        if self.rule_runs:
            rule, per_fn, errors, timeouts, fn_means, answers = self._rule_scores(batch, solutions)
            components.append(per_fn)
            total = total + self.rule_weight * rule
            metrics["reward/rule_mean"] = _mean(rule)
            metrics["reward/fn_errors"] = float(errors)
            metrics["reward/fn_timeouts"] = float(timeouts)
            metrics.update(fn_means)
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
            components.append(model.float().unsqueeze(-1))
            metrics["reward/model_mean"] = _mean(model)
        if self.overlong_buffer is not None:
            penalty = overlong_penalty(response_lengths(batch), self.max_length, self.overlong_buffer,
                                       self.overlong_penalty_factor)  # [B]
            total = total + penalty
            components.append(penalty.unsqueeze(-1))
            metrics["reward/overlong_penalty_mean"] = _mean(penalty)
        metrics["reward/mean"] = _mean(total)
        return Rewards(total, rule, metrics, answers, torch.cat(components, dim=-1))


def _fn_name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__name__", repr(fn))


def _exception(error: str) -> str:
    """The exception of a traceback as one line: its lines after the last indented one
    (the frames), joined; a text that is no traceback, whole."""
    lines = error.strip().splitlines()
    last_frame = max((i for i, line in enumerate(lines) if line.startswith(" ")), default=-1)
    return " ".join(line.strip() for line in lines[last_frame + 1 :])


def _mean(x: torch.Tensor) -> float:
    """Mean of a [B] tensor, exact and independent of summation order (fsum)."""
    return math.fsum(x.tolist()) / len(x) if len(x) else 0.0
