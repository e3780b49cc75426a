"""The optimizer's element-wise arithmetic with the same bits on every device: AdamW's step
and the gradient norm's per-chunk sums of squares.

Each step below is one IEEE operation (a multiply, an add, a divide or a square root),
rounded once, and nothing is fused: on the host the C++ kernels (csrc/cpu_optim.cpp, built
without contraction) compute them, on any other device torch's ops do, one kernel each, so
no multiply-add is contracted there either. A float32 master and its moments stepped on the
GPU and the same state stepped on the host (`actor.optimizer_offload`) therefore end with the
same bits, and so do a CPU run and a GPU run given the same gradients.

torch's own AdamW does not promise that: its `lerp`, `addcmul` and `addcdiv` are free to fuse
(CUDA's compiler contracts `a + w * b` into one fused multiply-add, the host's vector code may
not), and its CPU square root is MKL's vector math, whose bits differ between CPUs.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch
from torch import Tensor

from reprorl.kernels.build import extension


def f32(x: float) -> float:
    """x rounded to the nearest float32 (as a Python float): what a float32 kernel computes with."""
    return struct.unpack("f", struct.pack("f", x))[0]


@dataclass(frozen=True)
class AdamWScalars:
    """The scalars of one AdamW step, each already a float32 value (`f32`), so the host's
    kernel and torch's ops compute with the same ones."""

    grad_scale: float
    """The gradient's factor (the clipping's; 1.0: none, and x * 1.0 is x)."""
    decay: float
    """1 - lr * weight_decay (decoupled weight decay)."""
    beta1: float
    rest1: float
    """1 - beta1."""
    beta2: float
    rest2: float
    """1 - beta2."""
    bias2: float
    """The square root of beta2's bias correction, sqrt(1 - beta2^step)."""
    eps: float
    step_size: float
    """lr / (1 - beta1^step)."""

    @classmethod
    def of(cls, *, lr: float, betas: tuple[float, float], eps: float, weight_decay: float, grad_scale: float,
           bias1: float, bias2: float) -> AdamWScalars:
        """From the step's float64 values (the bias corrections 1 - beta^step computed by the caller)."""
        beta1, beta2 = betas
        return cls(grad_scale=f32(grad_scale), decay=f32(1 - lr * weight_decay), beta1=f32(beta1), rest1=f32(1 - beta1),
                   beta2=f32(beta2), rest2=f32(1 - beta2), bias2=f32(bias2), eps=f32(eps), step_size=f32(lr / bias1))

    def as_list(self) -> list[float]:
        return [self.grad_scale, self.decay, self.beta1, self.rest1, self.beta2, self.rest2, self.bias2, self.eps,
                self.step_size]


def adamw_step_(p: Tensor, g: Tensor, m: Tensor, v: Tensor, s: AdamWScalars) -> None:
    """One AdamW step of the float32 vectors p (in place) and its moments m, v (in place) from
    the gradient g (read only), the same bits on every device: the host's kernel on CPU
    tensors, `adamw_torch` elsewhere."""
    for name, t in (("g", g), ("m", m), ("v", v)):
        if t.shape != p.shape or t.device != p.device:
            raise ValueError(f"adamw_step_: {name} is {tuple(t.shape)} on {t.device}, p {tuple(p.shape)} on {p.device}")
    if p.device.type == "cpu":
        for name, t in (("p", p), ("g", g), ("m", m), ("v", v)):
            if t.dtype != torch.float32 or not t.is_contiguous():
                raise ValueError(f"adamw_step_: {name} must be contiguous float32 on the host, got {t.dtype}"
                                 f"{'' if t.is_contiguous() else ', not contiguous'}")
        extension().adamw_step(p, g, m, v, s.as_list())
    else:
        adamw_torch(p, g, m, v, s)


def adamw_torch(p: Tensor, g: Tensor, m: Tensor, v: Tensor, s: AdamWScalars) -> None:
    """`adamw_step_` as torch ops, one rounding each (the host's kernel, line for line):
        g' = g * scale;  p = p * decay
        m = m * beta1 + g' * (1 - beta1);  v = v * beta2 + (g' * g') * (1 - beta2)
        p = p - (m / (sqrt(v) / bias2 + eps)) * step_size
    On the CPU its square root is torch's (MKL's): the bits are the kernel's only where that
    is IEEE's; the CPU takes the kernel (`adamw_step_`)."""
    g = g * s.grad_scale
    p.mul_(s.decay)
    m.mul_(s.beta1).add_(g * s.rest1)
    v.mul_(s.beta2).add_((g * g).mul_(s.rest2))
    # A divisor on the device: torch's CUDA division by a Python scalar multiplies by its
    # reciprocal instead (two roundings), which the host's kernel does not.
    bias2 = torch.tensor(s.bias2, dtype=torch.float32, device=v.device)
    denom = torch.sqrt(v).div_(bias2).add_(s.eps)
    p.sub_(m.div(denom).mul_(s.step_size))


SUM_ROWS = 1 << 12
"""Chunks summed at once by `chunk_sums_of_squares` on a device (its temporaries: this many chunks)."""


def chunk_sums_of_squares(x: Tensor, width: int) -> Tensor:
    """The float32 sum of squares of each `width`-entry chunk of the float32 vector x (width a
    power of two dividing x's length), the same bits on every device: the squares, then
    entry i takes entry i + w for w = width / 2, width / 4, ..., 1. The host's kernel on a
    CPU tensor; torch's ops elsewhere, `SUM_ROWS` chunks at a time."""
    if x.numel() % width:
        raise ValueError(f"chunk_sums_of_squares: {x.numel()} entries are not whole chunks of {width}")
    if x.device.type == "cpu":
        return extension().chunk_sums_of_squares(x.contiguous(), width)
    rows = x.view(-1, width)
    return torch.cat([_halving_sums(rows[r : r + SUM_ROWS]) for r in range(0, len(rows), SUM_ROWS)]) \
        if len(rows) else rows.new_zeros(0)


def _halving_sums(rows: Tensor) -> Tensor:
    s = rows * rows
    w = rows.shape[1]
    while w > 1:
        w //= 2
        s = s[:, :w] + s[:, w:]
    return s[:, 0]
