"""Optimizer offload (`actor.optimizer_offload`, `critic.optimizer_offload`): a trainable
rank's float32 master weights, AdamW moments and gradient sums in host memory, its GPU
holding the model's weights in their compute dtype and one part's gradient at a time.

What moves where, each optimizer step:
- The backward pass hands each parameter's gradient to the gradient tree (grad_tree.py)
  as soon as it is final; with offload every pending and running sum of the tree, the root
  too, is in host memory, so a part's gradient is copied to the host (asynchronously, into
  page-locked `HostVectors`) while the backward pass goes on, and the GPU never holds a
  whole gradient vector. A pending sum that a later leaf adds to comes back part by part
  and is added on the GPU, as without offload.
- The norm's chunk sums and the AdamW step run on the host, on all its cores
  (`host_threads`), by the C++ kernels of kernels/optim_math.py.
- The new master is cast to the compute dtype on the host and copied into the model's
  weights on the GPU a slice at a time (`publish_from_host`).

Why no bit changes: the tree's additions are the same float32 additions in the same order
(copies move no bit); optim_math's AdamW and chunk sums are single-rounding steps with the
same results on the host and on a GPU (tests/kernels/test_optim_math.py); the cast to bf16
rounds to nearest even on both; and the host's thread count moves no bit of element-wise
work. So a run with offload compares identical to one without.

One GPU per trainable group: the gradient's reduce-scatter over several GPUs' ranks would
need device copies of the host sums (config/checks.py refuses offload on CUDA with
`trainer.num_workers` > 1). On the CPU the host is the device: offload moves nothing and
checks the path.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist

from reprorl.workers.flat import FlatLayout, all_gather_shards

logger = logging.getLogger(__name__)

PUBLISH_SLICE = 1 << 26
"""Elements of the master cast and copied to the GPU at a time by `publish_from_host` (128 MiB in bf16)."""


def host_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@contextlib.contextmanager
def host_threads(on: bool) -> Iterator[None]:
    """Within the block, torch (and the host kernels, which take its thread pool) on every
    core when `on`; the rank's own thread count again after it. Element-wise kernels and
    per-row sums compute each output on one thread, so the count moves no bit."""
    if not on:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(host_cores())
    try:
        yield
    finally:
        torch.set_num_threads(before)


class HostVectors:
    """float32 vectors in host memory for a `GradTree`'s sums, kept and reused from one
    optimizer step to the next (at most `grad_tree.max_pending` of them are taken at once).

    On a CUDA device each is page-locked once by `cudaHostRegister`, so the gradients' copies
    into it run while the GPU computes. Not torch's pinned allocator: it rounds a request up
    to a power of two (a 7B model's 28.4 GiB vector would take 32) and keeps freed blocks
    pinned. Where registering fails the vector stays pageable (the copies then wait), with a
    warning."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.vectors: list[torch.Tensor] = []
        self.free: list[torch.Tensor] = []

    def take(self, size: int) -> torch.Tensor:
        """A free vector of `size` elements (contents undefined), made the first time."""
        for i, vector in enumerate(self.free):
            if vector.numel() == size:
                return self.free.pop(i)
        vector = torch.empty(size, dtype=torch.float32)
        if self.device.type == "cuda":
            _register(vector)
        self.vectors.append(vector)
        return vector

    def give(self, vector: torch.Tensor) -> None:
        """`vector` free again (the GPU's pending copies from it come first: they are on its stream)."""
        self.free.append(vector)

    def reset(self) -> None:
        """Every vector free again (the step that took them is over)."""
        self.free = list(self.vectors)

    def release(self) -> None:
        """Unregister and drop every vector (the worker is shutting down)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            for vector in self.vectors:
                torch.cuda.cudart().cudaHostUnregister(vector.data_ptr())
        self.vectors, self.free = [], []


def _register(vector: torch.Tensor) -> None:
    code = torch.cuda.cudart().cudaHostRegister(vector.data_ptr(), vector.numel() * vector.element_size(), 0)
    if int(code) != 0:
        logger.warning("optimizer offload: page-locking %.1f GiB of host memory failed (CUDA error %s); its copies "
                       "will wait for the GPU", vector.numel() * vector.element_size() / 2**30, int(code))


def publish_from_host(shard: torch.Tensor, flat: torch.Tensor, layout: FlatLayout, rank: int,
                      group: dist.ProcessGroup) -> None:
    """The host's float32 master `shard` cast to the model's dtype into the model's flat
    vector `flat` (`_publish_master` without offload, the same bits): on a GPU a slice at a
    time, cast on the host (round to nearest even, as the GPU's cast) and copied over; on the
    CPU, where the host is the device, the all-gather of every rank's shard."""
    if flat.device.type == "cpu":
        all_gather_shards(shard.to(flat.dtype), flat, layout, group)
        return
    if layout.world_size != 1:
        raise RuntimeError("optimizer offload on a GPU takes one rank per group (config/checks.py refuses more)")
    start = layout.shard_range(rank)[0]
    for a in range(0, shard.numel(), PUBLISH_SLICE):
        piece = shard[a : a + PUBLISH_SLICE].to(flat.dtype)
        flat[start + a : start + a + piece.numel()].copy_(piece)
