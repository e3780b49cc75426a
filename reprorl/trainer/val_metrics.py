"""Validation metrics per data source, over the n samples of each prompt (`rollout.val.n`).

For each data source s, over its prompts, each with its n samples' final rewards:
- `val/<s>/mean@n`: the mean reward of all its samples;
- `val/<s>/best@n`: the mean over prompts of the best of their n rewards (pass@n when a
  reward of 1 means correct);
- `val/<s>/maj@n`: the mean over prompts of the reward of their majority answer, when the
  rule reward reports each sample's answer (verl's "pred"; the built-in rewards do): the
  answer most of the n samples gave (no answer is a vote too, as in verl), a tie going to
  the answer given first, scored as the first sample that gave it;
- `val/<s>/accuracy`: the share of its samples whose rule reward is full credit (>= 1).
With n = 1 only mean@1 (and accuracy) are written: best and maj are the mean then.
verl estimates best@n and maj@n by bootstrap over subsets of the n samples; these are the
exact values over all n.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch


def per_source_metrics(sources: Sequence[str], uids: Sequence[str], scores: torch.Tensor, n: int,
                       correct: torch.Tensor | None = None,
                       answers: Sequence[str | None] | None = None) -> dict[str, float]:
    """The metrics of the module doc; row i is a sample of prompt `uids[i]` from `sources[i]`
    with reward `scores[i]` (and full credit `correct[i]`, final answer `answers[i]`)."""
    groups: dict[str, dict[str, list[int]]] = {}  # source -> uid -> rows, in first-seen order
    for i, (source, uid) in enumerate(zip(sources, uids, strict=True)):
        groups.setdefault(source, {}).setdefault(uid, []).append(i)
    scores = scores.double()
    metrics: dict[str, float] = {}
    for source in sorted(groups):
        prompts = list(groups[source].values())
        rows = [i for members in prompts for i in members]
        metrics[f"val/{source}/mean@{n}"] = scores[rows].mean().item()
        if correct is not None:
            metrics[f"val/{source}/accuracy"] = correct[rows].double().mean().item()
        if n == 1:
            continue
        metrics[f"val/{source}/best@{n}"] = sum(scores[m].max().item() for m in prompts) / len(prompts)
        if answers is not None:
            majority = [scores[majority_row(m, answers)].item() for m in prompts]
            metrics[f"val/{source}/maj@{n}"] = sum(majority) / len(prompts)
    return metrics


def majority_row(rows: Sequence[int], answers: Sequence[str | None]) -> int:
    """The first of `rows` whose answer is the most common among them (ties: the answer
    that came first)."""
    votes = Counter(answers[i] for i in rows)  # counts in first-seen order: most_common keeps it on ties
    winner = votes.most_common(1)[0][0]
    return next(i for i in rows if answers[i] == winner)
