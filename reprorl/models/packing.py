"""Where the tokens of one `Transformer.forward_packed` call go: each token's cache slot and
position, and the groups of sequences that share a `batched_attention` call."""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

from reprorl.models.kv_cache import KVCache, cache_rows


class _Group:
    """Sequences of one `batched_attention` call: B rows of Tq queries each.

    Row b reads cache slot lo + b (a view of the store; rows of slots not in the group are
    computed with zero queries and dropped) or, with `index`, slot index[b] (a gather).
    `gather` [B, Tq] picks each row's queries from the pack (N = a zero query), `q_start`
    [B] is their first position, and `rows` [n] / `real` [n] map the n real outputs of the
    flattened [B * Tq] result back to the pack.
    """

    def __init__(self, members: list[tuple[int, int, int, int]], num_tokens: int, device: torch.device) -> None:
        # members: (first row in the pack, token count, slot, start position)
        slots = [m[2] for m in members]
        tq = max(m[1] for m in members)
        self.lo, self.hi = min(slots), max(slots) + 1
        if self.hi - self.lo <= 2 * len(slots):  # dense enough: a view of the slot range
            self.index, place = None, [slot - self.lo for slot in slots]
            size = self.hi - self.lo
        else:
            self.index, place, size = torch.tensor(slots, device=device), list(range(len(slots))), len(slots)
        # Built as Python lists and converted once: a torch op per sequence would cost more
        # than a decode step of a small model.
        gather = [[num_tokens] * tq for _ in range(size)]
        q_start = [0] * size
        rows, real = [], []
        for (first, n, _, start), b in zip(members, place):
            gather[b][:n] = range(first, first + n)
            q_start[b] = start
            rows.extend(range(first, first + n))
            real.extend(range(b * tq, b * tq + n))
        self.gather = torch.tensor(gather, device=device)
        self.q_start = torch.tensor(q_start, device=device)
        self.rows, self.real = torch.tensor(rows, device=device), torch.tensor(real, device=device)


class PackPlan:
    """Where the tokens of one `forward_packed` call go: each token's cache slot and position,
    and the attention groups (one-token sequences, i.e. decode steps; and longer chunks).

    `in_order`: every sequence brings one token and the slots are consecutive, in pack
    order (an engine decode step): attention then reads the slot range as a view and its
    output rows are already in pack order, so no group is built (`lo`, `hi`, `q_start`).
    """

    def __init__(self, seq_lens: list[int], slots: list[int], starts: list[int], device: torch.device) -> None:
        n = sum(seq_lens)
        self._kv_rows: Tensor | None = None
        self.in_order = 0 < n == len(slots) and slots == list(range(slots[0], slots[0] + n))
        if self.in_order:
            self.lo, self.hi = slots[0], slots[0] + n
            self.token_slots = torch.arange(self.lo, self.hi, device=device)
            self.positions = self.q_start = torch.tensor(starts, device=device)
            self.token_pos = self.positions
            self.groups = []
            return
        firsts = [0, *itertools.accumulate(seq_lens)][:-1]
        self.token_slots = torch.tensor([s for s, k in zip(slots, seq_lens) for _ in range(k)], dtype=torch.long,
                                        device=device)
        self.positions = torch.tensor([p for p0, k in zip(starts, seq_lens) for p in range(p0, p0 + k)],
                                      dtype=torch.long, device=device)
        self.token_pos = self.positions
        members = list(zip(firsts, seq_lens, slots, starts))
        decode = [m for m in members if m[1] == 1]
        longer = [m for m in members if m[1] > 1]
        self.groups = [_Group(g, n, device) for g in (decode, longer) if g]

    def kv_rows(self, cache: KVCache) -> Tensor:
        """`cache_rows` of the plan's tokens (made on the first layer's call, then reused)."""
        if self._kv_rows is None:
            self._kv_rows = cache_rows(cache, self.token_slots, self.token_pos)
        return self._kv_rows
