"""Batch-invariant kernels for any x86 (or other) CPU.

Each output row depends only on that row's inputs: not on how many rows are in the call,
where the row sits, what the other rows hold, or the number of threads. How:

- matmul (linear, and attention's two products): cut into row tiles of ONE fixed shape
  (`ROW_TILE` rows; column tiles fixed by N alone), each tile one single-threaded BLAS call,
  the tiles spread over threads (`tiled_mm.cpp`). A BLAS picks its kernel and its thread
  split from the whole call's shape: with every call the same shape and one thread, that
  choice can no longer follow the batch. The previous recipe (padding M to MKL's kernel
  quanta) held on an AMD EPYC and failed on an Intel Xeon; this one needs no knowledge of
  the library (checked on both at 1, 2 and 16 threads).
- attention: scores and p v are such products. p v sums over keys, so it is cut into fixed
  `KEY_BLOCK` chunks added in order (every call the same K); masked keys get probability
  exactly 0, so extra keys change no bit.
- sums over the last dim (RMSNorm over a hidden size, log-softmax over a vocabulary,
  softmax over keys): torch's fused `rms_norm`, `log_softmax` and `softmax` reduce each row
  on its own in an order set by the width alone, and -inf padding (masked keys) does not
  change a softmax row's bits.
- SiLU from exp and IEEE ops: `F.silu` is NOT position-invariant here (its vector and
  scalar-tail paths round differently).
- +, -, *, /, sqrt, max and gathers are exact, so they never depend on the batch.

The tile runner is a small C++ extension built on first use (about 30 s, then cached by
torch in ~/.cache/torch_extensions); it needs a C++ compiler and ninja.
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

# Rows per BLAS call. Fewer rows waste less on small batches; more rows re-pack each weight
# panel fewer times (measured here, 2 threads, 64 x 896 x 1152: 16 rows cost 1.46x one plain
# call, 32 rows 1.2x, 64 rows 1.07x). A single sequence's decode pads to one tile.
ROW_TILE = 32
# Attention's products have few rows per sequence (a decode step: the query heads of one
# kv head), so they take a smaller row tile.
ATTENTION_ROW_TILE = 16
# `batched_attention` takes queries in blocks (bounds the [rows, keys] score matrix) and
# sequences in groups whose score matrix holds at most SCORE_ELEMENTS entries (16 MiB of
# float32): memory stays bounded, and no row's bits depend on the block or the group.
QUERY_BLOCK = 256
SCORE_ELEMENTS = 1 << 22


def column_tile(n: int) -> int:
    """Columns per BLAS call for an output of width n: enough column tiles to spread a
    small batch over threads, wide enough to amortise a call. A function of n alone."""
    return 256 if n >= 2048 else 128 if n >= 512 else 64


@functools.cache
def _tile_runner():
    from torch.utils.cpp_extension import load

    source = Path(__file__).with_name("tiled_mm.cpp")
    logger.info("building reprorl's CPU tile runner (%s), once per machine, about 30 s", source.name)
    try:
        return load(name="reprorl_tiled_mm", sources=[str(source)], extra_cflags=["-O2"], verbose=False)
    except Exception as e:  # a missing compiler surfaces as several exception types
        raise RuntimeError(
            f"full_determinism on the CPU needs reprorl's tile runner ({source}), built with a C++ "
            f"compiler and ninja (pip install ninja; apt-get install g++); building it failed: {e}"
        ) from e


def tiled_matmul(a: Tensor, b: Tensor, row_tile: int, col_tile: int) -> Tensor:
    """a [G, M, K] @ b [G, K, N] -> [G, M, N] (any strides for b) with each output row
    independent of M, the other rows and the thread count. Padding rows are zeros, dropped."""
    g, m, k = a.shape
    pad = -m % row_tile
    if pad or not a.is_contiguous():
        a = F.pad(a, (0, 0, 0, pad))  # a fresh, aligned, contiguous copy: the layout every call sees
    out = _tile_runner().tiled_mm(a, b, row_tile, col_tile)
    return out[:, :m] if pad else out


def _matmul(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x [..., K] @ weight [N, K].T + bias -> [..., N]. The bias is added after the product
    (elementwise, so no row depends on another)."""
    rows = x.reshape(1, -1, x.shape[-1])
    out = tiled_matmul(rows, weight.t()[None], ROW_TILE, column_tile(weight.shape[0]))[0]
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _swiglu(gate: Tensor, up: Tensor) -> Tensor:
    g = gate.float()
    return (g / (1.0 + torch.exp(-g))).to(gate.dtype) * up


def _attend(rows: Tensor, k: Tensor, v: Tensor, pos: Tensor, d: int) -> Tensor:
    """rows [B, Hkv, R, D], k/v [B, Hkv, L, D] (L a whole number of KEY_BLOCKs), pos [B, R]
    (a row's last visible key; padding rows see every key) -> [B, Hkv, R, D]."""
    b, hkv, r, _ = rows.shape
    length = k.shape[2]
    g = b * hkv
    keys_t = k.reshape(g, length, d).transpose(1, 2)  # [G, D, L], a view: BLAS reads it transposed
    scores = tiled_matmul(rows.reshape(g, r, d), keys_t, ATTENTION_ROW_TILE, KEY_BLOCK)
    scores = scores.view(b, hkv, r, length).float() * d**-0.5
    masked = torch.arange(length, device=rows.device) > pos[:, None, :, None]  # [B, 1, R, L]
    probs = torch.softmax(scores.masked_fill_(masked, float("-inf")), dim=-1).to(v.dtype).view(g, r, length)
    values = v.reshape(g, length, d)
    out = None
    for kb in range(0, length, KEY_BLOCK):  # every product the same K, added in key order
        part = tiled_matmul(probs[:, :, kb : kb + KEY_BLOCK], values[:, kb : kb + KEY_BLOCK], ATTENTION_ROW_TILE, d)
        out = part if out is None else out + part
    return out.view(b, hkv, r, d)


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
        kk, vv = (F.pad(x[:, :, :nk], (0, 0, 0, nb - nk)) if nb > nk or not x.is_contiguous() else x[:, :, :nb]
                  for x in (k, v))
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
    linear = staticmethod(linear_with_matmul_backward(_matmul))
    batched_attention = staticmethod(with_torch_backward(_batched_attention, math_attention))

    @classmethod
    def padded_attention(cls, q: Tensor, k: Tensor, v: Tensor, attention_mask: Tensor) -> Tensor:
        return padded_as_sequences(cls.batched_attention, q, k, v, attention_mask)
