"""A weight push as flat buffers: on the host through Ray's object store, or on the GPU
through CUDA IPC when the trainer and the replica share that GPU.

- `PackedWeights`: every tensor of a push in one flat 1-D buffer per dtype, plus the
  entries `(name, dtype name, shape, offset)` that cut it back into tensors. On the host
  it is one object in Ray's store and one host-to-device copy per dtype in the replica.
- `SharedWeights`: the same entries and a CUDA IPC handle of each buffer of a
  `PackedWeights` that lives on the trainer's GPU (`share`). It is a small object (no
  tensor data): the replica on the same physical GPU `open`s it and copies device to
  device into its parameters.

CUDA IPC rules these follow (torch's multiprocessing notes; verl and OpenRLHF do the same
for a colocated vLLM):
- The memory stays the producer's: it must keep the buffer alive until every consumer has
  finished copying (the trainer frees it only after every replica answered).
- torch counts references across processes per share: each consumer gets its OWN share
  (`share(packed, n)` makes n), opens it once and drops it when done. A share opened
  twice, or by two processes, breaks the count and the producer's block is never freed.
- The copies a consumer enqueues read the producer's memory: it synchronizes before
  dropping the handle (`SharedWeights.open`'s caller does, see RolloutReplica).
- The producer synchronizes after packing, so the buffer is complete when handed out.
- A handle names the producer's device index, which is the consumer's only when both see
  the GPU under the same index; `open` swaps in its own device after checking that the
  GPU's UUID is the producer's (a handle of another GPU cannot be opened).
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch


def _dtype_key(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class PackedWeights:
    """A weight push as one flat buffer per dtype instead of a list of tensors.

    `entries[i] = (name, dtype name, shape, offset)` into `buffers[dtype name]` (1-D)."""

    entries: tuple[tuple[str, str, tuple[int, ...], int], ...]
    buffers: dict[str, torch.Tensor]

    @classmethod
    def pack(cls, named_tensors: Iterable[tuple[str, torch.Tensor]],
             device: torch.device | str = "cpu") -> PackedWeights:
        """Copy the tensors into new buffers on `device` (the host for Ray's store, the GPU to share)."""
        tensors = list(named_tensors)
        packed = cls.empty(tensors, device)
        packed.write(tensors)
        return packed

    @classmethod
    def empty(cls, named_tensors: Iterable[tuple[str, torch.Tensor]],
              device: torch.device | str = "cpu") -> PackedWeights:
        """Buffers on `device` with a place for each tensor, not yet written (`write`): only the
        tensors' shapes and dtypes are read, so their storage may be elsewhere or freed."""
        sizes: dict[str, int] = {}
        entries, dtypes = [], {}
        for name, t in named_tensors:
            key = _dtype_key(t.dtype)
            dtypes[key] = t.dtype
            entries.append((name, key, tuple(t.shape), sizes.get(key, 0)))
            sizes[key] = sizes.get(key, 0) + t.numel()
        buffers = {key: torch.empty(size, dtype=dtypes[key], device=device) for key, size in sizes.items()}
        return cls(tuple(entries), buffers)

    def write(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy each named tensor into its place (any subset, in any order)."""
        where = {name: (key, offset) for name, key, _, offset in self.entries}
        for name, t in named_tensors:
            key, offset = where[name]
            self.buffers[key][offset : offset + t.numel()].copy_(t.detach().reshape(-1))

    def unpack(self, device: torch.device | str = "cpu") -> list[tuple[str, torch.Tensor]]:
        """(name, view of the buffer moved to `device`) per tensor, in push order."""
        moved = {key: buf.to(device) for key, buf in self.buffers.items()}
        return [(name, moved[key][offset : offset + math.prod(shape)].view(shape))
                for name, key, shape, offset in self.entries]

    @property
    def names(self) -> frozenset[str]:
        return frozenset(name for name, *_ in self.entries)


def gpu_uuid(device: torch.device | str) -> str:
    """The physical GPU's UUID: the same in every process that sees it, whatever its index there."""
    return str(torch.cuda.get_device_properties(torch.device(device)).uuid)


@functools.cache
def _device_arg() -> int:
    """Where the args of `reduce_tensor`'s (rebuild_cuda_tensor, args) name the device."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return list(inspect.signature(rebuild_cuda_tensor).parameters).index("storage_device")


@dataclass(frozen=True)
class SharedWeights:
    """CUDA IPC handles of a `PackedWeights` on a GPU, for one consumer process.

    `handles[dtype name] = (rebuild function, args)` as `reduce_tensor` gives them: plain
    data (bytes, ints, classes), so Ray carries the object without opening anything."""

    entries: tuple[tuple[str, str, tuple[int, ...], int], ...]
    handles: dict[str, tuple[Any, tuple]]
    gpu_uuid: str

    @property
    def names(self) -> frozenset[str]:
        return frozenset(name for name, *_ in self.entries)

    def open(self, device: torch.device | str) -> PackedWeights:
        """The producer's buffers mapped into this process on `device` (no copy). Open once;
        drop every tensor of the result after the copies from it are synchronized."""
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"SharedWeights.open: device {device}; CUDA IPC needs a cuda device")
        here = gpu_uuid(device)
        if here != self.gpu_uuid:
            raise ValueError(f"SharedWeights.open: this process's {device} is GPU {here}, the weights are on GPU "
                             f"{self.gpu_uuid}; CUDA IPC reaches only the same GPU (push through the host)")
        index = device.index if device.index is not None else torch.cuda.current_device()
        buffers = {}
        for key, (rebuild, args) in self.handles.items():
            args = list(args)
            args[_device_arg()] = index
            buffers[key] = rebuild(*args)
        return PackedWeights(self.entries, buffers)


def share(packed: PackedWeights, consumers: int) -> list[SharedWeights]:
    """`consumers` shares of `packed` (on a GPU), one per consumer process: torch counts
    each share's references on its own (module doc). Keep `packed` alive until every
    consumer has finished with its share."""
    from torch.multiprocessing.reductions import reduce_tensor

    devices = {buf.device for buf in packed.buffers.values()}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        raise ValueError(f"share: the buffers are on {sorted(map(str, devices))}; expected one cuda device")
    device = devices.pop()
    torch.cuda.synchronize(device)  # the packing copies are done before anyone reads the buffers
    uuid = gpu_uuid(device)
    return [SharedWeights(packed.entries, {key: reduce_tensor(buf) for key, buf in packed.buffers.items()}, uuid)
            for _ in range(consumers)]
