"""DAPO's dynamic sampling (verl's `algorithm.filter_groups`): a step trains only on groups
whose samples differ, generating more prompts until it has `data.train_batch_size` of them.

A group is the rollout.n samples of one prompt. When its metric is the same on every
sample, its advantages are all 0 (GRPO, RLOO) and it only dilutes the batch's gradient
(DAPO, Yu et al. 2025, section 3.2): it is dropped. A step goes through generation
batches of `data.train_batch_size` prompts each, rolled out and scored:

    generation batch 0: the sampler's batch for the step (what a step without filtering trains on)
    generation batch k: the sampler's next batch; each prompt's uid is `train-<index>.g<k>`
    ... until `num_groups` groups are kept: the first `num_groups` of them, in generation
    order, are the step's batch; kept groups beyond that are left out, their prompts used (verl's trim)

Identity, so a step is a pure function of its start: generation batch k of step s holds
the prompts the sampler serves k batches after the step's own, and their seeds are
`request_seed(run_seed, s, uid, repeat_index)` with k in the uid (a prompt that comes
again within one step, from the next epoch's order, gets other seeds). The sampler's
position after the step counts every prompt the step drew, kept or not: the checkpoint
holds it, so a resume continues at the next prompt, and a run killed between generation
batches resumes from the step's start and generates the same batches again.
"""

from __future__ import annotations

import torch

from reprorl.errors import ReproRLError
from reprorl.protocol import Batch

METRICS = ("seq_reward", "score", "acc")

SUMMED_METRICS = frozenset({"timing/gen_s", "timing/reward_s", "rollout/num_generate_calls", "reward/fn_errors",
                            "reward/fn_timeouts"})
"""Metrics of a generation batch that add up over a step's batches; the others are means."""


class FilterGroupsError(ReproRLError):
    """A step found fewer groups that vary than it needs within `max_num_gen_batches`."""


def metric_values(metric: str, scores: torch.Tensor, rule: torch.Tensor | None) -> torch.Tensor:
    """`[B*n]` the value of `metric` per sample (see `FilterGroupsConfig.metric`).

    scores: `[B*n]` the reward trained on; rule: `[B*n]` the rule reward, None when no rule
    function ran (config/checks.py refuses `score` and `acc` then).
    """
    if metric == "seq_reward":
        return scores
    if rule is None:
        raise ValueError(f"filter_groups metric {metric!r} needs the rule reward, and no rule function ran")
    return rule if metric == "score" else (rule >= 1.0).float()


def varied_groups(values: torch.Tensor, n: int) -> torch.Tensor:
    """`[B]` bool: whether the `n` values of each group (rows `n*i .. n*i+n-1` of `values`
    `[B*n]`) are not all equal. Equality, not `std > 0`: the std of equal floats may round
    to a tiny positive number.

    >>> varied_groups(torch.tensor([1.0, 1.0, 0.0, 1.0, -1.0, -1.0]), 2).tolist()
    [False, True, False]
    """
    groups = values.view(-1, n)  # [B, n]
    return (groups != groups[:, :1]).any(-1)


def merge_metrics(per_batch: list[dict[str, float]]) -> dict[str, float]:
    """A step's metrics from those of its generation batches: times and counts
    (`SUMMED_METRICS`) summed, the others averaged; every generation batch has as many
    samples, so an average of their means is the mean over every sample generated."""
    return {key: sum(m[key] for m in per_batch) / (1 if key in SUMMED_METRICS else len(per_batch))
            for key in per_batch[0]}


class GroupFilter:
    """Collects the groups that vary from a step's generation batches, in order, until
    `num_groups` are kept; `add` one scored generation batch at a time.

    Args:
        metric: one of `METRICS`.
        n: samples per group (rollout.n).
        num_groups: the groups a step trains on (data.train_batch_size).
        max_gen_batches: the most generation batches a step may take; 0 = no limit.
    """

    def __init__(self, metric: str, n: int, num_groups: int, max_gen_batches: int) -> None:
        if metric not in METRICS:
            raise ValueError(f"filter_groups metric {metric!r}: expected one of {', '.join(METRICS)}")
        self.metric, self.n, self.num_groups, self.max_gen_batches = metric, n, num_groups, max_gen_batches
        self.num_gen_batches = 0
        self.groups_kept = self.groups_dropped = 0
        self._kept: list[tuple[Batch, torch.Tensor, torch.Tensor | None]] = []
        self._metrics: list[dict[str, float]] = []

    def add(self, batch: Batch, scores: torch.Tensor, rule: torch.Tensor | None,
            reward_baselines: torch.Tensor | None, metrics: dict[str, float]) -> bool:
        """Keep the groups of one generation batch that vary; True once the step's batch is full.

        batch: `[B*n]` sampled rows, groups interleaved (a a b b); scores, rule,
        reward_baselines: `[B*n]` (rule and ReMax's baselines may be None); metrics: the
        generation batch's. Raises `FilterGroupsError` when the batch is still short after
        `max_gen_batches` generation batches.
        """
        self.num_gen_batches += 1
        self._metrics.append(metrics)
        keep = varied_groups(metric_values(self.metric, scores, rule), self.n)  # [B]
        self.groups_kept += int(keep.sum())
        self.groups_dropped += int((~keep).sum())
        rows = keep.repeat_interleave(self.n)  # [B*n]
        if rows.any():
            self._kept.append((batch.index(rows), scores[rows],
                               None if reward_baselines is None else reward_baselines[rows]))
        if self.groups_kept >= self.num_groups:
            return True
        if self.max_gen_batches and self.num_gen_batches >= self.max_gen_batches:
            raise FilterGroupsError(
                f"algorithm.filter_groups.max_num_gen_batches={self.max_gen_batches}: after {self.num_gen_batches} "
                f"generation batches, {self.groups_kept} of the data.train_batch_size={self.num_groups} groups the "
                f"step needs vary in {self.metric} (in the other {self.groups_dropped}, all {self.n} "
                "samples had the same); is the data too hard or too easy for the policy? Raise the limit, or 0 for none"
            )
        return False

    def result(self) -> tuple[Batch, torch.Tensor, torch.Tensor | None, dict[str, float]]:
        """The step's batch (`[num_groups*n]` rows: the first groups kept, in generation order),
        its scores and ReMax baselines `[num_groups*n]`, and the step's generation metrics:
        the batches' own (`merge_metrics`) and `train/num_gen_batches`, `train/groups_kept`
        (that vary, in every generation batch, those past the step's batch too) and
        `train/groups_dropped` (that do not)."""
        if self.groups_kept < self.num_groups:
            raise RuntimeError(f"GroupFilter.result: {self.groups_kept} groups kept of {self.num_groups}; add more")
        rows = self.num_groups * self.n
        batch = Batch.concat([b for b, _, _ in self._kept]).slice(0, rows)
        scores = torch.cat([s for _, s, _ in self._kept])[:rows]
        baselines = None if self._kept[0][2] is None else torch.cat([r for _, _, r in self._kept])[:rows]
        metrics = merge_metrics(self._metrics)
        metrics.update({"train/num_gen_batches": float(self.num_gen_batches),
                        "train/groups_kept": float(self.groups_kept),
                        "train/groups_dropped": float(self.groups_dropped)})
        return batch, scores, baselines, metrics
