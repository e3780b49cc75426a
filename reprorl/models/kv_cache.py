"""The KV cache of the packed path (`Transformer.forward_packed`, `forward_decode`): keys and
values of every layer, a slot per sequence, in whole `KEY_BLOCK`s so attention reads a slot
as a view; and where a token's keys go in it (`cache_rows`)."""

from __future__ import annotations

import torch
from torch import Tensor

from reprorl.kernels import KEY_BLOCK
from reprorl.kernels.shared import write_rows
from reprorl.models.arch import ModelArgs, model_dtype


class KVCache:
    """Keys and values of `num_slots` sequences for every layer, one row ("slot") each.

    `keys[layer]`, `values[layer]`: [slots, kv_heads, cap, head_dim], where `cap` is
    `capacity` rounded up to whole `KEY_BLOCK`s (the chunks attention reads, so a
    decode step reads the store as a view, with no copy). `lengths[slot]` counts the
    tokens cached for a slot: `forward_packed` appends after it and advances it; set it
    back to rewind or to reuse the slot. Entries past a slot's length are stale but finite
    (zeros at first), and attention masks them out.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        num_slots: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.num_layers, self.dtype, self.device = num_layers, dtype, torch.device(device)
        self.lengths = [0] * num_slots
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []
        self.capacity = 0
        self._shape = (num_slots, num_kv_heads, head_dim)
        self.grow(capacity)

    @classmethod
    def for_model(
        cls,
        args: ModelArgs,
        capacity: int,
        num_slots: int = 1,
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
    ) -> KVCache:
        """A cache shaped for `args`, in the model's dtype unless given."""
        return cls(
            args.num_hidden_layers,
            args.num_key_value_heads,
            args.head_dim,
            capacity,
            num_slots,
            model_dtype(args, dtype),
            device,
        )

    @property
    def num_slots(self) -> int:
        return len(self.lengths)

    @property
    def nbytes(self) -> int:
        """Memory held by the keys and values of every layer."""
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def grow(self, capacity: int) -> None:
        """Make room for `capacity` tokens per slot, keeping what is cached (a copy)."""
        if capacity <= self.capacity:
            return
        cap = -(-capacity // KEY_BLOCK) * KEY_BLOCK
        s, h, d = self._shape
        old = self.keys[0].shape[2] if self.keys else 0
        if cap > old:
            new = [torch.zeros(s, h, cap, d, dtype=self.dtype, device=self.device) for _ in range(2 * self.num_layers)]
            for buf, prev in zip(new, self.keys + self.values):
                buf[:, :, :old] = prev
            self.keys, self.values = new[: self.num_layers], new[self.num_layers :]
        self.capacity = capacity


    def copy_prefixes(self, copies: list[tuple[int, list[int], int]]) -> None:
        """For each (src, dsts, length): copy the first `length` cached tokens of slot `src`
        into slots `dsts` and set their lengths (the engine's prefix sharing). All the copies
        of a step go in one gather and one row write per layer's keys and values
        (`write_rows`), not one per prompt: on the GPU a step's 32 shared prompts were 32x the
        launches."""
        if not copies:
            return
        _, hkv, cap, _ = self.keys[0].shape
        src_rows, dst_rows = [], []
        for src, dsts, length in copies:
            heads = (torch.arange(hkv)[:, None] * cap + torch.arange(length)).reshape(-1)  # rows of a slot
            src_rows.append((src * hkv * cap + heads).repeat(len(dsts)))
            dst_rows.append((torch.tensor(dsts)[:, None] * hkv * cap + heads).reshape(-1))
        src_rows = torch.cat(src_rows).to(self.device)
        dst_rows = torch.cat(dst_rows).to(self.device)
        for buf in self.keys + self.values:
            rows = buf.view(-1, buf.shape[-1])
            write_rows(rows, dst_rows, rows.index_select(0, src_rows))
        for _, dsts, length in copies:
            for d in dsts:
                self.lengths[d] = length


def cache_rows(cache: KVCache, slots: Tensor, positions: Tensor) -> Tensor:
    """Where token b's keys go for each KV head h, as rows of a layer's cache viewed as
    [S * Hkv * cap, D]: (slots[b] * Hkv + h) * cap + positions[b], in (b, h) order [B * Hkv]
    (the order of k [B, Hkv, D] flattened to rows). Every layer's cache has one shape."""
    _, hkv, cap, _ = cache.keys[0].shape
    heads = torch.arange(hkv, device=slots.device)
    return ((slots[:, None] * hkv + heads) * cap + positions[:, None]).reshape(-1)
