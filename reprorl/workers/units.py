"""Parameters sharded at rest (ZeRO-3 / FSDP style) over flat.py's layout, with the bits
of the whole-parameter path (`model.shard_params`).

A rank keeps the compute-dtype cast of its master shard (`local`), the range of the flat
vector it owns, and no other weight. The trainable parameters are cut into units: one per
decoder layer (`model.layers.<i>.`), a head unit of what runs after them (final norm, an
untied LM head, a critic's value head) and a root unit of the rest (embeddings; tied, the
head too). Each unit has a buffer of its own, of its parameters end to
end in layout order (parameters that are views of one flat vector could not be freed a
unit at a time), and each parameter is a view of its unit's buffer. A LoRA actor's frozen
base is a second set of weights (`UnitSet`) cut into the same units, with a layout of its
own and no master: it is gathered and freed with the adapters, and takes no gradient.

- `gather(u)`: each rank that owns a piece of the unit's ranges broadcasts it, in a fixed
  order (span by span, owner by owner); a gather only moves bytes, so the weights have the
  bits `_publish_master`'s all-gather gave the whole model. The bytes are written through
  an alias of the buffer's storage, so autograd's version counters of the parameters (and
  of the views it saved for backward) do not move.
- `free(u)`: the buffer's storage is resized to 0; the tensors autograd saved still point
  at it and see the bytes of the next gather.
- A layer is gathered by a forward pre-hook and freed by its forward hook; when the forward
  records a graph, that hook also puts a hook on the layer's output, which gathers the
  layer again just before its backward (with gradient checkpointing the recomputed forward
  then finds it gathered), and it is freed when the next layer's backward starts. On
  several ranks the next layer's gather is started (`prefetch`: asynchronous broadcasts)
  as a layer's forward or backward starts. The root and head units are gathered for a
  whole pass (`root_gathered`).

Gradients (`Exchange`): the micro-batches are dealt by stride: in round j rank r computes
leaf j * N + r of flat.py's tree (`tree_leaves`), and the N leaves of a round are the
subtree [jN, (j + 1)N), since N divides the power-of-two leaf count. As the backward pass
finishes a unit, its gradient (float32, exact from the model's dtype) goes to the owners of
its ranges: all-to-alls of per-owner pieces, a slice of each at a time (`MAX_SLICE`: an
owner's receive buffer holds N slices, not N copies of its whole share of a unit), which
each owner adds over rank index in `tree_sum`'s tree, the round's subtree. A `GradTree`
over the rounds, of shard size, adds the round sums: the whole tree of the whole-parameter
path, the same bits, with log2(rounds) pending shards in place of whole vectors. A rank whose leaf of a round is
empty makes the same collectives, in the same order, without computing (`replay_*`): it
sends -0.0 pieces, which add nothing (flat.py's `EMPTY_GRADIENT`). A round whose leaves
are all empty is skipped by every rank.

Every collective of a pass is made by every rank in one order, by the same hook functions
whether the rank computes or replays: the root's and the head's gathers, the layers'
gathers in order (forward; on several ranks each started one layer early), then for each
layer in reverse order the exchange of the unit after it (the head's, before the last
layer) and its own gather (backward; the next one's started), then the exchanges of the
first layer and of the root. Sending the head's gradient early means the root's float32
gradient (the embeddings') and the head's are never held at once. A unit's gradient must be
whole when the next layer's backward starts (the backward of a decoder stack makes it so);
a gradient that comes later raises rather than being lost. An error inside a pass leaves
this rank's units freed (`reset`); its peers wait in their next collective until the
group notices the failed rank.

Nothing may take a numpy view of a parameter (`Tensor.numpy()`): that marks its storage
unresizable and the next `free` fails; read a clone.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from reprorl.workers.flat import CHUNK, EMPTY_GRADIENT, FlatLayout, exchange_pieces, tree_reduce
from reprorl.workers.grad_tree import GradTree, Parts

ROOT = 0
"""The unit of the parameters before the decoder layers (embeddings; tied, the head too)."""
_LAYER = re.compile(r"^(.*?\blayers\.(\d+))\.")
MAX_SLICE = 1 << 24
"""Elements an owner takes from each rank in one exchange of a unit's gradient, at most:
its receive buffer holds N of them (float32), 512 MiB on 8 ranks, whatever the unit's
size (a 7B model's embeddings, 545M elements, on one owner would need 16 GiB at once)."""
_HEAD = re.compile(r"^(model\.norm|lm_head|score)\.")
"""The parameters after the decoder layers (final norm, an untied LM head, a value or score
head): the head unit, whose gradient is whole when the last layer's backward starts."""


@dataclass(frozen=True)
class UnitPlan:
    """Which unit each trainable parameter is in, and where the units lie in the flat vector.

    Unit 0 is the root; unit 1 + i is the decoder layer whose module is `modules[1 + i]`;
    the last unit is the head (`head`: possibly empty, as a LoRA run's adapters' is).
    `members[u]`: the parameter indices (layout order); `spans[u]`: `(flat start, flat end,
    buffer offset)` of its runs of adjacent parameters; `unit_of[p]`, `at[p]`: parameter p's
    unit and its offset in the unit's buffer."""

    members: tuple[tuple[int, ...], ...]
    spans: tuple[tuple[tuple[int, int, int], ...], ...]
    modules: tuple[str | None, ...]
    unit_of: tuple[int, ...]
    at: tuple[int, ...]

    @classmethod
    def of(cls, layout: FlatLayout, layers: dict[int, str] | None = None) -> UnitPlan:
        """`layers`: the decoder layers' modules by index (`layer_modules`), when they are
        more than `layout`'s (two sets of weights cut into the same units); by default its own."""
        layers = layer_modules(layout.names) if layers is None else layers
        order = sorted(layers)
        index = {layer: 1 + i for i, layer in enumerate(order)}
        head = 1 + len(order)
        units = []
        for name in layout.names:
            match = _LAYER.match(name)
            units.append(index[int(match.group(2))] if match else head if _HEAD.match(name) else ROOT)
        offsets = layout.offsets() + [layout.numel]
        members: list[list[int]] = [[] for _ in range(head + 1)]
        spans: list[list[tuple[int, int, int]]] = [[] for _ in members]
        sizes = [0] * len(members)
        at = []
        for p, u in enumerate(units):
            members[u].append(p)
            start, end = offsets[p], offsets[p + 1]
            at.append(sizes[u])
            sizes[u] += end - start
            runs = spans[u]
            if runs and runs[-1][1] == start:
                runs[-1] = (runs[-1][0], end, runs[-1][2])
            else:
                runs.append((start, end, sum(e - s for s, e, _ in runs)))
        return cls(members=tuple(map(tuple, members)), spans=tuple(map(tuple, spans)),
                   modules=(None, *(layers[i] for i in order), None), unit_of=tuple(units), at=tuple(at))

    @property
    def layers(self) -> range:
        return range(1, self.head)

    @property
    def head(self) -> int:
        return len(self.members) - 1

    def size(self, unit: int) -> int:
        return sum(end - start for start, end, _ in self.spans[unit])

    def exchange_slices(self, unit: int, layout: FlatLayout) -> list[list[tuple[int, int, int] | None]]:
        """The exchanges of the unit's gradient, in order: in each, per owner, the slice of
        its pieces it takes (`owner_pieces`' form) or None. Each piece is cut into slices of
        at most `exchange_slice` elements, and exchange k takes every owner's k-th slice."""
        most = exchange_slice(layout.shard_size)
        slices = [[(a, min(a + most, end), at + a - start) for start, end, at in self.owner_pieces(unit, layout, q)
                   for a in range(start, end, most)] for q in range(layout.world_size)]
        return [[cut[k] if k < len(cut) else None for cut in slices] for k in range(max(map(len, slices)))]

    def owner_pieces(self, unit: int, layout: FlatLayout, owner: int) -> list[tuple[int, int, int]]:
        """`(buffer start, buffer end, shard offset)` of the unit's elements in `owner`'s shard."""
        lo, hi = layout.shard_range(owner)
        pieces = []
        for start, end, at in self.spans[unit]:
            a, b = max(start, lo), min(end, hi)
            if a < b:
                pieces.append((at + a - start, at + b - start, a - lo))
        return pieces


def layer_modules(names: Sequence[str]) -> dict[int, str]:
    """The decoder layers' module names by layer index, of the parameters `names`."""
    return {int(m.group(2)): m.group(1) for m in map(_LAYER.match, names) if m is not None}


@dataclass
class UnitSet:
    """Weights cut into the units: laid out end to end by `layout`, a buffer per unit (each
    parameter a view of it, freed at rest), this rank's range of the layout in `local`, and
    per unit, per rank, its pieces of the unit (`owner_pieces`: what gathers and exchanges move)."""

    plan: UnitPlan
    layout: FlatLayout
    local: torch.Tensor
    buffers: list[torch.Tensor]
    aliases: list[torch.Tensor]  # each buffer's storage, to write through (module doc)
    owners: list[list[tuple[int, list[tuple[int, int, int]]]]]

    @classmethod
    def bind(cls, params: Sequence[torch.nn.Parameter], layout: FlatLayout, layers: dict[int, str], rank: int,
             device: torch.device) -> UnitSet:
        """Make each of `params` (laid out by `layout`, whole) a view of its unit's buffer on
        `device`, keeping this rank's range; the buffers are left freed."""
        plan = UnitPlan.of(layout, layers)
        local = _range_of(params, layout, *layout.shard_range(rank)).to(device)
        buffers, aliases = [], []
        with torch.no_grad():
            for u, members in enumerate(plan.members):
                buffer = torch.empty(plan.size(u), dtype=local.dtype, device=device)
                for p in members:
                    at = plan.at[p]
                    params[p].data = buffer[at : at + params[p].numel()].view(params[p].shape)
                buffers.append(buffer)
                aliases.append(torch.empty(0, dtype=buffer.dtype, device=device).set_(buffer.untyped_storage()))
                buffer.untyped_storage().resize_(0)  # freed: at most one unit's bytes at a time
        owners = [[(q, plan.owner_pieces(u, layout, q)) for q in range(layout.world_size)]
                  for u in range(len(buffers))]
        return cls(plan, layout, local, buffers, aliases, owners)

    def start_gather(self, unit: int, rank: int, group: dist.ProcessGroup) -> list[dist.Work]:
        """Allocate the unit's buffer and start its broadcasts, owner by owner, piece by piece."""
        buffer, alias = self.buffers[unit], self.aliases[unit]
        buffer.untyped_storage().resize_(buffer.numel() * buffer.element_size())
        works = []
        with torch.no_grad():
            for owner, pieces in self.owners[unit]:
                for start, end, at in pieces:
                    piece = alias[start:end]
                    if owner == rank:
                        piece.copy_(self.local[at : at + end - start])
                    if self.layout.world_size > 1:
                        works.append(dist.broadcast(piece, dist.get_global_rank(group, owner), group=group,
                                                    async_op=True))
        return works

    def free(self, unit: int) -> None:
        self.buffers[unit].untyped_storage().resize_(0)


class ShardedParams:
    """Parameters of `model` sharded at rest over `group` (module doc).

    `params`: those `layout` lays out, in its order (a trainable group's trainable ones, a
    frozen group's every one), their values the run's initial weights, whole on every
    rank (on the host, or on `device`): this rank keeps its range, on `device`. `frozen`:
    a LoRA actor's frozen base, cut into the same units and gathered with them (no master,
    no gradient). The model's other tensors (buffers) are moved to `device` whole, so a
    model loaded on the host is never whole on the device. A trainable rank calls
    `set_local` with the cast of its master shard after every optimizer step or load."""

    def __init__(self, model: torch.nn.Module, params: Sequence[torch.nn.Parameter], layout: FlatLayout,
                 rank: int, group: dist.ProcessGroup, device: torch.device,
                 frozen: Sequence[tuple[str, torch.nn.Parameter]] = ()) -> None:
        self.rank, self.group, self.world = rank, group, layout.world_size
        self.device = device = torch.empty(0, device=device).device  # "cuda" resolved to its index
        frozen_layout = FlatLayout.of(list(frozen), self.world) if frozen else None
        layers = layer_modules(list(layout.names) + (list(frozen_layout.names) if frozen else []))
        # The weights gathered per unit: the trained set (or a frozen group's every weight) first.
        self.sets = [UnitSet.bind(params, layout, layers, rank, device)]
        if frozen_layout is not None:
            self.sets.append(UnitSet.bind([p for _, p in frozen], frozen_layout, layers, rank, device))
        trained = self.sets[0]
        self.plan, self.layout, self.buffers = trained.plan, layout, trained.buffers
        self.param_sizes = [p.numel() for p in params]
        self.slices = [self.plan.exchange_slices(u, layout) for u in range(len(self.buffers))]
        self.parts, self.part_of = shard_parts(self.slices, rank, layout.shard_size)  # the round tree's parts
        self.is_gathered = [False] * len(self.buffers)  # gathered, or on the way (`in_flight`)
        self.in_flight: dict[int, list[dist.Work]] = {}  # a prefetch's broadcasts, per unit
        _move_the_rest(model, device)
        self.in_backward: set[int] = set()  # layers gathered for their backward pass
        self.exchange: Exchange | None = None  # the round's gradient exchange, during an update
        modules = dict(model.named_modules())
        self._hooks = []
        self._places = {name: (s, weights.plan.unit_of[i]) for s, weights in enumerate(self.sets)
                        for i, name in enumerate(weights.layout.names)}
        for u in self.plan.layers:
            module = modules[self.plan.modules[u]]
            self._hooks += [module.register_forward_pre_hook(lambda _m, _a, u=u: self._before_forward(u)),
                            module.register_forward_hook(lambda _m, _a, out, u=u: self._after_forward(u, out))]

    @property
    def local(self) -> torch.Tensor:
        """This rank's range of the trained weights (a frozen group's: of every weight)."""
        return self.sets[0].local

    def place_of(self, name: str) -> tuple[int, int]:
        """(index in `sets`, unit) of the parameter `name` (every parameter is in one)."""
        return self._places[name]

    def set_local(self, shard: torch.Tensor) -> None:
        """This rank's range of the weights, in the model's dtype (the master shard's cast):
        the master itself when the dtypes and devices agree, else its cast written over the
        last one (no second range beside it; with optimizer offload the master is on the host)."""
        if shard.dtype == self.local.dtype and shard.device == self.local.device:
            self.sets[0].local = shard.detach()
        else:
            self.local.copy_(shard.detach())

    # ------------------------------------------------------------------ gathers

    def gather(self, unit: int) -> None:
        """The unit's weights from their owners into its buffer, waited for (nothing if
        gathered; the end of a `prefetch`)."""
        if not self.is_gathered[unit]:
            self.prefetch(unit)
        for work in self.in_flight.pop(unit, ()):
            work.wait()

    def prefetch(self, unit: int) -> None:
        """Start gathering the unit (its broadcasts run while this rank computes), unless
        gathered or on the way. Every rank makes the same calls in the same order, so the
        collectives match whatever runs when."""
        if self.is_gathered[unit]:
            return
        self.in_flight[unit] = [work for weights in self.sets for work in weights.start_gather(unit, self.rank,
                                                                                                self.group)]
        self.is_gathered[unit] = True

    def free(self, unit: int) -> None:
        for work in self.in_flight.pop(unit, ()):  # its bytes must land before its storage goes
            work.wait()
        for weights in self.sets:
            weights.free(unit)
        self.is_gathered[unit] = False

    @contextlib.contextmanager
    def gathered(self, *units: int) -> Iterator[None]:
        """The units gathered inside the block, freed after."""
        try:
            for unit in units:
                self.gather(unit)
            yield
        finally:
            for unit in units:
                self.free(unit)

    def all_gathered(self) -> contextlib.AbstractContextManager[None]:
        """Every unit gathered: the whole model at once (bench/train_step.py hands it to an engine in place)."""
        return self.gathered(*range(len(self.buffers)))

    @contextlib.contextmanager
    def reading(self, unit: int, sets: Sequence[int]) -> Iterator[None]:
        """Outside a pass: the unit's weights of `sets` (indices of `self.sets`) gathered
        inside the block, freed after; every rank calls it with the same arguments."""
        if self.is_gathered[unit]:  # its free would pull the storage from under the pass's gather
            raise RuntimeError(f"ShardedParams.reading: unit {unit} is gathered already (inside a pass, "
                               "or all_gathered)")
        try:
            for work in [work for i in sets for work in self.sets[i].start_gather(unit, self.rank, self.group)]:
                work.wait()
            yield
        finally:
            for i in sets:
                self.sets[i].free(unit)

    def root_gathered(self) -> contextlib.AbstractContextManager[None]:
        """The root and head units gathered for a pass (a step's micro-batches, or a log-prob call)."""
        return self.gathered(ROOT, self.plan.head)

    def _next(self, layer: int, step: int) -> int | None:
        """The layer `step` (+1 or -1) after `layer` when prefetching pays (several ranks), else None."""
        nxt = layer + step
        return nxt if self.world > 1 and nxt in self.plan.layers else None

    def _before_forward(self, unit: int) -> None:
        self.gather(unit)
        if unit in self.in_backward:  # gradient checkpointing's recomputation: no collective
            return
        if (nxt := self._next(unit, +1)) is not None:
            self.prefetch(nxt)

    def _after_forward(self, unit: int, out: Any) -> None:
        if unit in self.in_backward:  # gradient checkpointing's recomputation, inside the backward pass
            return
        self.free(unit)
        if not torch.is_grad_enabled():
            return
        if not (isinstance(out, torch.Tensor) and out.requires_grad):  # its backward could not gather it
            raise RuntimeError(f"{self.plan.modules[unit]} returned {type(out).__name__} without a gradient "
                               "in a pass that records one; model.shard_params needs a layer's output tensor")
        out.register_hook(lambda grad, u=unit: self._before_backward(u))

    def _before_backward(self, unit: int) -> None:
        """Layer `unit`'s backward is next: the layer before it in the backward pass is done,
        so its gradient is sent and its weights freed; then this one is gathered."""
        if self.exchange is not None:
            self.exchange.unit_done_before(unit)
        for done in self.in_backward:
            self.free(done)
        self.in_backward = {unit}
        self.gather(unit)
        if (nxt := self._next(unit, -1)) is not None:
            self.prefetch(nxt)

    def replay_forward(self) -> None:
        """A forward pass's collectives without its compute (this rank has no micro-batch here)."""
        for unit in self.plan.layers:
            self._before_forward(unit)
            self.free(unit)

    def replay_backward(self) -> None:
        """A backward pass's collectives without its compute (the exchange sends -0.0)."""
        for unit in reversed(self.plan.layers):
            self._before_backward(unit)

    def end_backward(self) -> None:
        """After a micro-batch's backward (or its replay): the last layers' and the root's
        exchanges, and the layers freed."""
        if self.exchange is not None:
            self.exchange.unit_done_before(None)
        for unit in self.in_backward:
            self.free(unit)
        self.in_backward.clear()

    def reset(self) -> None:
        """After an error inside a pass: every unit freed, no pass under way (no collective)."""
        for unit in range(len(self.buffers)):
            self.free(unit)
        self.in_backward.clear()
        self.exchange = None

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


class Exchange:
    """One round's gradient: each unit's float32 gradient, as the backward pass folds it
    (`add`), sent to its owners when the unit is done; the owners add the N pieces over
    rank index and feed the sum to `tree` (a `GradTree` over the rounds, of shard size).
    `computing=False`: this rank's leaf of the round is empty (every piece -0.0)."""

    def __init__(self, at_rest: ShardedParams, tree: GradTree, computing: bool) -> None:
        self.at_rest, self.tree, self.computing = at_rest, tree, computing
        self.grads: dict[int, torch.Tensor] = {}
        self.added: dict[int, set[int]] = {}  # per unit, the parameters `add` wrote
        self.sent: set[int] = set()
        # The unit whose backward runs now: first the head's (its gradient is sent as the
        # last layer's backward starts), then each layer's.
        self.pending: int | None = at_rest.plan.head

    def add(self, index: int, grad: torch.Tensor) -> None:
        """Trainable parameter `index`'s gradient of this round's micro-batch."""
        plan = self.at_rest.plan
        unit = plan.unit_of[index]
        if unit in self.sent:
            raise RuntimeError(f"the gradient of {self.at_rest.layout.names[index]} came after its unit was "
                               "sent to its owners: this model's backward pass does not finish a layer "
                               "before the next; model.shard_params cannot train it")
        if unit not in self.grads:
            self.grads[unit] = torch.empty(plan.size(unit), dtype=torch.float32, device=self.at_rest.device)
            self.added[unit] = set()
        at = plan.at[index]
        self.grads[unit][at : at + grad.numel()].copy_(grad.reshape(-1))  # exact: a wider float
        self.added[unit].add(index)

    def unit_done_before(self, layer: int | None) -> None:
        """The backward pass reaches `layer` (None: it is over): send the unit it did before
        (the head, or the layer after), and with None the root too."""
        if self.pending is not None:
            self._send(self.pending)
        self.pending = layer
        if layer is None:
            self._send(ROOT)

    def _unit_gradient(self, unit: int) -> torch.Tensor:
        """The unit's gradient: +0.0 for a parameter the backward pass did not reach, as
        GradTree's; -0.0 everywhere when this rank computed nothing (it adds nothing)."""
        at_rest, plan = self.at_rest, self.at_rest.plan
        if not self.computing:
            return torch.full((plan.size(unit),), EMPTY_GRADIENT, dtype=torch.float32, device=at_rest.device)
        grad = self.grads.pop(unit, None)
        added = self.added.pop(unit, set())
        if grad is None:
            return torch.zeros(plan.size(unit), dtype=torch.float32, device=at_rest.device)
        for p in plan.members[unit]:
            if p not in added:
                grad[plan.at[p] : plan.at[p] + at_rest.param_sizes[p]].zero_()
        return grad

    def _send(self, unit: int) -> None:
        at_rest = self.at_rest
        self.sent.add(unit)
        if not at_rest.plan.size(unit):  # an empty unit (a LoRA run's adapters have no root or head)
            return
        grad = self._unit_gradient(unit)
        for slices in at_rest.slices[unit]:  # a slice of each owner's pieces at a time (`MAX_SLICE`)
            self._exchange(unit, grad, slices)

    def _exchange(self, unit: int, grad: torch.Tensor, slices: list[tuple[int, int, int] | None]) -> None:
        """One exchange of `_send`: to each owner its slice of `grad`, from every rank this
        rank's slice, added over rank index into the tree. Its receive buffers go when it
        returns, before the next exchange allocates its own (N slices alive, not 2N)."""
        at_rest = self.at_rest
        send = [grad[piece[0] : piece[1]] if piece else grad.new_empty(0) for piece in slices]
        mine = slices[at_rest.rank]
        size = mine[1] - mine[0] if mine else 0
        received = send if at_rest.world == 1 else [
            torch.empty(size, dtype=torch.float32, device=at_rest.device) for _ in range(at_rest.world)]
        if at_rest.world > 1:
            exchange_pieces(received, send, at_rest.group)
        if mine:
            # The round's subtree, over rank index; the received pieces are ours to add into.
            total = tree_reduce(0, at_rest.world, lambda r: received[r])
            self.tree.add(at_rest.part_of[(unit, mine[2])], total)


def _move_the_rest(model: torch.nn.Module, device: torch.device) -> None:
    """Every parameter and buffer of `model` not on `device` moved there (the units' are
    views of its buffers already)."""
    with torch.no_grad():
        for module in model.modules():
            for param in module.parameters(recurse=False):
                if param.device != device:
                    param.data = param.data.to(device)
            for name, buffer in module.named_buffers(recurse=False):
                if buffer.device != device:
                    module._buffers[name] = buffer.to(device)


def _range_of(params: Sequence[torch.Tensor], layout: FlatLayout, start: int, end: int) -> torch.Tensor:
    """`[start, end)` of the parameters laid end to end, zero past the last (the padding):
    `flatten(...)[start:end]` without the whole vector beside the whole model."""
    out = torch.zeros(end - start, dtype=params[0].dtype, device=params[0].device)
    for offset, p in zip(layout.offsets(), params):
        lo, hi = max(offset, start), min(offset + p.numel(), end)
        if lo < hi:
            out[lo - start : hi - start] = p.detach().reshape(-1)[lo - offset : hi - offset]
    return out


def exchange_slice(shard_size: int) -> int:
    """Elements of an exchange slice (`UnitPlan.exchange_slices`): `MAX_SLICE`, or an 8th of
    a small shard (whole chunks), so that the tests' small models take several too."""
    return min(MAX_SLICE, max(CHUNK, shard_size // 8 // CHUNK * CHUNK))


def shard_parts(slices: Sequence[list[list[tuple[int, int, int] | None]]], rank: int,
                shard_size: int) -> tuple[Parts, dict[tuple[int, int], int]]:
    """The round tree's parts: this rank's shard cut at its slices of the units (`slices[u]`:
    `UnitPlan.exchange_slices(u)`; shard offsets), and the part index of each `(unit, shard offset)`."""
    pieces = sorted((at, at + end - start, unit) for unit, exchanges in enumerate(slices)
                    for cut in exchanges if (mine := cut[rank]) is not None for start, end, at in [mine])
    bounds = [start for start, _, _ in pieces] + ([pieces[-1][1]] if pieces else [0])
    return Parts(tuple(bounds), shard_size), {(unit, start): i for i, (start, _, unit) in enumerate(pieces)}
