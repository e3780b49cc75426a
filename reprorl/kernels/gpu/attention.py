"""Batch-invariant causal attention with grouped-query heads on CUDA, optionally in a
sliding window.

One kernel serves every path: the engine's decode steps and prefill chunks over its KV
cache, many sequences of different lengths in one launch, and the trainer's padded batches
(whose layers run on each row's real tokens moved to its front, `shared.Padding.front`).
A program takes BLOCK_M rows of one (sequence, kv head): row r is query t = r // G with
head g = r % G of the G query heads that share the kv head, so the keys and values are read
once for all of them. It walks the keys from key 0 in blocks of BLOCK_N with an online softmax (running
max and sum, rescaled as the max grows; Dao et al. 2022, FlashAttention).

Why a query's output is the same bits whatever computed it: its scores, its block sums and
its p v products see only its own row and the fixed key blocks, through the same tile
shapes (BLOCK_M, BLOCK_N, D and the warp count are constants of the kernel, never chosen
per call). A program runs up to the last key its last row may see; for an earlier row,
the blocks past its own position are exact no-ops (scores -inf, so the max stays, the
rescale factor is exp2(0) = 1 and the added probabilities and products are exact zeros).
So decode == the same row of a prefill == the same row of the trainer's forward.

A sliding window of W keys (a query at p sees keys p-W+1..p; WINDOW, a compile-time
constant, one compiled kernel a window) masks the keys before it too. A row's first blocks
may then hold none of its keys, so its running max stays -inf, where exp2(-inf - -inf)
would be NaN: the kernel subtracts 0 instead of a max of -inf, so such a block leaves the
row's state as it started (max -inf, sum +0, acc +0: alpha = p = 0). A block before the
first row's window is such a block for every row of the program (later rows' windows
start later), so the program starts at the block that holds its first row's window start:
skipping the blocks before it is the same bits, and the block order is still key 0's
blocks, from wherever a program starts. Window 0 compiles the window's code out: today's
arithmetic.

Training takes the gradient from two more kernels (Dao 2023, FlashAttention-2's backward),
given each row's log-sum-exp, which the forward writes when a gradient will be needed:
`_attention_dkdv_kernel` (a program per block of keys of one (sequence, kv head) walks
every query row that sees them, all G heads of the group, in order, and sums dK and dV in
registers) and `_attention_dq_kernel` (a program per block of query rows walks their keys).
Each output is summed by one program in a fixed order: no atomics, so the gradient is the
same bits every run. It is the gradient of the softmax attention itself: the forward's
rounding of p to the values' dtype before p v counts as the identity (as autograd treats
a cast), which is also what the plain torch formula's backward gives.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from reprorl.kernels.gpu.interpret import INTERPRETED
from reprorl.kernels.gpu.launch import PINNED
from reprorl.kernels.shared import check_batched_attention

BLOCK_M = 64
BLOCK_N = 64
NUM_WARPS = 4
LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b with fp32 accumulation: IEEE fp32 for fp32 inputs; under the interpreter, 16-bit
    inputs widened first (interpret.py)."""
    if UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _seen(cols, pos, WINDOW: tl.constexpr):
    """[rows, keys] bool: key `cols` is in the window of a query at `pos` (keys 0..pos, or
    pos-WINDOW+1..pos)."""
    seen = cols[None, :] <= pos[:, None]
    if WINDOW > 0:
        seen = seen & (cols[None, :] > pos[:, None] - WINDOW)
    return seen


@triton.jit
def _first_block(start, first_t, WINDOW: tl.constexpr, BLOCK_N: tl.constexpr):
    """The first key block a program whose first query is `first_t` walks: 0, or with a
    window the block of its first query's first key (no query of the program sees a key
    before it: later queries' windows start later)."""
    if WINDOW > 0:
        lo = tl.maximum(start + first_t - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
    else:
        lo = 0
    return lo


@triton.jit(do_not_specialize=["Tq", "Tk"])
def _attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, start_ptr, lse_ptr,
                      sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sob, soh, sot,
                      Tq, Tk, HKV, G, scale_log2,
                      IEEE: tl.constexpr, UPCAST: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      WRITE_LSE: tl.constexpr, WINDOW: tl.constexpr):
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
    for kb in range(_first_block(start, pid_m * BLOCK_M // G, WINDOW, BLOCK_N), num_keys, BLOCK_N):
        cols = kb + tl.arange(0, BLOCK_N)
        in_range = cols < Tk
        k = tl.load(k_base + cols[None, :].to(tl.int64) * skt + d[:, None], mask=in_range[None, :], other=0.0)
        s = _dot(q, k, IEEE, UPCAST)
        s = tl.where(_seen(cols, pos, WINDOW) & in_range[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        if WINDOW > 0:  # a row that has seen no key yet: subtract 0, not -inf (the module doc)
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_sub = m_new
        alpha = tl.exp2(m_i - m_sub)
        p = tl.exp2(s - m_sub[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + cols[:, None].to(tl.int64) * svt + d[None, :], mask=in_range[:, None], other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE, UPCAST)
        m_i = m_new
    if WINDOW > 0:  # a row past Tq may have seen no key (l_i = 0): never stored, but kept finite
        l_i = tl.where(row_ok, l_i, 1.0)
    out = acc / l_i[:, None]
    tl.store(o_ptr + b * sob + head[:, None] * soh + t[:, None].to(tl.int64) * sot + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
    if WRITE_LSE:  # log2 of the row's sum of exp2(scaled scores): [B, Hq, Tq] float32
        tl.store(lse_ptr + (b * HKV * G + head) * Tq + t, m_i + tl.log2(l_i), mask=row_ok)


@triton.jit
def _query_rows(q_ptr, do_ptr, lse_ptr, delta_ptr, b, hkv, r0, sqb, sqh, sqt, sdb, sdh, sdt, Tq, HKV, G,
                D: tl.constexpr, BLOCK_M: tl.constexpr):
    """Rows r0.. of one (sequence, kv head) as the forward lays them (row r: query r // G,
    head r % G of the group): (t, head, ok, q, dO, lse, delta), zeros past Tq."""
    rows = r0 + tl.arange(0, BLOCK_M)
    t = rows // G
    head = hkv * G + rows % G
    ok = t < Tq
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * sqb + head[:, None] * sqh + t[:, None].to(tl.int64) * sqt + d[None, :],
                mask=ok[:, None], other=0.0)
    do = tl.load(do_ptr + b * sdb + head[:, None] * sdh + t[:, None].to(tl.int64) * sdt + d[None, :],
                 mask=ok[:, None], other=0.0)
    at = (b * HKV * G + head) * Tq + t  # [B, Hq, Tq] float32
    lse = tl.load(lse_ptr + at, mask=ok, other=0.0)
    delta = tl.load(delta_ptr + at, mask=ok, other=0.0)
    return t, head, ok, q, do, lse, delta


@triton.jit
def _key_rows(k_ptr, v_ptr, b, hkv, cols, ok, skb, skh, skt, svb, svh, svt, D: tl.constexpr):
    """Keys and values `cols` of one (sequence, kv head): k, v [len(cols), D], zeros past Tk."""
    d = tl.arange(0, D)
    k = tl.load(k_ptr + b * skb + hkv * skh + cols[:, None].to(tl.int64) * skt + d[None, :], mask=ok[:, None],
                other=0.0)
    v = tl.load(v_ptr + b * svb + hkv * svh + cols[:, None].to(tl.int64) * svt + d[None, :], mask=ok[:, None],
                other=0.0)
    return k, v


@triton.jit
def _probs_and_ds(q, k, v, do, lse, delta, t, row_ok, cols, col_ok, start, scale_log2, IEEE: tl.constexpr,
                  UPCAST: tl.constexpr, WINDOW: tl.constexpr):
    """The forward's probabilities p [rows, keys] (from each row's log-sum-exp) and the
    scores' gradient over scale, ds = p * (dO v^T - delta); zeros where a row does not see a key."""
    s = _dot(q, tl.trans(k), IEEE, UPCAST)
    seen = _seen(cols, start + t, WINDOW) & col_ok[None, :] & row_ok[:, None]
    p = tl.where(seen, tl.exp2(s * scale_log2 - lse[:, None]), 0.0)
    return p, p * (_dot(do, tl.trans(v), IEEE, UPCAST) - delta[:, None])


@triton.jit(do_not_specialize=["Tq", "Tk"])
def _attention_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, start_ptr,
                           sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sdb, sdh, sdt, Tq, Tk, HKV, G, scale_log2, scale,
                           IEEE: tl.constexpr, UPCAST: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, WINDOW: tl.constexpr):
    # dV = sum over rows of p^T dO; dK = scale * sum of ds^T q.
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // HKV).to(tl.int64)
    hkv = (bh % HKV).to(tl.int64)
    start = tl.load(start_ptr + b)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < Tk
    k, v = _key_rows(k_ptr, v_ptr, b, hkv, cols, col_ok, skb, skh, skt, svb, svh, svt, D)
    dk = tl.zeros((BLOCK_N, D), tl.float32)
    dv = tl.zeros((BLOCK_N, D), tl.float32)
    first_t = tl.maximum(pid_n * BLOCK_N - start, 0)  # the first query that sees this block
    if WINDOW > 0:  # the rows up to the last query whose window reaches this block
        end_t = tl.minimum(tl.maximum(pid_n * BLOCK_N + BLOCK_N - 1 + WINDOW - start, 0), Tq)
    else:
        end_t = Tq
    for r0 in range(first_t * G // BLOCK_M * BLOCK_M, G * end_t, BLOCK_M):
        t, _, row_ok, q, do, lse, delta = _query_rows(q_ptr, do_ptr, lse_ptr, delta_ptr, b, hkv, r0, sqb, sqh, sqt,
                                                      sdb, sdh, sdt, Tq, HKV, G, D, BLOCK_M)
        p, ds = _probs_and_ds(q, k, v, do, lse, delta, t, row_ok, cols, col_ok, start, scale_log2, IEEE, UPCAST,
                              WINDOW)
        dv += _dot(tl.trans(p.to(do.dtype)), do, IEEE, UPCAST)
        dk += _dot(tl.trans(ds.to(q.dtype)), q, IEEE, UPCAST)
    d = tl.arange(0, D)
    out = b * HKV * Tk * D + hkv * Tk * D + cols[:, None].to(tl.int64) * D + d[None, :]  # dK, dV contiguous
    tl.store(dk_ptr + out, (dk * scale).to(dk_ptr.dtype.element_ty), mask=col_ok[:, None])
    tl.store(dv_ptr + out, dv.to(dv_ptr.dtype.element_ty), mask=col_ok[:, None])


@triton.jit(do_not_specialize=["Tq", "Tk"])
def _attention_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, start_ptr,
                         sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sdb, sdh, sdt, Tq, Tk, HKV, G, scale_log2, scale,
                         IEEE: tl.constexpr, UPCAST: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, WINDOW: tl.constexpr):
    # dQ = scale * sum over keys of ds k, the keys walked in the forward's blocks.
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // HKV).to(tl.int64)
    hkv = (bh % HKV).to(tl.int64)
    start = tl.load(start_ptr + b)
    t, head, row_ok, q, do, lse, delta = _query_rows(q_ptr, do_ptr, lse_ptr, delta_ptr, b, hkv, pid_m * BLOCK_M,
                                                     sqb, sqh, sqt, sdb, sdh, sdt, Tq, HKV, G, D, BLOCK_M)
    dq = tl.zeros((BLOCK_M, D), tl.float32)
    last_t = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // G, Tq - 1)
    num_keys = tl.minimum(start + last_t + 1, Tk)
    for kb in range(_first_block(start, pid_m * BLOCK_M // G, WINDOW, BLOCK_N), num_keys, BLOCK_N):
        cols = kb + tl.arange(0, BLOCK_N)
        col_ok = cols < Tk
        k, v = _key_rows(k_ptr, v_ptr, b, hkv, cols, col_ok, skb, skh, skt, svb, svh, svt, D)
        _, ds = _probs_and_ds(q, k, v, do, lse, delta, t, row_ok, cols, col_ok, start, scale_log2, IEEE, UPCAST,
                              WINDOW)
        dq += _dot(ds.to(k.dtype), k, IEEE, UPCAST)
    d = tl.arange(0, D)
    tl.store(dq_ptr + ((b * HKV * G + head[:, None]) * Tq + t[:, None].to(tl.int64)) * D + d[None, :],
             (dq * scale).to(dq_ptr.dtype.element_ty), mask=row_ok[:, None])


def _last_dim_contiguous(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _forward(q: Tensor, k: Tensor, v: Tensor, q_start: Tensor, window: int, with_lse: bool
             ) -> tuple[Tensor, Tensor | None]:
    check_batched_attention(q, k, v, q_start, window)
    b, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    out = torch.empty(b, hq, tq, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, hq, tq, dtype=torch.float32, device=q.device) if with_lse else None
    if b == 0 or tq == 0:
        return out, lse
    if d & (d - 1) or d < 16:
        raise ValueError(f"batched_attention: head_dim {d}; the Triton kernel takes a power of two >= 16")
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    group = hq // hkv
    starts = q_start.to(device=q.device, dtype=torch.int64)
    grid = (triton.cdiv(group * tq, BLOCK_M), b * hkv)
    _attention_kernel[grid](
        q, k, v, out, starts, lse if with_lse else out,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        tq, tk, hkv, group, d**-0.5 * LOG2E,
        IEEE=q.dtype == torch.float32, UPCAST=INTERPRETED and q.dtype != torch.float32, D=d, BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N, WRITE_LSE=with_lse, WINDOW=window, num_warps=NUM_WARPS, num_stages=2, **PINNED,
    )
    return out, lse


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, q_start: Tensor, window: int) -> Tensor:
        out, lse = _forward(q, k, v, q_start, window, with_lse=True)
        ctx.save_for_backward(q, k, v, out, lse, q_start)
        ctx.window = window
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse, q_start = ctx.saved_tensors
        b, hq, tq, d = q.shape
        hkv, tk = k.shape[1], k.shape[2]
        q, k, v, do = (_last_dim_contiguous(x) for x in (q, k, v, grad))
        delta = (do.float() * out.float()).sum(-1)  # [B, Hq, Tq]: rowsum(dO * O)
        dq = torch.empty(b, hq, tq, d, dtype=q.dtype, device=q.device)
        dk = torch.empty(b, hkv, tk, d, dtype=k.dtype, device=k.device)
        dv = torch.empty(b, hkv, tk, d, dtype=v.dtype, device=v.device)
        group = hq // hkv
        starts = q_start.to(device=q.device, dtype=torch.int64)
        args = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2),
                tq, tk, hkv, group, d**-0.5 * LOG2E, d**-0.5)
        # Heads of 256 (Gemma 3) in 64-row blocks need 265 KiB of shared memory, past the H200's
        # 227: half the rows and one stage. The backward's blocks move no forward bit, and its
        # own bits stay fixed by D (the gradient is deterministic, not batch-invariant).
        wide = d > 128
        block_m, block_n = (32, 32) if wide else (BLOCK_M, BLOCK_N)
        consts = {"IEEE": q.dtype == torch.float32, "UPCAST": INTERPRETED and q.dtype != torch.float32, "D": d,
                  "BLOCK_M": block_m, "BLOCK_N": block_n, "WINDOW": ctx.window,
                  "num_warps": NUM_WARPS if d <= 64 else 8, **({"num_stages": 1} if wide else {})}
        if b and tq and tk:
            _attention_dkdv_kernel[(triton.cdiv(tk, block_n), b * hkv)](q, k, v, do, lse, delta, dk, dv, starts,
                                                                        *args, **consts, **PINNED)
            _attention_dq_kernel[(triton.cdiv(group * tq, block_m), b * hkv)](q, k, v, do, lse, delta, dq, starts,
                                                                              *args, **consts, **PINNED)
        else:
            dq.zero_(), dk.zero_(), dv.zero_()
        return dq, dk, dv, None, None


def batched_attention(q: Tensor, k: Tensor, v: Tensor, q_start: Tensor, window: int = 0) -> Tensor:
    """q [B, Hq, Tq, D] at positions q_start[b]..; k/v [B, Hkv, Tk, D] (views of a KV cache
    are fine) -> [B, Hq, Tq, D]. A query at position p sees keys 0..min(p, Tk-1), or with
    a window W > 0 (a Python int: a constant of the kernel, so a CUDA graph reads nothing
    on the host) keys p-W+1..min(p, Tk-1). Differentiable in q, k and v (the module doc's
    backward kernels)."""
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        return _Attention.apply(q, k, v, q_start, window)
    return _forward(q, k, v, q_start, window, with_lse=False)[0]
