"""Batch-invariant kernels for any CPU.

Each output row depends only on that row's inputs: not on how many rows are in the call,
where the row sits, what the other rows hold, or the number of threads. How:

- matmul (linear, and attention's two products): our own kernels (`cpu_matmul.cpp`), not a
  BLAS. A BLAS picks its kernels, its edge paths and its thread split from the call's shape
  and the machine: padding M to MKL's kernel quanta held on an AMD EPYC and failed on an
  Intel Xeon, and even fixed-shape single-threaded MKL calls gave a row different bits at
  places 0 and 1 of a tile there. Our kernels write each entry's arithmetic out as one
  fixed sequence of fused multiply-adds (a @ b^T: 8 lane sums in k order with AVX2, 16
  with AVX-512, then a fixed tree; a @ b: one running sum in k order), so vectorisation,
  blocking and threads cannot change a bit.
- attention: scores and p v are such products; a row's keys past its position get
  probability exactly 0, so extra keys add exact zeros.
- sums over the last dim (RMSNorm over a hidden size, log-softmax over a vocabulary,
  softmax over keys): torch's fused `rms_norm`, `log_softmax` and `softmax` reduce each row
  on its own, vector lane by index, in an order set by the width; attention's scores are
  padded with -inf to whole KEY_BLOCKs, which adds exact zeros to whole lanes.
- SiLU from exp and IEEE ops: `F.silu` is NOT position-invariant on the CPU (its vector
  and scalar-tail paths round differently).
- +, -, *, /, sqrt, max and gathers are exact, so they never depend on the batch.

The matmul kernels are a small C++ extension built on first use for this machine
(-march=native; about 30 s, then cached by torch in ~/.cache/torch_extensions); it needs a
C++ compiler and ninja.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from reprorl.kernels.autograd import linear_with_matmul_backward, with_torch_backward
from reprorl.kernels.shared import KEY_BLOCK, apply_rotary, check_batched_attention, padded_as_sequences
from reprorl.kernels.torch_ops import TorchKernels, math_attention

logger = logging.getLogger(__name__)

# `batched_attention` takes queries in blocks of KEY_BLOCK (bounds the [rows, keys] score
# matrix, and a causal prefill's early blocks see only their keys: 3/4 of the products at
# 256 tokens, about half at 4096) and
# sequences in groups whose score matrix holds at most SCORE_ELEMENTS entries (16 MiB of
# float32): memory stays bounded, and no row's bits depend on the block or the group.
QUERY_BLOCK = KEY_BLOCK
SCORE_ELEMENTS = 1 << 22


@functools.cache
def _matmuls():
    from torch.utils.cpp_extension import load

    source = Path(__file__).with_name("cpu_matmul.cpp")
    logger.info("building reprorl's CPU matmul kernels (%s), once per machine, about 30 s", source.name)
    try:
        return load(name="reprorl_cpu_matmul", sources=[str(source)], verbose=False,
                    extra_cflags=["-O3", "-march=native", "-fno-fast-math", "-ffp-contract=off", "-fopenmp"],
                    extra_ldflags=["-fopenmp"])
    except Exception as e:  # a missing compiler surfaces as several exception types
        raise RuntimeError(
            f"full_determinism on the CPU needs reprorl's matmul kernels ({source}), built with a C++ "
            f"compiler and ninja (pip install ninja; apt-get install g++); building them failed: {e}"
        ) from e


def matmul_nt(a: Tensor, b: Tensor) -> Tensor:
    """a [G, M, K] @ b [G, N, K]^T -> float32 [G, M, N], each entry independent of the rest."""
    return _matmuls().mm_nt(a, b)


def matmul_nn(a: Tensor, b: Tensor) -> Tensor:
    """a [G, M, K] @ b [G, K, N] -> float32 [G, M, N], each entry independent of the rest."""
    return _matmuls().mm_nn(a, b)


def _linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x [..., K] @ weight [N, K].T + bias -> [..., N] in x's dtype, accumulated in float32;
    the bias is added in float32 before the one rounding."""
    out = matmul_nt(x.reshape(1, -1, x.shape[-1]), weight[None])[0]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def _swiglu(gate: Tensor, up: Tensor) -> Tensor:
    g = gate.float()
    return (g / (1.0 + torch.exp(-g))).to(gate.dtype) * up


def _attend(rows: Tensor, k: Tensor, v: Tensor, pos: Tensor, d: int) -> Tensor:
    """rows [B, Hkv, R, D], k/v [B, Hkv, L, D] (L a whole number of KEY_BLOCKs), pos [B, R]
    (a row's last visible key) -> [B, Hkv, R, D]."""
    b, hkv, r, _ = rows.shape
    length = k.shape[2]
    g = b * hkv
    scores = matmul_nt(rows.reshape(g, r, d), k.reshape(g, length, d)).view(b, hkv, r, length)
    # scale, then mask by adding 0 or -inf (x + 0 is x, up to the sign of a zero, which exp
    # does not see): a third the time of a broadcast masked_fill_ here.
    masked = torch.arange(length, device=rows.device) > pos[:, None, :, None]  # [B, 1, R, L]
    bias = torch.zeros(masked.shape, device=rows.device).masked_fill_(masked, float("-inf"))
    scores = scores.mul_(d**-0.5).add_(bias)
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return matmul_nn(probs.view(g, r, length), v.reshape(g, length, d)).to(v.dtype).view(b, hkv, r, d)


def _batched_attention(q: Tensor, k: Tensor, v: Tensor, q_start: Tensor) -> Tensor:
    check_batched_attention(q, k, v, q_start)
    b, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    if b == 0 or tq == 0:
        return q.new_zeros(b, hq, tq, d)
    group = hq // hkv
    blocks = []
    for qs in range(0, tq, QUERY_BLOCK):
        qn = min(QUERY_BLOCK, tq - qs)
        nk = min(int(q_start.max()) + qs + qn, tk)
        nb = nk + (-nk % KEY_BLOCK)  # whole key blocks; keys past Tk are zero rows, masked
        kk, vv = (F.pad(x[:, :, :nk], (0, 0, 0, nb - nk)) if nb > nk else x[:, :, :nb] for x in (k, v))
        rows = q[:, :, qs : qs + qn].reshape(b, hkv, group * qn, d)  # [B, Hkv, G*qn, D]: row g*qn + t
        pos = q_start[:, None] + qs + torch.arange(qn, device=q.device).repeat(group)  # [B, G*qn]
        step = max(1, SCORE_ELEMENTS // (hkv * group * qn * nb))
        outs = [_attend(rows[i : i + step], kk[i : i + step], vv[i : i + step], pos[i : i + step], d)
                for i in range(0, b, step)]
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        blocks.append(out.reshape(b, hq, qn, d))
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=2)


class CpuInvariantKernels:
    """Batch-invariant kernels on the CPU (see the module doc). Same interface as every
    backend (`reprorl.kernels`); gradients are stock torch's (deterministic)."""

    name = "cpu-invariant"
    batch_invariant = True

    apply_rotary = staticmethod(apply_rotary)
    rms_norm = staticmethod(TorchKernels.rms_norm)
    softmax = staticmethod(TorchKernels.softmax)
    log_softmax = staticmethod(TorchKernels.log_softmax)
    swiglu = staticmethod(_swiglu)
    linear = staticmethod(linear_with_matmul_backward(_linear))
    batched_attention = staticmethod(with_torch_backward(_batched_attention, math_attention))

    @classmethod
    def padded_attention(cls, q: Tensor, k: Tensor, v: Tensor, attention_mask: Tensor) -> Tensor:
        return padded_as_sequences(cls.batched_attention, q, k, v, attention_mask)
