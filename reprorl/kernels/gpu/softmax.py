"""Batch-invariant softmax and log-softmax over the last dim on CUDA, up to any width
(a 152k vocabulary): one program per row.

The row is read in blocks of `stats_block(V)` (a width fixed by V alone); each lane keeps
its running max and its sum of exps (rescaled when the max grows), and the lanes are
combined once at the end by a fixed pairwise tree (`tree_sum`; all in `row_softmax.py`).
The order of every sum is a function of V alone: never of the batch, nor of how the
compiler lays a block out over threads (which sets `tl.sum`'s order), so another kernel
that loads the same row values another way (the engine's sampler reads bf16 logits and
divides by the temperature itself, `sampling.py`) gets the same row statistics
(`row_stats`), bit for bit. Results are float32.

The log-softmax's backward (`log_softmax_backward`) reads the forward's output instead of
recomputing it: dx = g - exp(y) * sum(g), the row sum in the same fixed lanes-then-tree
order. No atomics: the same bits every run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from reprorl.kernels.gpu.launch import PINNED
from reprorl.kernels.gpu.row_softmax import contiguous_rows, lane_update, row_launch, row_stats, tree_sum


@triton.jit
def _softmax_kernel(x_ptr, out_ptr, stride_x, stride_out, V, LOG: tl.constexpr, BLOCK: tl.constexpr,
                    LOG2_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    out_row = out_ptr + row * stride_out
    m = tl.full((BLOCK,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m, s = lane_update(m, s, x)
    m_row, s_row = row_stats(m, s, LOG2_BLOCK)
    log_z = m_row + tl.log(s_row)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        if LOG:
            y = x - log_z
        else:
            y = tl.exp(x - m_row) / s_row
        tl.store(out_row + cols, y, mask=cols < V)


@triton.jit
def _log_softmax_backward_kernel(y_ptr, g_ptr, dx_ptr, stride_y, stride_g, stride_dx, V, BLOCK: tl.constexpr,
                                 LOG2_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    acc = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        acc += tl.load(g_ptr + row * stride_g + cols, mask=cols < V, other=0.0).to(tl.float32)
    total = tree_sum(acc, LOG2_BLOCK)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        g = tl.load(g_ptr + row * stride_g + cols, mask=cols < V, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + row * stride_y + cols, mask=cols < V, other=0.0)
        tl.store(dx_ptr + row * stride_dx + cols, (g - tl.exp(y) * total).to(dx_ptr.dtype.element_ty), mask=cols < V)


@triton.jit
def _entropy_kernel(y_ptr, out_ptr, stride_y, V, BLOCK: tl.constexpr, LOG2_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    acc = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        y = tl.load(y_ptr + row * stride_y + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        acc += tl.where(y > float("-inf"), tl.exp(y) * y, 0.0)  # a zero probability adds nothing
    tl.store(out_ptr + row, -tree_sum(acc, LOG2_BLOCK))


def entropy(log_probs: Tensor) -> Tensor:
    """-sum exp(y) y over the last dim of log-probabilities y [..., V] -> [...] float32, in
    one read of y (the torch formula makes two full-size temporaries)."""
    y = contiguous_rows(log_probs)
    out = torch.empty(y.shape[0], dtype=torch.float32, device=y.device)
    v = y.shape[-1]
    if y.shape[0] and v:
        _entropy_kernel[(y.shape[0],)](y, out, y.stride(0), v, **row_launch(v), **PINNED)
    elif y.shape[0]:
        out.zero_()
    return out.reshape(log_probs.shape[:-1])


def log_softmax_backward(grad: Tensor, out: Tensor, x: Tensor) -> Tensor:
    """d x [..., V] (in x's dtype) of `log_softmax(x)` = `out` [..., V] float32, given the
    output's gradient `grad`."""
    y, g = contiguous_rows(out), contiguous_rows(grad)
    dx = torch.empty(y.shape, dtype=x.dtype, device=x.device)
    v = y.shape[-1]
    if y.shape[0] and v:
        _log_softmax_backward_kernel[(y.shape[0],)](y, g, dx, y.stride(0), g.stride(0), dx.stride(0), v,
                                                    **row_launch(v), **PINNED)
    return dx.reshape(x.shape)


def _launch(x: Tensor, log: bool) -> Tensor:
    v = x.shape[-1]
    rows = contiguous_rows(x)
    out = torch.empty(rows.shape, dtype=torch.float32, device=x.device)
    if rows.shape[0] and v:
        _softmax_kernel[(rows.shape[0],)](rows, out, rows.stride(0), out.stride(0), v, LOG=log, **row_launch(v),
                                          **PINNED)
    return out.reshape(x.shape)


def softmax(x: Tensor) -> Tensor:
    """[..., V] -> [..., V] float32."""
    return _launch(x, log=False)


def log_softmax(x: Tensor) -> Tensor:
    """[..., V] -> [..., V] float32."""
    return _launch(x, log=True)
