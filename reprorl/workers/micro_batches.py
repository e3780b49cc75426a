"""How a batch is cut into micro-batches: by sample count, or by a token budget.

`micro_batch_rows(batch, micro_batch_size, max_token_len)` lists each micro-batch's rows:
- `max_token_len=None` (the default): consecutive runs of `micro_batch_size` samples in
  sample order (`range`s, taken as views, exactly `Batch.split`), as always.
- `max_token_len=T` (`actor.ppo_max_token_len_per_micro_batch`, the critic's likewise): by
  padded tokens. The samples are ordered by length (the columns `trim_padding` would keep
  for them alone: prompt + response, padding inside them included), ties by sample index,
  and cut greedily in that order: a micro-batch takes the next sample while its padded
  size stays <= T. Its padded size is what it costs once `trim_padding` has cut it:
  rows x (longest prompt + longest response among its rows), so similar lengths share a
  micro-batch, little padding is computed, and no forward sees more than T tokens (the
  memory bound of the logits, `[rows, width, vocab]`). `micro_batch_size` is then unused.
  Each micro-batch lists its rows in sample order; micro-batch indices (in metrics' order
  of summation, in `NonFiniteError`'s "micro-batch k") count in length order.

A sample that alone is wider than T is an error (naming it), not a micro-batch of its
own: T is then no bound. The config requires T >= data.max_prompt_length +
data.max_response_length, so the trainer never meets one.

The cut is a pure function of the batch's attention mask and the setting, never of the
number of workers, so the bits of the passes that use it depend on the setting (as they
do on `micro_batch_size`) and not on N. A log-prob pass cuts the whole batch and each rank
takes a contiguous block of its micro-batches (`flat.rank_block`); its outputs come back
in sample order (`in_sample_order`). An update cuts each mini-batch; how its micro-batch
count, whatever it is, fits any power-of-two number of workers without changing the
gradient's bits: `flat.tree_leaves`. Loss normalisers are the mini-batch's
(`policy.mini_batch_norms`), so reordering the samples changes only the order of sums.
With batch-invariant kernels (full determinism) a sample's log-probs and values are the
bits it gets in any other cut; with stock torch kernels they differ in the last bits
(up to 4.8e-7 on the tiny test model, float32 CPU).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from reprorl.protocol import Batch

Rows = range | list[int]
"""One micro-batch's rows of its batch: a `range` (consecutive, taken as views) or a list."""


def row_spans(batch: Batch) -> tuple[list[int], list[int]]:
    """Per row, the prompt columns and response columns `trim_padding` keeps for it alone
    (0 where it has none): from its first real prompt column to the prompt's end, and from
    the response's start to its last real response column. `[B]`, `[B]`."""
    response_len = batch["responses"].shape[1]
    mask = batch["attention_mask"].bool().cpu()  # [B, P+R]
    prompt, response = mask[:, :-response_len], mask[:, -response_len:]
    prompt_len = prompt.shape[1]
    cols = torch.arange(prompt_len + response_len)
    # First real prompt column (prompt_len where none) and last real response column + 1 (0 where none).
    first = torch.where(prompt, cols[:prompt_len], prompt_len).min(dim=1).values
    last = torch.where(response, cols[:response_len] + 1, 0).max(dim=1).values
    return (prompt_len - first).tolist(), last.tolist()


def trimmed_width(prompt_span: int, response_span: int) -> int:
    """Columns of a micro-batch after `trim_padding`, from its longest prompt and response
    spans: it always keeps one prompt and one response column."""
    return max(prompt_span, 1) + max(response_span, 1)


def token_budget_micro_batches(batch: Batch, max_token_len: int) -> list[list[int]]:
    """The rows of each micro-batch, cut by padded tokens (module doc): length order,
    greedy, each micro-batch's rows x trimmed width <= `max_token_len`."""
    prompt, response = row_spans(batch)
    order = sorted(range(len(batch)), key=lambda i: (prompt[i] + response[i], i))
    micros: list[list[int]] = []
    rows: list[int] = []
    longest_prompt = longest_response = 0
    for i in order:
        alone = trimmed_width(prompt[i], response[i])
        if alone > max_token_len:
            raise ValueError(
                f"max_token_len={max_token_len}: sample {i} alone is {alone} tokens wide ({prompt[i]} of prompt, "
                f"{response[i]} of response); a micro-batch's token budget must hold the longest sample"
            )
        p, r = max(longest_prompt, prompt[i]), max(longest_response, response[i])
        if rows and (len(rows) + 1) * trimmed_width(p, r) > max_token_len:
            micros.append(sorted(rows))
            rows, p, r = [], prompt[i], response[i]
        rows.append(i)
        longest_prompt, longest_response = p, r
    if rows:
        micros.append(sorted(rows))
    return micros


def micro_batch_rows(batch: Batch, micro_batch_size: int, max_token_len: int | None) -> list[Rows]:
    """The rows of each micro-batch of `batch`, in micro-batch order (module doc)."""
    if max_token_len is None:
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        n = len(batch)
        return [range(start, min(start + micro_batch_size, n)) for start in range(0, n, micro_batch_size)]
    if max_token_len < 1:
        raise ValueError(f"max_token_len must be >= 1 or None, got {max_token_len}")
    return token_budget_micro_batches(batch, max_token_len)


def take(batch: Batch, rows: Rows) -> Batch:
    """The micro-batch `rows` of `batch`: views for a `range` (as `Batch.split`), else copies."""
    if isinstance(rows, range):
        return batch.slice(rows.start, rows.stop)
    return batch.index(rows)


def rows_tensor(micros: Sequence[Rows]) -> torch.Tensor:
    """The rows of `micros`, one after the other: `[b]` int64."""
    return torch.tensor([i for rows in micros for i in rows], dtype=torch.long)


def in_sample_order(stacked: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Undo the micro-batch order: `stacked[k]` is the output of sample `rows[k]`, and
    `rows` is a permutation of 0 .. B-1; returns `[B, ...]` with row i sample i's (an
    exact copy)."""
    out = torch.empty_like(stacked)
    out[rows.to(stacked.device)] = stacked
    return out
