"""Batch-invariant softmax and log-softmax over the last dim on CUDA, up to any width
(a 152k vocabulary): one program per row.

The row is read in blocks of a width fixed by V alone; each lane keeps its running max and
its sum of exps (rescaled when the max grows), and the lanes are combined once at the end.
The order of every sum is a function of V, never of the batch. Results are float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _softmax_kernel(x_ptr, out_ptr, stride_x, stride_out, V, LOG: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    out_row = out_ptr + row * stride_out
    m = tl.full((BLOCK,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        seen = m_new > float("-inf")  # a lane that has met only -inf keeps s = 0 (no inf - inf)
        s = tl.where(seen, s * tl.exp(m - m_new) + tl.exp(x - m_new), 0.0)
        m = m_new
    m_row = tl.max(m, axis=0)
    s_row = tl.sum(tl.where(m > float("-inf"), s * tl.exp(m - m_row), 0.0), axis=0)
    log_z = m_row + tl.log(s_row)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        if LOG:
            y = x - log_z
        else:
            y = tl.exp(x - m_row) / s_row
        tl.store(out_row + cols, y, mask=cols < V)


def _launch(x: Tensor, log: bool) -> Tensor:
    v = x.shape[-1]
    rows = x.reshape(-1, v)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.float32, device=x.device)
    if rows.shape[0] and v:
        block = min(4096, triton.next_power_of_2(v))
        _softmax_kernel[(rows.shape[0],)](rows, out, rows.stride(0), out.stride(0), v, LOG=log, BLOCK=block,
                                          num_warps=8 if block >= 2048 else 4)
    return out.reshape(x.shape)


def softmax(x: Tensor) -> Tensor:
    """[..., V] -> [..., V] float32."""
    return _launch(x, log=False)


def log_softmax(x: Tensor) -> Tensor:
    """[..., V] -> [..., V] float32."""
    return _launch(x, log=True)
