"""A step's training batch, and a validation: prompts -> one rollout call -> rewards.

`Generator.generate(step)` draws the step's prompts from the sampler, repeats each n
times (interleaved; ReMax: + one greedy row per prompt in the same call), rolls them out
and scores them; with `algorithm.filter_groups` it goes on through generation batches
until enough groups vary (dynamic_sampling.py). What it returns, a `ScoredBatch`, is a
pure function of the weights the replicas serve, the sampler's position and the step
(every request's seed comes from the step and the sample's identity), so it may be made
before the step trains (async_rollouts.py) and saved in a checkpoint.

`Generator.validate(step)` rolls out the whole validation set with the validation
sampling params.
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

import torch

from reprorl import algos
from reprorl.agent_loop.manager import AgentLoopManager
from reprorl.config import Config
from reprorl.data.dataset import PromptDataset, PromptSampler
from reprorl.errors import ConfigError
from reprorl.protocol import Batch
from reprorl.reward.loop import RewardLoop
from reprorl.trainer.dynamic_sampling import GroupFilter
from reprorl.trainer.val_metrics import per_source_metrics

REWARD_COMPONENTS = "reward_components"
"""The batch column of each sample's reward terms `[B*n, K]` (`Rewards.components`), with an
estimator that reads them (gdpo); the fit loop takes it out before the workers see the batch."""

TEST_KILL_IN_FILL_ENV = "REPRORL_TEST_KILL_IN_FILL"
"""A test hook like fit.py's `TEST_KILL_AT_STEP_ENV`: with it set to "S:K" and
`algorithm.filter_groups` on, the trainer SIGKILLs its own process when step S, its batch
not yet full, is about to draw generation batch K (K >= 1), so a test kills a run in the
middle of filling a batch (tests/trainer/test_dynamic_sampling.py)."""


def _test_kill_in_fill() -> tuple[int, int] | None:
    """The (step, generation batch) `TEST_KILL_IN_FILL_ENV` names, or None when it is unset."""
    value = os.environ.get(TEST_KILL_IN_FILL_ENV)
    if value is None:
        return None
    step, _, batch = value.partition(":")
    if not (step.isdigit() and batch.isdigit() and int(batch) >= 1):
        raise ConfigError(f"{TEST_KILL_IN_FILL_ENV}={value!r}: expected STEP:K, K >= 1 (a test hook; unset it)")
    return int(step), int(batch)


@dataclass
class ScoredBatch:
    """A step's training batch, rolled out and scored."""

    step: int
    batch: Batch
    """`[B*n]` the sampled rows (ReMax's greedy rows split off)."""
    scores: torch.Tensor
    """`[B*n]` the reward trained on."""
    reward_baselines: torch.Tensor | None
    """`[B*n]` ReMax's greedy reward of each sample's prompt, or None."""
    metrics: dict[str, float]
    """The generation's and the reward's metrics (timing/gen_s, reward/..., rollout/...)."""


@dataclass
class Validation:
    """A validation's metrics, and its first batch (output, scores) for generations.jsonl."""

    metrics: dict[str, float]
    first: tuple[Batch, torch.Tensor] | None


class Generator:
    """Rolls out and scores the training batches (from `sampler`, in order) and validations.

    Args:
        cfg: the run's config (data, rollout, algorithm).
        agent, reward_loop: the run's agent-loop manager and reward loop (parts.py).
        tokenizer: the policy's.
        train_set, val_set: the datasets (`val_set` None: no validation).
        sampler: the training prompts' order; `generate` draws from it, nothing else should.
    """

    def __init__(self, cfg: Config, agent: AgentLoopManager, reward_loop: RewardLoop, tokenizer: Any,
                 train_set: PromptDataset, val_set: PromptDataset | None, sampler: PromptSampler) -> None:
        self.cfg, self.agent, self.reward_loop, self.tokenizer = cfg, agent, reward_loop, tokenizer
        self.train_set, self.val_set, self.sampler = train_set, val_set, sampler

    # ------------------------------------------------------------------ training batches

    def generate(self, step: int) -> ScoredBatch:
        """Step `step`'s batch: the sampler's next prompts (with `algorithm.filter_groups`, as
        many of its next batches as it takes to fill the batch), rolled out and scored."""
        metrics: dict[str, float] = {}
        positions = next(self.sampler)
        if self.cfg.algorithm.filter_groups.enable:
            batch, scores, reward_baselines = self._filled_batch(step, positions, metrics)
        else:
            batch, scores, _, reward_baselines = self._generation_batch(step, positions, metrics)
        return ScoredBatch(step, batch, scores, reward_baselines, metrics)

    def _prompt_batch(self, dataset: PromptDataset, positions: list[int], *, step: int, validate: bool,
                      gen_batch: int = 0) -> Batch:
        """One row per prompt, with its identity (`uid`; `.g<k>` in generation batch k >= 1
        of dynamic sampling) and what the reward needs."""
        rows = [dataset[i] for i in positions]
        prefix = "val" if validate else "train"
        suffix = f".g{gen_batch}" if gen_batch else ""
        return Batch(
            non_tensors={
                "uid": [f"{prefix}-{row.index}{suffix}" for row in rows],
                "prompt_ids": [list(row.prompt_ids) for row in rows],
                "raw_prompt": [row.messages for row in rows],
                "data_source": [row.data_source for row in rows],
                "ground_truth": [row.ground_truth for row in rows],
                "extra_info": [row.extra_info for row in rows],
            },
            meta={"step": step, "validate": validate},
        )

    @staticmethod
    def _repeat(prompts: Batch, n: int) -> Batch:
        """n copies of each prompt, interleaved (a a b b), each with its `repeat_index`."""
        repeated = prompts.repeat(n, interleave=True)
        repeated["repeat_index"] = [j for _ in range(len(prompts)) for j in range(n)]
        return repeated

    def _rollout_batch(self, prompts: Batch) -> tuple[Batch, list[bool]]:
        """The rows of the step's ONE rollout call, and whether each is sampled.

        ReMax appends one greedy row per prompt (do_sample False); the agent loop gives
        those rows greedy params, and they are split off after the call.
        """
        n = self.cfg.rollout.n
        sampled = self._repeat(prompts, n)
        if not algos.estimator(self.cfg.algorithm.adv_estimator).greedy_baseline:
            return sampled, [True] * len(sampled)
        baseline = prompts.slice(0, len(prompts))
        baseline["repeat_index"] = [n] * len(prompts)  # an identity apart from the n samples
        return Batch.concat([sampled, baseline]), [True] * len(sampled) + [False] * len(baseline)

    def _generation_batch(self, step: int, positions: list[int], metrics: dict[str, float], gen_batch: int = 0
                          ) -> tuple[Batch, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The prompts at `positions` rolled out and scored: (sampled rows, scores `[B*n]`,
        rule scores `[B*n]` or None, ReMax's baseline rewards `[B*n]` or None)."""
        batch, baseline = self._generate(step, positions, metrics, gen_batch)
        scores, rule, reward_baselines = self._score(batch, baseline, metrics)
        return batch, scores, rule, reward_baselines

    def _filled_batch(self, step: int, positions: list[int], metrics: dict[str, float]
                      ) -> tuple[Batch, torch.Tensor, torch.Tensor | None]:
        """DAPO's dynamic sampling: generation batches, the first at `positions`, the next
        from the sampler, until `data.train_batch_size` groups vary (dynamic_sampling.py);
        returns the step's (batch, scores, ReMax baselines) as `_generation_batch` does."""
        groups_cfg = self.cfg.algorithm.filter_groups
        groups = GroupFilter(groups_cfg.metric, self.cfg.rollout.n, self.cfg.data.train_batch_size,
                             groups_cfg.max_num_gen_batches)
        kill_at = _test_kill_in_fill()
        for k in itertools.count():
            if k > 0:
                if kill_at == (step, k):
                    os.kill(os.getpid(), signal.SIGKILL)  # TEST_KILL_IN_FILL_ENV: between generation batches
                positions = next(self.sampler)
            batch_metrics: dict[str, float] = {}
            if groups.add(*self._generation_batch(step, positions, batch_metrics, gen_batch=k), batch_metrics):
                break
        batch, scores, reward_baselines, fill_metrics = groups.result()
        metrics.update(fill_metrics)
        return batch, scores, reward_baselines

    def _generate(self, step: int, positions: list[int], metrics: dict[str, float], gen_batch: int = 0
                  ) -> tuple[Batch, Batch | None]:
        """One rollout call (the step's one, without dynamic sampling): (the sampled rows,
        ReMax's greedy rows or None)."""
        t0 = time.perf_counter()
        prompts = self._prompt_batch(self.train_set, positions, step=step, validate=False, gen_batch=gen_batch)
        calls_before = self.agent.num_generate_sequences_calls
        rollout, do_sample = self._rollout_batch(prompts)
        num_sampled = sum(do_sample)
        output = self.agent.generate_sequences(rollout, do_sample)
        metrics["rollout/num_generate_calls"] = self.agent.num_generate_sequences_calls - calls_before
        metrics["rollout/turns_mean"] = float(sum(output.non_tensors["num_turns"]) / len(output))  # > 1: tool turns ran
        batch = output.slice(0, num_sampled)
        baseline = output.slice(num_sampled, len(output)) if num_sampled < len(output) else None
        metrics["timing/gen_s"] = time.perf_counter() - t0
        return batch, baseline

    def _score(
        self, batch: Batch, baseline: Batch | None, metrics: dict[str, float]
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(scores `[B*n]`, rule scores `[B*n]` or None, ReMax's baseline reward of each
        sample's prompt `[B*n]` or None)."""
        t0 = time.perf_counter()
        rewards = self.reward_loop.compute(batch, self.tokenizer)  # [B*n]
        scores, rule = rewards.scores, rewards.rule
        metrics.update(rewards.metrics)
        if algos.estimator(self.cfg.algorithm.adv_estimator).reward_components:
            # A column, so dynamic sampling and a checkpoint's batches in flight keep it with its rows;
            # only for the estimator that reads it, so other runs' batches stay as they were.
            batch[REWARD_COMPONENTS] = rewards.components  # [B*n, K]
        reward_baselines = None
        if baseline is not None:
            # ReMax's baseline is the greedy response's reward only, without the KL penalty
            # (as in the paper and verl): the KL term belongs to the sampled trajectory.
            baseline_scores = self.reward_loop.compute(baseline, self.tokenizer).scores  # [B]
            metrics["reward/baseline_mean"] = baseline_scores.mean().item()
            reward_baselines = baseline_scores.repeat_interleave(self.cfg.rollout.n)  # [B*n]: row i is prompt i // n
        metrics["timing/reward_s"] = time.perf_counter() - t0
        return scores, rule, reward_baselines

    # ------------------------------------------------------------------ validation

    def validate(self, step: int) -> Validation:
        """Roll out the whole validation set with the validation sampling params.

        `val/accuracy` is the share of samples whose rule reward is full credit (>= 1.0),
        absent when the rule function does not run (a reward model alone, rule_weight 0);
        `val/reward_mean` is the mean of the final reward (rule and model, weighted); and
        per data source, over the `rollout.val.n` samples of each prompt, `val_metrics`'s.
        """
        cfg = self.cfg
        if self.val_set is None:  # data.val_files=[]
            return Validation({}, None)
        positions = list(range(len(self.val_set)))
        size = cfg.data.val_batch_size or len(positions)
        scores, correct, lengths, sources, uids, answers = [], [], [], [], [], []
        first = None
        t0 = time.perf_counter()
        for start in range(0, len(positions), size):
            prompts = self._prompt_batch(self.val_set, positions[start : start + size], step=step, validate=True)
            output = self.agent.generate_sequences(self._repeat(prompts, cfg.rollout.val.n))
            rewards = self.reward_loop.compute(output, self.tokenizer)
            scores.append(rewards.scores)
            if rewards.rule is not None:
                correct.append((rewards.rule >= 1.0).float())
            answers += rewards.answers or [None] * len(rewards.scores)
            lengths.append(output["response_mask"].float().sum(-1))
            sources += list(output.non_tensors["data_source"])
            uids += list(output.non_tensors["uid"])
            if start == 0:
                first = (output, rewards.scores)
        all_scores = torch.cat(scores)
        metrics = {
            "val/reward_mean": all_scores.mean().item(),
            "val/response_length_mean": torch.cat(lengths).mean().item(),
            "timing/val_s": time.perf_counter() - t0,
        }
        if correct:
            metrics["val/accuracy"] = torch.cat(correct).mean().item()
        metrics.update(per_source_metrics(sources, uids, all_scores, cfg.rollout.val.n,
                                          correct=torch.cat(correct) if correct else None,
                                          answers=answers if any(a is not None for a in answers) else None))
        return Validation(metrics, first)
