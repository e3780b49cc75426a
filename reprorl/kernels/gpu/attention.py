"""Batch-invariant causal attention with grouped-query heads on CUDA.

One kernel serves every path: the engine's decode steps and prefill chunks over its KV
cache, many sequences of different lengths in one launch, and the trainer's padded batches
(`padded_as_sequences` moves each sequence's real tokens to the front). A program takes
BLOCK_M rows of one (sequence, kv head): row r is query t = r // G with head g = r % G of
the G query heads that share the kv head, so the keys and values are read once for all of
them. It walks the keys from key 0 in blocks of BLOCK_N with an online softmax (running
max and sum, rescaled as the max grows; Dao et al. 2022, FlashAttention).

Why a query's output is the same bits whatever computed it: its scores, its block sums and
its p v products see only its own row and the fixed key blocks, through the same tile
shapes (BLOCK_M, BLOCK_N, D and the warp count are constants of the kernel, never chosen
per call). A program runs up to the last key its last row may see; for an earlier row,
the blocks past its own position are exact no-ops (scores -inf, so the max stays, the
rescale factor is exp2(0) = 1 and the added probabilities and products are exact zeros).
So decode == the same row of a prefill == the same row of the trainer's forward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from reprorl.kernels.gpu.interpret import INTERPRETED
from reprorl.kernels.shared import check_batched_attention

BLOCK_M = 64
BLOCK_N = 64
NUM_WARPS = 4
LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["Tq", "Tk"])
def _attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, start_ptr,
                      sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sob, soh, sot,
                      Tq, Tk, HKV, G, scale_log2,
                      IEEE: tl.constexpr, UPCAST: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // HKV).to(tl.int64)
    hkv = (bh % HKV).to(tl.int64)
    start = tl.load(start_ptr + b)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    t = rows // G
    head = hkv * G + rows % G
    row_ok = t < Tq
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * sqb + head[:, None] * sqh + t[:, None].to(tl.int64) * sqt + d[None, :],
                mask=row_ok[:, None], other=0.0)
    pos = start + t  # [BLOCK_M] each row's last visible key
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    last_t = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // G, Tq - 1)
    num_keys = tl.minimum(start + last_t + 1, Tk)
    k_base = k_ptr + b * skb + hkv * skh
    v_base = v_ptr + b * svb + hkv * svh
    for kb in range(0, num_keys, BLOCK_N):
        cols = kb + tl.arange(0, BLOCK_N)
        in_range = cols < Tk
        k = tl.load(k_base + cols[None, :].to(tl.int64) * skt + d[:, None], mask=in_range[None, :], other=0.0)
        if UPCAST:  # the interpreter only (see interpret.py)
            s = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
        elif IEEE:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        s = tl.where((cols[None, :] <= pos[:, None]) & in_range[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + cols[:, None].to(tl.int64) * svt + d[None, :], mask=in_range[:, None], other=0.0)
        if UPCAST:
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
        elif IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(o_ptr + b * sob + head[:, None] * soh + t[:, None].to(tl.int64) * sot + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


def _last_dim_contiguous(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def batched_attention(q: Tensor, k: Tensor, v: Tensor, q_start: Tensor) -> Tensor:
    """q [B, Hq, Tq, D] at positions q_start[b]..; k/v [B, Hkv, Tk, D] (views of a KV cache
    are fine) -> [B, Hq, Tq, D]. A query at position p sees keys 0..min(p, Tk-1)."""
    check_batched_attention(q, k, v, q_start)
    b, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    out = torch.empty(b, hq, tq, d, dtype=q.dtype, device=q.device)
    if b == 0 or tq == 0:
        return out
    if d & (d - 1) or d < 16:
        raise ValueError(f"batched_attention: head_dim {d}; the Triton kernel takes a power of two >= 16")
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    group = hq // hkv
    starts = q_start.to(device=q.device, dtype=torch.int64)
    grid = (triton.cdiv(group * tq, BLOCK_M), b * hkv)
    _attention_kernel[grid](
        q, k, v, out, starts,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        tq, tk, hkv, group, d**-0.5 * LOG2E,
        IEEE=q.dtype == torch.float32, UPCAST=INTERPRETED and q.dtype != torch.float32, D=d, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=NUM_WARPS, num_stages=2,
    )
    return out
