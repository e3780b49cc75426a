"""The micro-batch gradient tree of flat.py, summed one parameter at a time as the backward
pass makes each gradient, with its pending partial sums on the device or in host memory.

`tree_reduce` (flat.py) fixes the sum: over the leaves [lo, hi), the sum over [lo, mid)
plus the sum over [mid, hi), mid = (lo + hi) // 2. Evaluated as it is written, each leaf
is a whole new float32 `[padded]` vector (the micro-batch's gradient, flattened), and up to
log2(M) + 1 of them are alive at once beside the model's own `.grad` tensors (26 GiB a
vector at 7B). `GradTree` computes the same sum with less:

- Each parameter's gradient is folded into the tree as soon as the backward pass has
  finished it (a post-accumulate-grad hook: `ShardWorker` calls `add`), and its `.grad`
  is freed at once: no whole-model `.grad`, no flattened leaf.
- The tree is evaluated in post order with a stack: after leaf i, every internal node
  whose range ends at i (innermost first) adds its pending left sum to the running one
  (`tree_pops`), and the result is pushed unless i is the last leaf. Popped storage is
  reused for the result, so at most `max_pending(M)` <= log2(M) whole vectors are alive.
- `gpu_vectors` = k >= 1: a pushed sum of 2^k or more leaves waits in pinned host memory,
  a smaller one on the device. The big sums wait longest and are the fewest: with M leaves
  about M / 2^k sums go to the host and back in an update, so each more vector on the
  device halves the PCIe traffic, and the device holds k whole vectors when M is a power
  of two (`gpu_vectors_held` counts them for any M: a small sum is taken by the next
  leaves and its storage reused for their running sum). 0: every sum on the device
  (`max_pending`); `bench/tune/grad_memory.py` measures them.
- `host_sums` (optimizer offload, offload.py): every sum in host memory, the running one
  and the root too, each a vector `host_vectors` hands out (and takes back once added); the device holds one part's
  gradient (and a pending sum's part, brought back to be added to it) at a time. `result()`
  waits for the copies to the host.

Why the bits are those of `tree_reduce`: every operation is elementwise, so element j of
the sum depends only on element j of the leaves and on the order in which they are added;
cutting the vector into per-parameter ranges, or moving a partial sum to the host and
back (a copy), changes neither. The order is the same: each addition is `left + right`
of the same two float32 operands in the same tree (a range of `x.add_(y)` computes what
the whole vector's does at those elements), an empty leaf (None) adds nothing as in
`tree_reduce`, and a bf16 gradient becomes float32 exactly, as `flatten` made it. A
parameter that the backward pass did not reach adds +0.0, as `torch.zeros_like` did, and
so does the padding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from reprorl.workers.flat import FlatLayout


class HostPool(Protocol):
    """Where a `GradTree` with `host_sums` takes its host vectors (offload.HostVectors)."""

    def take(self, size: int) -> torch.Tensor: ...

    def give(self, vector: torch.Tensor) -> None: ...


@dataclass(frozen=True)
class Parts:
    """The ranges a `GradTree`'s vectors are fed by: part i is `[bounds[i], bounds[i + 1])`
    of a `size`-element vector, and `[bounds[-1], size)` is padding (+0.0)."""

    bounds: tuple[int, ...]
    size: int

    @classmethod
    def of(cls, layout: FlatLayout) -> Parts:
        """One part per parameter of a flat layout, the vector `[padded]`."""
        return cls(tuple(layout.offsets()) + (layout.numel,), layout.padded)

    @property
    def count(self) -> int:
        return len(self.bounds) - 1


def _nodes(lo: int, hi: int) -> list[tuple[int, int]]:
    """The internal nodes [a, b) of `tree_reduce`'s tree over [lo, hi), in post order
    (children before their parent)."""
    nodes: list[tuple[int, int]] = []

    def visit(a: int, b: int) -> None:
        if b - a == 1:
            return
        mid = (a + b) // 2
        visit(a, mid)
        visit(mid, b)
        nodes.append((a, b))

    visit(lo, hi)
    return nodes


def tree_pops(lo: int, hi: int) -> list[int]:
    """For each leaf i of [lo, hi) (index i - lo): how many pending left sums are added to
    the running sum right after it: one per internal node whose range ends at i + 1."""
    pops = [0] * (hi - lo)
    for _, b in _nodes(lo, hi):
        pops[b - 1 - lo] += 1
    return pops


def pushed_spans(lo: int, hi: int) -> list[int]:
    """For each leaf i of [lo, hi): how many leaves the running sum covers once leaf i's
    pending sums are added, i.e. the sum pushed after it (the outermost node ending at i + 1)."""
    spans = [1] * (hi - lo)
    for a, b in _nodes(lo, hi):  # post order: a parent after its children, so the outermost wins
        spans[b - 1 - lo] = b - a
    return spans


def on_host(lo: int, hi: int, gpu_vectors: int) -> list[bool]:
    """For each leaf of [lo, hi): whether its running sum is kept in host memory (module
    doc). Never the last leaf's (the root); else a sum of 2^gpu_vectors or more leaves, or
    of fewer where the tree is not a power of two wide and that would put more than
    `gpu_vectors` vectors on the device (1 leaf, at worst: every pushed sum on the host)."""
    if gpu_vectors <= 0:
        return [False] * (hi - lo)
    spans, pops = pushed_spans(lo, hi), tree_pops(lo, hi)
    threshold = 1 << gpu_vectors
    while True:
        host = [i < hi - lo - 1 and span >= threshold for i, span in enumerate(spans)]
        if threshold == 1 or _device_peak(pops, host) <= gpu_vectors:
            return host
        threshold //= 2


def gpu_vectors_held(count: int, gpu_vectors: int) -> int:
    """The most whole vectors a `GradTree` of `count` leaves holds on the device at once."""
    return _device_peak(tree_pops(0, count), on_host(0, count, gpu_vectors))


def _device_peak(pops: list[int], host: list[bool]) -> int:
    """The most device vectors during any leaf: the device sums on the stack (those the leaf
    takes included) and its running sum when that is a new device vector (not when it is on
    the host or written into a taken device sum)."""
    stack: list[bool] = []  # per pending sum: in host memory
    peak = 0
    for count, here in zip(pops, host):
        taken = stack[len(stack) - count:]
        new_running = not here and all(taken)
        peak = max(peak, sum(not h for h in stack) + new_running)
        del stack[len(stack) - count:]
        stack.append(here)
    return peak


def max_pending(count: int) -> int:
    """The most whole vectors a `GradTree` of `count` leaves holds at once (pending sums,
    the running one included): the deepest stack after any leaf. log2(count) for a power of two."""
    depth, peak = 0, 1
    for pops in tree_pops(0, count)[:-1]:
        depth += 1 - pops
        peak = max(peak, depth)
    return peak


class GradTree:
    """The sum of leaves [lo, hi) in `tree_reduce`'s tree, fed a part (`Parts`: a
    parameter's range of the flat layout, or a piece of a shard) at a time.

    Per leaf, in index order: `start_leaf(empty)`, then `add` for the parts' gradients
    (any order), then `finish_leaf` (it adds +0.0 for what was not added). `result()`: the
    `[parts.size]` float32 sum on `device`, or None when every leaf was empty.
    """

    def __init__(self, lo: int, hi: int, parts: Parts, device: torch.device, gpu_vectors: int = 0,
                 host_sums: bool = False, host_vectors: HostPool | None = None) -> None:
        if hi <= lo:
            raise ValueError(f"GradTree: empty leaf range [{lo}, {hi})")
        self.parts, self.device = parts, torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # as tensors name it: `t.device == where` below
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.host = torch.device("cpu")
        self.pops, self.lo = tree_pops(lo, hi), lo
        self.on_host = [True] * (hi - lo) if host_sums else on_host(lo, hi, gpu_vectors)
        self.host_vectors = host_vectors
        self.offsets = parts.bounds
        self.stack: list[torch.Tensor | None] = []
        self.leaf = lo
        self.root: torch.Tensor | None = None

    def start_leaf(self, empty: bool) -> None:
        """Take the pending sums this leaf's nodes add (innermost first) and pick the storage
        the running sum is written to: a taken one in the right place, else a new vector,
        made at the first `add` (after the forward pass's peak, not beside it)."""
        count = self.pops[self.leaf - self.lo]
        taken = self.stack[len(self.stack) - count :][::-1]  # innermost (most recent) first
        del self.stack[len(self.stack) - count :]
        self.taken = taken
        self.empty = empty
        self.done = [False] * self.parts.count
        where = self.host if self.on_host[self.leaf - self.lo] else self.device
        self.target, self.new_target = None, None
        if empty and all(t is None for t in taken):
            return
        reuse = [t for t in taken if t is not None and t.device == where]
        if reuse:
            self.target = reuse[-1]
        else:  # allocated by the first `_fold`: in the backward pass, once the logits' gradient is freed
            self.new_target = where

    def add(self, index: int, grad: torch.Tensor | None) -> None:
        """Part `index`'s gradient (any float dtype; None: +0.0) into the running sum."""
        if self.empty:
            raise RuntimeError(f"GradTree.add: leaf {self.leaf} was started empty")
        start, end = self.offsets[index], self.offsets[index + 1]
        if grad is None:
            grad = torch.zeros(end - start, dtype=torch.float32, device=self.device)
        self._fold(start, end, grad.reshape(-1).to(torch.float32))  # exact: a wider float
        self.done[index] = True

    def finish_leaf(self) -> None:
        """The ranges not added (unreached parameters, the padding, or all of an empty leaf),
        then push the running sum (or keep it as the root after the last leaf)."""
        ranges = [(self.offsets[i], self.offsets[i + 1]) for i, done in enumerate(self.done) if not done]
        if self.parts.size > self.offsets[-1]:
            ranges.append((self.offsets[-1], self.parts.size))
        for start, end in ranges:
            zeros = None if self.empty else torch.zeros(end - start, dtype=torch.float32, device=self.device)
            self._fold(start, end, zeros)
        if self.host_vectors is not None:  # the taken sums now in the running one
            for t in self.taken:
                if t is not None and t is not self.target and t.device.type == "cpu":
                    self.host_vectors.give(t)
        self.taken = []
        if self.leaf == self.lo + len(self.pops) - 1:
            self.root = self.target
        else:
            self.stack.append(self.target)
        self.leaf += 1

    def result(self) -> torch.Tensor | None:
        if self.leaf != self.lo + len(self.pops):
            raise RuntimeError(f"GradTree.result: leaf {self.leaf} of [{self.lo}, {self.lo + len(self.pops)}) is next")
        if self.root is not None and self.root.device != self.device and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # its copies to the host are done
        return self.root

    def _fold(self, start: int, end: int, value: torch.Tensor | None) -> None:
        """target[start:end] = taken[-1] + (... + (taken[0] + value)), skipping Nones (empty
        subtrees): each addition left + right, as `tree_reduce`'s `left.add_(right)`.
        A taken sum on the device is read here once and never again, so it is added into in
        place; the target, when it is one of them, is written below, after its one read."""
        if self.target is None:
            if self.new_target is None:
                return
            where = self.new_target
            if where.type == "cpu" and self.host_vectors is not None:
                self.target = self.host_vectors.take(self.parts.size)
            else:
                self.target = torch.empty(self.parts.size, dtype=torch.float32, device=where,
                                          pin_memory=where.type == "cpu" and self.device.type == "cuda")
        for left in self.taken:
            if left is None:
                continue
            piece = left[start:end]
            if piece.device != self.device:
                piece = piece.to(self.device, non_blocking=True)  # from the host: a copy
            value = piece if value is None else piece.add_(value)
        dest = self.target[start:end]
        if value.data_ptr() != dest.data_ptr() or value.device != dest.device:
            dest.copy_(value, non_blocking=True)
