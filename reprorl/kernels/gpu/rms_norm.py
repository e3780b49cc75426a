"""Batch-invariant RMSNorm on CUDA: one program per row, the whole row in one block.

A row's sum of squares is one `tl.sum` over a block whose size is fixed by the width H
alone (the next power of two), so its reduction tree never depends on the batch.
Computed as transformers does: y = weight * (x / sqrt(mean(x^2) + eps)).to(x.dtype), in
float32 up to the cast. (Zhang & Sennrich 2019)

The backward (`rms_norm_backward`) is one launch too: each program takes `BACKWARD_ROWS`
consecutive rows, writes their input gradients and its own float32 partial sum of the
weight gradient over them, in row order; the partials are then summed by torch over a
fixed shape. No atomics, so the gradient is the same bits every run (not batch-invariant,
which training does not need).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from reprorl.kernels.gpu.launch import PINNED

MAX_WIDTH = 65536  # one block per row; Qwen3-8B's hidden size is 4096
BACKWARD_ROWS = 32  # rows per backward program: its share of the weight gradient


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_out, H, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / H + eps)
    y = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [..., H], weight [H] -> [..., H] in the dtype of weight * x."""
    h = x.shape[-1]
    if weight.shape != (h,) or h > MAX_WIDTH:
        raise ValueError(f"rms_norm: x {tuple(x.shape)}, weight {tuple(weight.shape)}; expected weight [{h}], "
                         f"width <= {MAX_WIDTH}")
    rows = x.reshape(-1, h)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, rows.stride(0), out.stride(0), h, eps,
                                           BLOCK=triton.next_power_of_2(h), num_warps=4 if h <= 4096 else 8,
                                           **PINNED)
    return out.reshape(x.shape)


@triton.jit
def _rms_norm_backward_kernel(x_ptr, w_ptr, g_ptr, dx_ptr, dw_ptr, M, H, stride_x, stride_g, stride_dx, eps,
                              ROWS: tl.constexpr, BLOCK: tl.constexpr):
    # n = x * rstd, y = w * n.to(x.dtype): dw = sum over rows of g * n (as cast), and
    # dx = rstd * (g w - n * mean(g w n)), the cast taken as the identity (as autograd does).
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), tl.float32)
    for i in range(ROWS):
        row = pid * ROWS + i
        ok = mask & (tl.zeros((BLOCK,), tl.int64) + row < M)  # (a vector: the interpreter takes no scalar mask)
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / H + eps)
        n = x * rstd
        dw += g * n.to(x_ptr.dtype.element_ty).to(tl.float32)
        gw = g * w
        dx = rstd * (gw - n * (tl.sum(gw * n, axis=0) / H))
        tl.store(dx_ptr + row * stride_dx + cols, dx.to(dx_ptr.dtype.element_ty), mask=ok)
    tl.store(dw_ptr + pid * H + cols, dw, mask=mask)


def rms_norm_backward(grad: Tensor, x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The gradients (dx [..., H] in x's dtype, dweight [H] in weight's) of `rms_norm`
    given the output's gradient `grad` [..., H]."""
    h = x.shape[-1]
    rows = x.reshape(-1, h)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    g = grad.reshape(-1, h)
    if g.stride(-1) != 1:
        g = g.contiguous()
    m = rows.shape[0]
    dx = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    programs = triton.cdiv(m, BACKWARD_ROWS)
    partial = torch.empty(programs, h, dtype=torch.float32, device=x.device)
    if m:
        _rms_norm_backward_kernel[(programs,)](rows, weight, g, dx, partial, m, h, rows.stride(0), g.stride(0),
                                               dx.stride(0), eps, ROWS=BACKWARD_ROWS, BLOCK=triton.next_power_of_2(h),
                                               num_warps=4 if h <= 4096 else 8, **PINNED)
    return dx.reshape(x.shape), partial.sum(0).to(weight.dtype)
