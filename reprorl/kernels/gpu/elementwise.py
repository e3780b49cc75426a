"""SiLU-and-mul, GELU-and-mul and rotary embedding on CUDA, fused into one pass each.

Elementwise ops are batch-invariant on any device (an entry's arithmetic never looks at
another entry); these kernels exist to read and write each tensor once. Their backward
passes are element-wise too, one launch each, so deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from reprorl.kernels.cpu_math import GELU_C1, GELU_C3
from reprorl.kernels.gpu.launch import PINNED

BLOCK = 1024
# (token, head) rows of the rotary a program: one row of a 64-wide head is 128 bytes in bf16,
# far too little work for a program (one a row ran at a tenth of the memory bandwidth).
ROTARY_ROWS = 32


@triton.jit
def _swiglu_kernel(gate_ptr, up_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + offs, (silu * u).to(out_ptr.dtype.element_ty), mask=mask)


def _gated(kernel, name: str, gate: Tensor, up: Tensor, **consts) -> Tensor:
    """One launch of a gated activation's forward `kernel` (swiglu's, geglu's) over every entry."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"{name}: gate {tuple(gate.shape)} {gate.dtype}, up {tuple(up.shape)} {up.dtype}")
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    n = gate.numel()
    if n:
        kernel[(triton.cdiv(n, BLOCK),)](gate, up, out, n, **consts, BLOCK=BLOCK, **PINNED)
    return out


def _gated_backward(kernel, grad: Tensor, gate: Tensor, up: Tensor, **consts) -> tuple[Tensor, Tensor]:
    """(d gate, d up) from one launch of a gated activation's backward `kernel`."""
    gate, up, grad = gate.contiguous(), up.contiguous(), grad.contiguous()
    dgate, dup = torch.empty_like(gate), torch.empty_like(up)
    n = gate.numel()
    if n:
        kernel[(triton.cdiv(n, BLOCK),)](gate, up, grad, dgate, dup, n, **consts, BLOCK=BLOCK, **PINNED)
    return dgate, dup


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up: [..., I], [..., I] -> [..., I]. (Shazeer 2020)"""
    return _gated(_swiglu_kernel, "swiglu", gate, up)


@triton.jit
def _swiglu_backward_kernel(gate_ptr, up_ptr, grad_ptr, dgate_ptr, dup_ptr, n, BLOCK: tl.constexpr):
    # d up = grad * silu(g) (rounded as the forward rounds it); d gate = grad * up * silu'(g),
    # silu'(g) = sigmoid(g) * (1 + g * (1 - sigmoid(g))).
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    d = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-g))
    silu = (g / (1.0 + tl.exp(-g))).to(dup_ptr.dtype.element_ty).to(tl.float32)
    tl.store(dup_ptr + offs, (d * silu).to(dup_ptr.dtype.element_ty), mask=mask)
    tl.store(dgate_ptr + offs, (d * u * sig * (1.0 + g * (1.0 - sig))).to(dgate_ptr.dtype.element_ty), mask=mask)


def swiglu_backward(grad: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    """(d gate, d up) of `swiglu` given the output's gradient."""
    return _gated_backward(_swiglu_backward_kernel, grad, gate, up)


# gelu_tanh(g) = g / (1 + e^-z), z = g (C1 + C3 g^2): cpu_math.geglu's form (its comment says why).
@triton.jit
def _geglu_kernel(gate_ptr, up_ptr, out_ptr, n, C1: tl.constexpr, C3: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    gelu = (g / (1.0 + tl.exp(-(g * (g * g * C3 + C1))))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + offs, (gelu * u).to(out_ptr.dtype.element_ty), mask=mask)


def geglu(gate: Tensor, up: Tensor) -> Tensor:
    """gelu_tanh(gate) * up (Gemma's MLP): [..., I], [..., I] -> [..., I]."""
    return _gated(_geglu_kernel, "geglu", gate, up, C1=GELU_C1, C3=GELU_C3)


@triton.jit
def _geglu_backward_kernel(gate_ptr, up_ptr, grad_ptr, dgate_ptr, dup_ptr, n, C1: tl.constexpr, C3: tl.constexpr,
                           BLOCK: tl.constexpr):
    # d up = grad * gelu(g) (rounded as the forward rounds it); d gate = grad * up * gelu'(g),
    # gelu'(g) = s + g s (1 - s) z'(g), s = sigmoid(z), z' = C1 + 3 C3 g^2.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    d = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    e = 1.0 + tl.exp(-(g * (g * g * C3 + C1)))
    sig = 1.0 / e
    gelu = (g / e).to(dup_ptr.dtype.element_ty).to(tl.float32)
    tl.store(dup_ptr + offs, (d * gelu).to(dup_ptr.dtype.element_ty), mask=mask)
    slope = sig + g * sig * (1.0 - sig) * (C1 + 3.0 * C3 * g * g)
    tl.store(dgate_ptr + offs, (d * u * slope).to(dgate_ptr.dtype.element_ty), mask=mask)


def geglu_backward(grad: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    """(d gate, d up) of `geglu` given the output's gradient."""
    return _gated_backward(_geglu_backward_kernel, grad, gate, up, C1=GELU_C1, C3=GELU_C3)


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, R, H, stride_xt, stride_xh, stride_ct, stride_st,
                   D: tl.constexpr, D_BLOCK: tl.constexpr, BLOCK_R: tl.constexpr):
    # BLOCK_R (token, head) rows a program: out = x * cos + roll(x, D/2) * sin_rot, products
    # in x's dtype. Each entry's arithmetic is its own, so the block moves no bit.
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]
    d = tl.arange(0, D_BLOCK)[None, :]
    mask = (r < R) & (d < D)
    t, h = r // H, r % H
    x_row = x_ptr + t * stride_xt + h * stride_xh
    x = tl.load(x_row + d, mask=mask).to(tl.float32)
    rolled = tl.load(x_row + (d + D // 2) % D, mask=mask).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    c = tl.load(cos_ptr + t * stride_ct + d, mask=mask).to(dt).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_st + d, mask=mask).to(dt).to(tl.float32)
    y = (x * c).to(dt).to(tl.float32) + (rolled * s).to(dt).to(tl.float32)
    tl.store(out_ptr + r * D + d, y.to(dt), mask=mask)


def apply_rotary(x: Tensor, cos: Tensor, sin_rot: Tensor) -> Tensor:
    """x [..., H, D], cos/sin_rot [..., D] (one row per token) -> [..., H, D]; see
    `reprorl.kernels.shared.apply_rotary` for the formula."""
    *lead, h, d = x.shape
    if cos.shape != (*lead, d) or sin_rot.shape != cos.shape or d % 2:
        raise ValueError(f"apply_rotary: x {tuple(x.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin_rot.shape)}; "
                         "expected one table row per token and an even rotary dimension")
    return _rotary_launch(_rotary_kernel, x, cos, sin_rot)


def _rotary_launch(kernel, src: Tensor, cos: Tensor, sin_rot: Tensor) -> Tensor:
    """`kernel` (the rotation or its gradient) over src [..., H, D], ROTARY_ROWS (token, head)
    rows a program, into a new tensor of src's shape and dtype. D need not be a power of two
    (phi3 rotates 96 of 128 dimensions): the block is the next one, its tail masked."""
    *_, h, d = src.shape
    rows = src.reshape(-1, h, d)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    c, s = cos.reshape(-1, d).contiguous(), sin_rot.reshape(-1, d).contiguous()
    out = torch.empty(rows.shape, dtype=src.dtype, device=src.device)
    n = rows.shape[0] * h
    if n:
        kernel[(triton.cdiv(n, ROTARY_ROWS),)](rows, c, s, out, n, h, rows.stride(0), rows.stride(1), c.stride(0),
                                               s.stride(0), D=d, D_BLOCK=triton.next_power_of_2(d),
                                               BLOCK_R=ROTARY_ROWS, **PINNED)
    return out.reshape(src.shape)


@triton.jit
def _rotary_backward_kernel(g_ptr, cos_ptr, sin_ptr, dx_ptr, R, H, stride_gt, stride_gh, stride_ct, stride_st,
                            D: tl.constexpr, D_BLOCK: tl.constexpr, BLOCK_R: tl.constexpr):
    # y[i] = x[i] c[i] + x[i + D/2] s[i] (indices mod D), so
    # dx[j] = g[j] c[j] + g[j + D/2] s[j + D/2]: the forward's pattern with sin read rolled.
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]
    d = tl.arange(0, D_BLOCK)[None, :]
    mask = (r < R) & (d < D)
    t, h = r // H, r % H
    rolled = (d + D // 2) % D
    g_row = g_ptr + t * stride_gt + h * stride_gh
    dt = dx_ptr.dtype.element_ty
    g = tl.load(g_row + d, mask=mask).to(tl.float32)
    g_rolled = tl.load(g_row + rolled, mask=mask).to(tl.float32)
    c = tl.load(cos_ptr + t * stride_ct + d, mask=mask).to(dt).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_st + rolled, mask=mask).to(dt).to(tl.float32)
    tl.store(dx_ptr + r * D + d, (g * c + g_rolled * s).to(dt), mask=mask)


def apply_rotary_backward(grad: Tensor, x: Tensor, cos: Tensor, sin_rot: Tensor) -> Tensor:
    """d x of `apply_rotary` given the output's gradient (the tables take none)."""
    return _rotary_launch(_rotary_backward_kernel, grad.to(x.dtype), cos, sin_rot)
