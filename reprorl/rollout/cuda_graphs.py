"""The engine's decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step of a small model is hundreds of kernel launches of a few microseconds of
work each: launched one by one from Python, the host is the bottleneck. `DecodeGraphs`
captures the whole step (`CausalLM.forward_decode`, then the LM head) once per bucket of
batch sizes (1, 2, 4, 8, 16, 32, then multiples of 32 up to the engine's `max_num_seqs`)
and replays it. Inputs go through static device buffers (token ids, slots, positions):
a step of B sequences copies them into the first rows of the smallest bucket >= B, in one
host-to-device copy, and fills the other rows with a padding token at position 0 of the
cache's spare slot (the `KVCache`'s last slot, never given to a sequence), whose writes
are harmless. Graphs share one memory pool (their intermediates are dead between
replays) and are captured on first use.

Batch invariance: with the invariant kernels a row's bits do not depend on the rows
around it, padding rows included, so a graph replay gives the bits of the eager
`forward_packed` step (tested on the GPU). Attention must read nothing on the host
while captured: the engine passes the Triton attention kernel (its loop bound is read on
the device) in both modes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from reprorl.models.kv_cache import KVCache


def batch_buckets(max_batch: int) -> list[int]:
    """Bucket sizes up to max_batch: powers of two to 32, then every 32, and max_batch itself."""
    sizes = [b for b in (1, 2, 4, 8, 16) if b < max_batch] + list(range(32, max_batch, 32)) + [max_batch]
    return sorted(set(sizes))


class DecodeGraphs:
    """Captured decode steps of `model` over `cache` (see the module doc)."""

    def __init__(self, model: torch.nn.Module, cache: KVCache, attention, max_batch: int):
        self.model, self.cache, self.attention = model, cache, attention
        self.buckets = batch_buckets(max_batch)
        self.max_batch = max_batch
        self.pad_slot = cache.num_slots - 1
        # Row b: (token id, slot, position); a bucket's rows are one contiguous block, one copy.
        self.inputs = torch.zeros(max_batch, 3, dtype=torch.long, device=cache.device)
        # Two pinned blocks, used in turn: with the engine's lookahead a step's block is filled
        # while the copy of the step before may still wait in the stream.
        self._hosts = [torch.zeros(max_batch, 3, dtype=torch.long).pin_memory() for _ in range(2)]
        self._turn = 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, Tensor] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def _step(self, b: int) -> Tensor:
        ids, slots, positions = self.inputs[:b].unbind(1)
        hidden = self.model.forward_decode(ids, slots, positions, self.cache, self.attention)
        return self.model.logits(hidden)  # [b, V]

    def capture(self, b: int) -> None:
        """Capture the graph of bucket b (`run` does it on first use)."""
        self.inputs[:b].copy_(self._fill([], [], [], b)[:b])
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(2):  # compiles Triton kernels and lets cuBLAS pick, outside the capture
                self._step(b)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self.pool):
            self.outputs[b] = self._step(b)
        self.graphs[b] = graph

    def _fill(self, ids: list[int] | None, slots: list[int], positions: list[int], b: int) -> Tensor:
        """The next pinned block with the step's rows (ids None: zeros, the device fills them)."""
        block = self._hosts[self._turn]
        self._turn ^= 1
        host = block.numpy()  # numpy's view: a list goes in without a tensor per row
        n = len(slots)
        host[:n, 0], host[:n, 1], host[:n, 2] = 0 if ids is None else ids, slots, positions
        host[n:b] = (0, self.pad_slot, 0)
        return block

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def run(self, ids: list[int] | None, slots: list[int], positions: list[int], device_ids: Tensor | None = None
            ) -> Tensor:
        """One decode step of len(slots) <= max_batch sequences -> logits [len(slots), V] (a view
        of the graph's output: read it before the next replay). Advances `cache.lengths`.
        The token ids come from `ids` or, when it is None, from `device_ids` [n] on the device."""
        n = len(slots)
        b = self.bucket(n)
        if b not in self.graphs:
            self.capture(b)
        self.inputs[:b].copy_(self._fill(ids, slots, positions, b)[:b], non_blocking=True)
        if ids is None:
            self.inputs[:n, 0].copy_(device_ids)
        self.graphs[b].replay()
        for s in slots:
            self.cache.lengths[s] += 1
        return self.outputs[b][:n]
