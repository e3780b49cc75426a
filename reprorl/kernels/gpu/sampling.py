"""A batch-invariant running sum over each row, for sampling on the GPU.

Inverse-CDF sampling (`reprorl.rollout.sampling`) needs each row's cumulative probability
over the vocabulary, and top-p the cumulative mass of the sorted probabilities. torch's
CUDA `cumsum` makes no promise that a row's sums do not depend on the tensor's shape, so
this kernel fixes the order: one program per row walks the row in blocks of BLOCK (a
constant), scans each block with `tl.cumsum` (a tree fixed by BLOCK and the warp count)
and adds the running total of the blocks before it, taken from the previous block's last
entry. A row's result is therefore a function of that row alone, and the last entry of
each row is exactly its largest (the scan is monotone for non-negative inputs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 2048
NUM_WARPS = 8


@triton.jit
def _row_cumsum_kernel(x_ptr, out_ptr, stride_x, stride_out, V, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    running = tl.sum(tl.zeros((BLOCK,), tl.float32), axis=0)
    for start in range(0, V, BLOCK):
        cols = start + offs
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < V, other=0.0).to(tl.float32)
        c = tl.cumsum(x, axis=0) + running
        tl.store(out_ptr + row * stride_out + cols, c, mask=cols < V)
        # The block's last entry (masked tail entries add exact zeros) carries on.
        running = tl.sum(tl.where(offs == BLOCK - 1, c, 0.0), axis=0)


def row_cumsum(x: Tensor) -> Tensor:
    """Inclusive running sum over the last dim: [B, V] -> [B, V] float32, each row on its own."""
    if x.dim() != 2:
        raise ValueError(f"row_cumsum: expected [B, V], got {tuple(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    if x.numel():
        _row_cumsum_kernel[(x.shape[0],)](x, out, x.stride(0), out.stride(0), x.shape[1], BLOCK=BLOCK,
                                          num_warps=NUM_WARPS)
    return out
