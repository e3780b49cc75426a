"""Flat shards and the fixed-order reductions that make N workers give one worker's bits.

The trainable parameters of a model are laid end to end in one flat vector (parameter
order, each tensor row-major), padded with zeros to a whole number of CHUNK-element
chunks. With N workers, rank r owns chunks `[r * c, (r + 1) * c)` (c = ceil(chunks / N);
the last ranks may own padding only): the gradient it reduces, the master copy of its
parameters and the AdamW moments of those elements. Every rank also holds the whole
parameter vector for its forward passes, rebuilt after each optimizer step by an
all-gather (exact: it only moves bytes, each shard to its place by rank index).

What keeps the bits independent of N (any power of two: the rule `config/checks.py`
checks for `trainer.num_workers`):
- Micro-batches are cut from the mini-batch by sample order (or by a token budget),
  whatever N is, and each micro-batch's gradient is computed alone, so it has the same
  bits on any rank.
- The M micro-batches are laid on the P leaves of ONE binary tree, P the power of two
  >= M (`tree_leaves`): leaf s holds one when bit_reverse(s) < M, in micro-batch order;
  the other leaves are empty and add nothing. P and the layout depend on M alone (when M
  is a power of two, leaf s is micro-batch s). The tree sums them (`tree_reduce`: the sum
  over [lo, hi) is the sum over [lo, mid) plus the sum over [mid, hi), mid = (lo + hi) //
  2). Rank r takes the contiguous block of leaves `[r * P / N, (r + 1) * P / N)`; for
  N <= P those blocks are subtrees, so the rank sums its block locally and
  `fixed_order_reduce_scatter` sums the N block sums with the same tree over rank index.
  A collective's own reduction (ring, tree, gloo's or NCCL's choice) sums in an order
  that changes with N, so it is never used to add gradients. The worker evaluates that
  tree with `GradTree` (grad_tree.py): the same bits, a parameter at a time as the
  backward pass makes them, with fewer whole vectors.
- Leaf s is in block r when its top log2(N) bits are r, that is when bit_reverse(s) is
  congruent to r's (in log2 N bits) modulo N, which M / N of the M values below M are,
  rounded up or down: the micro-batches are shared evenly for every N at once (empty
  leaves at the end would give the first ranks all the work). For N > P, empty leaves are
  appended up to N: every split of the tree over [0, N) above P has an all-empty right
  part, so the sum is that over [0, P), the same bits. A token budget
  (`actor.ppo_max_token_len_per_micro_batch`) makes M whatever the lengths make it
  (workers/micro_batches.py); cut by samples, M is fixed by the config; the layout is
  the same rule either way. "Adds nothing" is exact: x + (-0.0) == x bit for bit for
  every float x (+0.0 would turn a -0.0 into +0.0; torch does not flush subnormals unless
  told to), so
  an empty subtree is skipped in `tree_reduce`, and a rank whose whole block is empty sends
  -0.0 (`EMPTY_GRADIENT`) to the reduction, which is the same as leaving it out. So the
  gradient has the P-leaf tree's bits at every power-of-two N.
- The gradient norm for clipping is a sum of per-chunk sums of squares, the chunks fixed
  by the flat layout (not by N), added in chunk order (`global_grad_norm`).
- AdamW (`optim.step_in_chunks`: torch's AdamW, each operation rounded once) is elementwise:
  an element's update does not depend on where the shard starts or ends
  (tests/workers/test_flat.py checks it).

Why not FSDP2 (`torch.distributed.fsdp.fully_shard`, which does run on CPU with gloo in
torch 2.13): as it comes, it reduce-scatters each micro-batch's gradient across ranks as
soon as its backward ends, adding in the collective's order, then adds the result into
the sharded gradient in arrival order, so its gradient differs from 1 rank's at 2 and at 4
ranks (measured: docs/performance.md). It can be bent to the tree above (a custom
reduce-scatter that all-to-alls the pieces and sums them over rank index, micro-batches
dealt by stride so that each round is a subtree, and a hook on each sharded parameter that
takes the reduced shard into our own tree), but that rests on a private comm class, needs
a backward on every rank at every round, and its shards are dim-0 slices of each parameter
whose bounds move with N, which would change the norm's chunk order and the any-N
checkpoints (docs/design.md has the study). Parameters are whole on every rank between
steps (as ZeRO-2), unless sharded at rest (`model.shard_params`: units.py gathers a layer's
ranges of this layout when it runs, and deals the micro-batches by stride so that each
round of N leaves is a subtree of the same tree; no bit changes).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from reprorl.kernels.optim_math import chunk_sums_of_squares
from reprorl.kernels.pinned import thread_free_sum

CHUNK = 4096
"""Elements per chunk: the unit of sharding and of the gradient norm's partial sums. Part
of the bits of a run (it fixes the norm's summation order); small enough that tiny test
models still spread over 4 ranks."""


# ------------------------------------------------------------------------------ layout


@dataclass(frozen=True)
class FlatLayout:
    """Where each trainable parameter sits in the flat vector, and which range each rank owns."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    numel: int
    """Real elements (the sum of the parameters' sizes); the rest up to `padded` is zeros."""
    world_size: int

    @classmethod
    def of(cls, named_params: Iterable[tuple[str, torch.Tensor]], world_size: int) -> FlatLayout:
        named = list(named_params)
        return cls(
            names=tuple(n for n, _ in named), shapes=tuple(tuple(p.shape) for _, p in named),
            numel=sum(p.numel() for _, p in named), world_size=world_size,
        )

    @property
    def num_chunks(self) -> int:
        return math.ceil(self.numel / CHUNK)

    @property
    def shard_size(self) -> int:
        return math.ceil(self.num_chunks / self.world_size) * CHUNK

    @property
    def padded(self) -> int:
        return self.shard_size * self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        """`[start, end)` of rank's shard in the padded flat vector."""
        return rank * self.shard_size, (rank + 1) * self.shard_size

    def offsets(self) -> list[int]:
        out, offset = [], 0
        for shape in self.shapes:
            out.append(offset)
            offset += math.prod(shape)
        return out

    def to_json(self) -> dict:
        return {"names": list(self.names), "shapes": [list(s) for s in self.shapes], "numel": self.numel,
                "world_size": self.world_size, "chunk": CHUNK}


def flatten(tensors: Sequence[torch.Tensor], layout: FlatLayout, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The tensors (in layout order) end to end in a new zero-padded `[padded]` vector, in
    `dtype` (default: the tensors'; a wider float is exact). One concatenation: a copy per
    tensor was ~300 kernel launches for a gradient of Qwen2.5-0.5B's shape, each micro-batch."""
    flat = torch.empty(layout.padded, dtype=dtype or tensors[0].dtype, device=tensors[0].device)
    torch.cat([t.reshape(-1) for t in tensors], out=flat[: layout.numel])
    flat[layout.numel :].zero_()
    return flat


def bind_params(params: Sequence[torch.nn.Parameter], layout: FlatLayout) -> torch.Tensor:
    """Move the parameters' values into one flat vector and make each parameter a view of
    it; returns the vector, so that writing a shard of it updates the model in place."""
    with torch.no_grad():
        flat = flatten([p.detach() for p in params], layout)
        for offset, p in zip(layout.offsets(), params):
            p.data = flat[offset : offset + p.numel()].view(p.shape)
    return flat


# ------------------------------------------------------------------------------ reductions


def tree_reduce(lo: int, hi: int, leaf: Callable[[int], torch.Tensor | None]) -> torch.Tensor | None:
    """The sum of `leaf(i)` for i in [lo, hi) in the fixed binary tree of the module doc.

    Leaves are computed in index order and at most one partial sum per tree level is
    alive. `leaf` must return a tensor the caller may overwrite (sums are in place), or
    None for an empty leaf, which adds nothing (exactly: the module doc); None when all are.
    """
    if hi - lo == 1:
        return leaf(lo)
    mid = (lo + hi) // 2
    left = tree_reduce(lo, mid, leaf)
    right = tree_reduce(mid, hi, leaf)
    if left is None or right is None:
        return right if left is None else left
    return left.add_(right)


def tree_sum(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """`tree_reduce` over a list (the inputs are not changed)."""
    return tree_reduce(0, len(tensors), lambda i: tensors[i].clone())


def fixed_order_reduce_scatter(full: torch.Tensor, layout: FlatLayout, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's shard of the sum over ranks of `full` (`[padded]`), added in the tree
    over rank index: an all-to-all hands rank r every rank's piece r, then `tree_sum`. With
    one rank that is `full` itself, not a copy (a whole gradient vector less)."""
    world = layout.world_size
    send = list(full.view(world, layout.shard_size).unbind(0))
    if world == 1:
        return send[0]
    received = [torch.empty_like(send[0]) for _ in range(world)]
    exchange_pieces(received, send, group)
    return tree_sum(received)


def exchange_pieces(received: list[torch.Tensor], send: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """An all-to-all (rank r's `send[q]` lands in rank q's `received[r]`). Gloo has none in
    some torch versions ("Backend gloo does not support alltoall" from torch 2.11 on the GPU
    machine's CPU; 2.13 has one), so on gloo each pair of ranks sends and receives point to
    point. The pieces are moved, never added: the bits do not depend on how. Pieces may
    differ in size (rank q's `received` pieces are all of one size, its share)."""
    if dist.get_backend(group) != "gloo":
        dist.all_to_all(received, send, group=group)
        return
    rank = dist.get_rank(group)
    ops = []
    for peer in range(len(send)):
        if peer == rank:
            received[peer].copy_(send[peer])
            continue
        global_peer = dist.get_global_rank(group, peer)
        ops += [dist.P2POp(op, tensor, global_peer, group)  # an empty piece is neither sent nor awaited
                for op, tensor in ((dist.isend, send[peer]), (dist.irecv, received[peer])) if tensor.numel()]
    for work in dist.batch_isend_irecv(ops) if ops else ():
        work.wait()


def all_gather_shards(shard: torch.Tensor, flat: torch.Tensor, layout: FlatLayout, group: dist.ProcessGroup) -> None:
    """Write every rank's `shard` into its place in `flat` (`[padded]`), by rank index."""
    dist.all_gather(list(flat.view(layout.world_size, layout.shard_size).unbind(0)), shard, group=group)


def global_grad_norm(shard_grad: torch.Tensor, layout: FlatLayout, group: dist.ProcessGroup,
                     device: torch.device | None = None) -> float:
    """The L2 norm of the whole (reduced) gradient, the same bits on every rank and for every N.

    Each chunk's sum of squares (float32, `chunk_sums_of_squares`: halving, the same bits on
    the GPU and on the host, where an offloaded optimizer's gradient is), every rank's
    gathered by rank index, then the first `num_chunks` added in float64 in an order fixed
    by their count (`thread_free_sum`: past 32768 chunks, about 134M parameters, torch's own
    CPU sum would follow the thread count). A non-finite gradient gives a non-finite norm.
    The sums travel on the rank's collective device (`device`; None: the gradient's).
    """
    sums = chunk_sums_of_squares(shard_grad.float(), CHUNK).to(device or shard_grad.device)  # [chunks of this shard]
    gathered = [torch.empty_like(sums) for _ in range(layout.world_size)]
    dist.all_gather(gathered, sums, group=group)
    return math.sqrt(float(thread_free_sum(torch.cat(gathered)[: layout.num_chunks].double())))  # IEEE's root


def first_failure(failure: tuple[int, float] | None, group: dist.ProcessGroup,
                  device: torch.device) -> tuple[int, float] | None:
    """Agree across ranks on the lowest-indexed failed micro-batch: `(index, loss value)`
    or None. Every rank calls it before the reduction, so a rank that stopped early never
    leaves the others waiting in a collective."""
    mine = torch.tensor([math.inf, 0.0] if failure is None else [float(failure[0]), failure[1]], dtype=torch.float64,
                        device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    index, value = min((float(t[0]), float(t[1])) for t in gathered)
    return None if math.isinf(index) else (int(index), value)


EMPTY_GRADIENT = -0.0
"""What a rank whose leaves are all empty sends to the reduction: x + (-0.0) == x for every
float x, so it changes no bit of the sum (+0.0 would turn a -0.0 into +0.0)."""


def tree_leaves(count: int, world_size: int) -> list[int | None]:
    """The leaves of a mini-batch's gradient tree for its `count` micro-batches (cut by
    samples or by a token budget): micro-batch index or None (empty), max(P, world_size) of
    them, P the power of two >= count; leaf s < P holds one when bit_reverse(s) < count (log2 P bits), in
    micro-batch order. The sum over them has the same bits for every power-of-two
    `world_size` (module doc), and each rank's block holds count / world_size micro-batches,
    rounded up or down.
    """
    if count < 1 or world_size < 1 or world_size & (world_size - 1):
        raise ValueError(f"tree_leaves: count={count}, world_size={world_size}; expected count >= 1 and a "
                         "power-of-two world_size")
    bits = (count - 1).bit_length()  # P = 2 ** bits
    leaves: list[int | None] = []
    taken = 0
    for s in range(1 << bits):
        reversed_s = int(f"{s:0{bits}b}"[::-1], 2) if bits else 0
        leaves.append(taken if reversed_s < count else None)
        taken += reversed_s < count
    return leaves + [None] * (world_size - len(leaves))


def rank_block(count: int, rank: int, world_size: int) -> tuple[int, int]:
    """`[start, end)` of rank's contiguous block of `count` items: blocks of ceil(count / N),
    the last ones shorter or empty (for log-prob passes, where nothing is summed)."""
    size = math.ceil(count / world_size)
    return min(rank * size, count), min((rank + 1) * size, count)
