"""Validation metrics per data source, over the n samples of each prompt (`rollout.val.n`).

For each data source s, over its prompts, each with its n samples' final rewards:
- `val/<s>/mean@n`: the mean reward of all its samples;
- `val/<s>/best@n`: the mean over prompts of the best of their n rewards (pass@n when a
  reward of 1 means correct);
- `val/<s>/accuracy`: the share of its samples whose rule reward is full credit (>= 1).
With n = 1 only mean@1 (and accuracy) are written: best is the mean then. (verl's
maj@n needs each sample's answer, which no reward function reports yet.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def per_source_metrics(sources: Sequence[str], uids: Sequence[str], scores: torch.Tensor, n: int,
                       correct: torch.Tensor | None = None) -> dict[str, float]:
    """The metrics of the module doc; row i is a sample of prompt `uids[i]` from `sources[i]`
    with reward `scores[i]` (and full credit `correct[i]`)."""
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
    return metrics

