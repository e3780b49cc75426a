"""The trainer's log-probs of given tokens on CUDA, fused: logits in, one float per token out.

`token_log_probs(logits, tokens, temperature)` is `log_softmax(logits / T)` read at each
row's token (and, on request, the entropy of each row's distribution) without ever writing
a [rows, V] tensor: a row's logits are read as they come out of the LM head (bf16 or
float32) and divided by T in the kernel (IEEE division, as torch's tensor division).

Bits: the row statistics are `row_softmax.row_stats` over the same blocks as the log-softmax
kernel and the engine's sampler (`row_softmax.scaled_block`: the same loads, the same
division), so a log-prob is x[token] / T - log_z, the same bits as the log-softmax kernel's
output at that token, and as the engine's sampler gave when it drew the token (the
contract's point that the rollout's log-probs equal the trainer's). The entropy is
-sum exp(y) y over y = x / T - log_z in the entropy kernel's lanes and tree, so its bits
are those of `softmax.entropy` on the log-softmax's output.

Why: the unfused chain (cast to float32, divide, log-softmax, gather; and backward a
scatter into zeros, the log-softmax's backward, the division's, the cast's) wrote and read
about seven float32 tensors of [rows, V] per micro-batch. At 64 x 256 response tokens and
Qwen's 151,936 words each is 10 GB: the LM head's tail was the largest share of an update
micro-batch's kernels after the matmuls on the H200 (bench/train_step.py --profile).

The backward is one launch too: per row, one pass that recomputes p = exp(y) and writes
d logits = (g_lp (onehot(token) - p) - g_H p (y + H)) / T in the logits' dtype, from the
saved log_z and entropy. No atomics: the same bits every run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from reprorl.kernels.gpu.launch import PINNED
from reprorl.kernels.gpu.row_softmax import (
    contiguous_rows,
    lane_update,
    row_launch,
    row_stats,
    scaled_block,
    tree_sum,
)


@triton.jit
def _token_log_probs_kernel(x_ptr, tokens_ptr, out_ptr, log_z_ptr, entropy_ptr, stride, V, temperature,
                            WITH_ENTROPY: tl.constexpr, BLOCK: tl.constexpr, LOG2_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = x_ptr + row * stride
    m = tl.full((BLOCK,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, V, BLOCK):
        m, s = lane_update(m, s, scaled_block(row_ptr, start + tl.arange(0, BLOCK), V, temperature))
    m_row, s_row = row_stats(m, s, LOG2_BLOCK)
    log_z = m_row + tl.log(s_row)
    token = tl.load(tokens_ptr + row)
    x_token = tl.math.div_rn(tl.load(row_ptr + token).to(tl.float32), temperature)
    tl.store(out_ptr + row, x_token - log_z)
    tl.store(log_z_ptr + row, log_z)
    if WITH_ENTROPY:
        acc = tl.zeros((BLOCK,), tl.float32)
        for start in range(0, V, BLOCK):
            y = scaled_block(row_ptr, start + tl.arange(0, BLOCK), V, temperature) - log_z  # -inf past V
            acc += tl.where(y > float("-inf"), tl.exp(y) * y, 0.0)
        tl.store(entropy_ptr + row, -tree_sum(acc, LOG2_BLOCK))


@triton.jit
def _token_log_probs_backward_kernel(x_ptr, tokens_ptr, log_z_ptr, entropy_ptr, g_lp_ptr, g_h_ptr, dx_ptr,
                                     stride, stride_dx, V, temperature, HAS_LP: tl.constexpr,
                                     HAS_H: tl.constexpr, BLOCK: tl.constexpr):
    # y = x / T - log_z, p = exp(y): d lp / dx_j = (onehot_j - p_j) / T and
    # d H / dx_j = -p_j (y_j + H) / T (H = -sum p y).
    row = tl.program_id(0).to(tl.int64)
    row_ptr = x_ptr + row * stride
    log_z = tl.load(log_z_ptr + row)
    token = tl.load(tokens_ptr + row)
    g_lp = tl.load(g_lp_ptr + row) if HAS_LP else 0.0
    g_h = tl.load(g_h_ptr + row) if HAS_H else 0.0
    h = tl.load(entropy_ptr + row) if HAS_H else 0.0
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        y = scaled_block(row_ptr, cols, V, temperature) - log_z
        p = tl.exp(y)
        d = tl.where(cols == token, g_lp, 0.0) - g_lp * p
        if HAS_H:
            d -= g_h * p * tl.where(cols < V, y + h, 0.0)  # past V, p = 0 and y = -inf
        tl.store(dx_ptr + row * stride_dx + cols, tl.math.div_rn(d, temperature).to(dx_ptr.dtype.element_ty),
                 mask=cols < V)


def _forward(logits: Tensor, tokens: Tensor, temperature: float, with_entropy: bool
             ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(log-probs, log_z, entropy, rows, tokens): the first three [n] float32 (entropy
    empty without `with_entropy`), rows the [n, V] logits the kernels read, tokens [n]."""
    v = logits.shape[-1]
    rows = contiguous_rows(logits)
    toks = tokens.reshape(-1).to(device=rows.device, dtype=torch.int64).contiguous()
    if toks.shape[0] != rows.shape[0]:
        raise ValueError(f"token_log_probs: logits {tuple(logits.shape)} and tokens {tuple(tokens.shape)}; "
                         "expected one token per row of logits")
    n = rows.shape[0]
    out = torch.empty(n, dtype=torch.float32, device=rows.device)
    log_z = torch.empty(n, dtype=torch.float32, device=rows.device)
    entropy = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=rows.device)
    if n and v:
        _token_log_probs_kernel[(n,)](rows, toks, out, log_z, entropy if with_entropy else out, rows.stride(0), v,
                                      temperature, WITH_ENTROPY=with_entropy, **row_launch(v), **PINNED)
    return out, log_z, entropy, rows, toks


class _TokenLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, tokens: Tensor, temperature: float, with_entropy: bool):
        out, log_z, entropy, rows, toks = _forward(logits, tokens, temperature, with_entropy)
        ctx.save_for_backward(rows, toks, log_z, entropy)
        ctx.temperature, ctx.shape = temperature, logits.shape
        ctx.set_materialize_grads(False)  # an output the loss does not use gets no gradient pass
        shape = logits.shape[:-1]
        return out.reshape(shape), (entropy.reshape(shape) if with_entropy else None)

    @staticmethod
    def backward(ctx, g_lp: Tensor | None, g_h: Tensor | None):
        if g_lp is None and g_h is None:
            return None, None, None, None
        rows, toks, log_z, entropy = ctx.saved_tensors
        dx = torch.empty(rows.shape, dtype=rows.dtype, device=rows.device)
        n, v = rows.shape
        g_lp = g_lp.reshape(-1).float().contiguous() if g_lp is not None else None
        g_h = g_h.reshape(-1).float().contiguous() if g_h is not None else None
        if n and v:  # (an absent gradient's pointer is log_z's, never read)
            _token_log_probs_backward_kernel[(n,)](
                rows, toks, log_z, entropy if g_h is not None else log_z, g_lp if g_lp is not None else log_z,
                g_h if g_h is not None else log_z, dx, rows.stride(0), dx.stride(0), v, ctx.temperature,
                HAS_LP=g_lp is not None, HAS_H=g_h is not None,
                **{k: c for k, c in row_launch(v).items() if k != "LOG2_BLOCK"}, **PINNED,  # (no tree sum)
            )
        return dx.reshape(ctx.shape), None, None, None


def token_log_probs(logits: Tensor, tokens: Tensor, temperature: float, with_entropy: bool = False
                    ) -> tuple[Tensor, Tensor | None]:
    """logits [..., V] (the LM head's, any float dtype), tokens [...] -> (log-probs [...]
    float32, entropy [...] float32 or None): `log_softmax(logits / T)` at the tokens and
    the entropy of each row's softmax, T <= 0 (greedy) counting as 1. Differentiable with
    respect to the logits (see the module doc)."""
    t = float(temperature) if temperature > 0 else 1.0
    if torch.is_grad_enabled() and logits.requires_grad:
        return _TokenLogProbs.apply(logits, tokens, t, with_entropy)
    out, _, entropy, _, _ = _forward(logits, tokens, t, with_entropy)
    shape = logits.shape[:-1]
    return out.reshape(shape), (entropy.reshape(shape) if with_entropy else None)
