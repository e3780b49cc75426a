"""Stock torch: the fastest kernels on any device, and no promise about batching.

A row's bits may change with the rows around it (BLAS kernels picked by M, split-K, flash
attention's tiles); use it with `full_determinism: false`. Same interface as every backend
(see `reprorl.kernels`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from reprorl.kernels.shared import Padding, apply_rotary, check_batched_attention, check_window, scale_logits, seen_keys


def math_attention(q: Tensor, k: Tensor, v: Tensor, q_start: Tensor, window: int = 0, *,
                   matmul: Callable[[Tensor, Tensor], Tensor] = torch.matmul,
                   softmax: Callable[[Tensor], Tensor] = functools.partial(torch.softmax, dim=-1)) -> Tensor:
    """`batched_attention` written as plain matmuls and a softmax: the differentiable form
    the invariant backends take their gradient from (its backward is deterministic, where
    SDPA's fused backward kernels may not be). Memory O(Tq * Tk) per head. `matmul`: the
    two products ([..., M, K] @ [..., K, N], differentiable), stock torch's by default;
    `softmax`: over the last dim (differentiable), torch's by default. `window`: as
    `batched_attention`'s."""
    check_batched_attention(q, k, v, q_start, window)
    b, hq, tq, d = q.shape
    hkv = k.shape[1]
    rows = q.reshape(b, hkv, (hq // hkv) * tq, d)  # [B, Hkv, G*Tq, D]: row g*Tq + t
    pos = q_start[:, None] + torch.arange(tq, device=q.device).repeat(hq // hkv)  # [B, G*Tq]
    masked = ~seen_keys(pos[:, None, :], k.shape[2], window)  # [B, 1, G*Tq, Tk]
    scores = matmul(rows, k.transpose(-1, -2)).float() * d**-0.5  # [B, Hkv, R, Tk]
    probs = softmax(scores.masked_fill(masked, float("-inf"))).to(v.dtype)
    return matmul(probs, v).reshape(b, hq, tq, d)


def _sdpa(q: Tensor, k: Tensor, v: Tensor, **mask: object) -> Tensor:
    """torch's fused attention (GQA), [B, H, T, D]; `mask`: attn_mask= or is_causal=.

    Its math backend for bfloat16 on a CPU that runs torch's portable kernels
    (`ATEN_CPU_CAPABILITY=default`, as every full-determinism process does): there torch
    2.13's flash kernel still takes its AMX packing path on a CPU with AMX (Sapphire Rapids
    and later), which the portable build lacks, and raises "pack_vnni2 is only supported
    when avx512 is supported". The math backend computes the same attention unfused."""
    if q.dtype == torch.bfloat16 and q.device.type == "cpu" and _portable_cpu_kernels():
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **mask)
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **mask)


@functools.cache
def _portable_cpu_kernels() -> bool:
    """Whether this process runs torch's portable CPU kernels (fixed at its first CPU kernel)."""
    return torch.backends.cpu.get_cpu_capability() == "DEFAULT"


class TorchKernels:
    name = "torch"
    batch_invariant = False

    apply_rotary = staticmethod(apply_rotary)

    @staticmethod
    def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        """`x @ weight.T + bias`: x [..., K], weight [N, K], bias [N] | None -> [..., N]."""
        return F.linear(x, weight, bias)

    @staticmethod
    def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
        """RMSNorm over the last dim in float32, as transformers: weight * (x / rms(x)).to(x.dtype).
        x [..., H], weight [H] -> [..., H]. (Zhang & Sennrich 2019)"""
        return weight * torch.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)

    @staticmethod
    def swiglu(gate: Tensor, up: Tensor) -> Tensor:
        """silu(gate) * up: [..., I], [..., I] -> [..., I]. (Shazeer 2020)"""
        return F.silu(gate) * up

    @staticmethod
    def geglu(gate: Tensor, up: Tensor) -> Tensor:
        """gelu_tanh(gate) * up (Gemma's MLP, transformers' `gelu_pytorch_tanh`): [..., I] x2 -> [..., I]."""
        return F.gelu(gate, approximate="tanh") * up

    @staticmethod
    def softmax(x: Tensor) -> Tensor:
        """Softmax over the last dim in float32: [..., V] -> [..., V] float32."""
        return torch.softmax(x.float(), dim=-1)

    @staticmethod
    def log_softmax(x: Tensor) -> Tensor:
        """Log-softmax over the last dim in float32: [..., V] -> [..., V] float32."""
        return torch.log_softmax(x.float(), dim=-1)

    @staticmethod
    def entropy(log_probs: Tensor) -> Tensor:
        """Entropy of each row's distribution from its log-probabilities (a log_softmax's
        output): -sum exp(y) * y over the last dim, [..., V] -> [...] float32."""
        return -(log_probs.exp() * log_probs).sum(dim=-1)

    @classmethod
    def token_log_probs(cls, logits: Tensor, tokens: Tensor, temperature: float, with_entropy: bool = False
                        ) -> tuple[Tensor, Tensor | None]:
        """`log_softmax(logits / T)` at `tokens` and (`with_entropy`) each row's entropy:
        logits [..., V], tokens [...] -> ([...] float32, [...] float32 or None); T <= 0
        counts as 1. Built from the backend's own log_softmax and entropy, so a log-prob
        is the bits of its log-softmax at the token."""
        log_p = cls.log_softmax(scale_logits(logits, temperature))
        log_probs = log_p.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        return log_probs, (cls.entropy(log_p) if with_entropy else None)

    @staticmethod
    def batched_attention(q: Tensor, k: Tensor, v: Tensor, q_start: Tensor, window: int = 0) -> Tensor:
        """Causal GQA attention of B sequences (see `reprorl.kernels`): q [B, Hq, Tq, D] at
        positions q_start[b]..; k/v [B, Hkv, Tk, D]; keys past a query's position are masked,
        and with a window W > 0 keys before position - W + 1 too."""
        check_batched_attention(q, k, v, q_start, window)
        b, hq, tq, d = q.shape
        if b == 0 or tq == 0:
            return q.new_zeros(b, hq, tq, d)
        nk = min(int(q_start.max()) + tq, k.shape[2])
        pos = q_start[:, None] + torch.arange(tq, device=q.device)  # [B, Tq]
        allowed = seen_keys(pos[:, None, :], nk, window)  # [B, 1, Tq, nk]
        return _sdpa(q, k[:, :, :nk], v[:, :, :nk], attn_mask=allowed)

    @staticmethod
    def padded_attention(q: Tensor, k: Tensor, v: Tensor, padding: Padding | Tensor | None,
                         window: int = 0) -> Tensor:
        """Causal attention of a padded batch: q [B, T, Hq, D], k/v [B, T, Hkv, D], padding: a
        `Padding` or its mask [B, T] -> [B, T, Hq, D]; outputs at padding positions are not
        meaningful. With a window W > 0 a token sees the last W real tokens up to itself."""
        check_window(window)
        padding = Padding.of(padding)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T, D]
        if padding.mask is not None:
            mask = padding.sdpa_mask(window)  # [B, 1, T, T]
        elif window:
            mask = seen_keys(torch.arange(q.shape[2], device=q.device), q.shape[2], window)  # [T, T]
        else:
            return _sdpa(q, k, v, is_causal=True).transpose(1, 2)
        return _sdpa(q, k, v, attn_mask=mask).transpose(1, 2)
