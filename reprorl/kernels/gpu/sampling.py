"""Batch-invariant sampling kernels on CUDA: the engine's fused sampler, and a running sum.

`sample_rows` samples one token per row of a step's logits in one launch, one program per
row (so a row's token and log-prob are a function of that row and its parameters alone:
batch-invariant by construction). It reads the logits as they come out of the LM head
(bf16 or float32), divides by the row's temperature itself (IEEE division, as torch's
tensor division) and never writes a [B, V] tensor. Per row:
  1. one pass: the softmax statistics of the scaled row (`row_softmax.row_stats`: the same
     lanes, block width and fixed pairwise tree as the log-softmax kernel, so
     log_z = max + log(sum) is its bits), and the lowest index of the max (greedy);
  2. a second pass (sampled rows): p = exp(x - max) / sum per block (the softmax kernel's
     arithmetic), the running sum of p in blocks (`tl.cumsum` inside a block plus the total
     of the blocks before it), keeping each block's end value and the last token with mass;
  3. the target u * total (u the row's float64 uniform, rounded to float32 as the torch
     path does); the first block whose end exceeds it is read once more and the token is
     the count of its running sums <= target past the block start: the inverse CDF rule of
     `reprorl.rollout.sampling`. A target that reaches the total takes the last token with
     mass.
The log-prob is x[token] - log_z: `log_softmax(logits / T)` at the token, untruncated,
T = 1 for greedy. Top-k/top-p rows are left to the sort-based path (`sampling.py`),
which uses `row_cumsum`.

`row_cumsum`: torch's CUDA `cumsum` makes no promise that a row's sums do not depend on
the tensor's shape, so this kernel fixes the order: one program per row walks the row in
blocks of BLOCK (a constant), scans each block with `tl.cumsum` (a tree fixed by BLOCK and
the warp count) and adds the running total of the blocks before it, taken from the previous
block's last entry. A row's result is therefore a function of that row alone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from reprorl.kernels.gpu.launch import PINNED
from reprorl.kernels.gpu.row_softmax import lane_update, row_launch, row_stats, scaled_block

BLOCK = 2048
NUM_WARPS = 8


@triton.jit
def _row_cumsum_kernel(x_ptr, out_ptr, stride_x, stride_out, V, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    running = tl.sum(tl.zeros((BLOCK,), tl.float32), axis=0)
    for start in range(0, V, BLOCK):
        cols = start + offs
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < V, other=0.0).to(tl.float32)
        c = tl.cumsum(x, axis=0) + running
        tl.store(out_ptr + row * stride_out + cols, c, mask=cols < V)
        # The block's last entry (masked tail entries add exact zeros) carries on.
        running = tl.sum(tl.where(offs == BLOCK - 1, c, 0.0), axis=0)


def row_cumsum(x: Tensor) -> Tensor:
    """Inclusive running sum over the last dim: [B, V] -> [B, V] float32, each row on its own."""
    if x.dim() != 2:
        raise ValueError(f"row_cumsum: expected [B, V], got {tuple(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    if x.numel():
        _row_cumsum_kernel[(x.shape[0],)](x, out, x.stride(0), out.stride(0), x.shape[1], BLOCK=BLOCK,
                                          num_warps=NUM_WARPS, **PINNED)
    return out


@triton.jit
def _block_cdf(row_ptr, cols, V, temperature, m_row, s_row, before):
    """The running sums of the softmax over one block, starting from `before`: -> (p, cdf)."""
    p = tl.exp(scaled_block(row_ptr, cols, V, temperature) - m_row) / s_row  # 0 past V
    return p, tl.cumsum(p, axis=0) + before


@triton.jit
def _sample_kernel(logits_ptr, params_ptr, tokens_ptr, log_probs_ptr, log_z_ptr, stride, B, V,
                   BLOCK: tl.constexpr, LOG2_BLOCK: tl.constexpr, NUM_BLOCKS: tl.constexpr):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    u = tl.load(params_ptr + row)  # float64: packed rows uniform, temperature, top_k, top_p
    t64 = tl.load(params_ptr + B + row)
    greedy = t64 == 0
    temperature = tl.where(greedy, 1.0, t64).to(tl.float32)
    offs = tl.arange(0, BLOCK)

    # 1. the row's softmax statistics and the first index of its max
    m = tl.full((BLOCK,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK,), tl.float32)
    first = tl.zeros((BLOCK,), tl.int32) + V  # each lane's first index of its running max
    for start in range(0, V, BLOCK):
        cols = start + offs
        x = scaled_block(row_ptr, cols, V, temperature)
        first = tl.where(x > m, cols, first)
        m, s = lane_update(m, s, x)
    m_row, s_row = row_stats(m, s, LOG2_BLOCK)
    log_z = m_row + tl.log(s_row)
    token = tl.min(tl.where(m == m_row, first, V), axis=0)  # the lowest id of the max

    if not greedy:
        # 2. the running sums block by block: each block's end, the last token with mass
        blocks = tl.arange(0, NUM_BLOCKS)
        ends = tl.full((NUM_BLOCKS,), float("inf"), tl.float32)
        last_mass = tl.max(tl.full((BLOCK,), -1, tl.int32), axis=0)
        running = tl.sum(tl.zeros((BLOCK,), tl.float32), axis=0)
        for start in range(0, V, BLOCK):
            cols = start + offs
            p, cdf = _block_cdf(row_ptr, cols, V, temperature, m_row, s_row, running)
            running = tl.sum(tl.where(offs == BLOCK - 1, cdf, 0.0), axis=0)  # exact: the rest add zeros
            ends = tl.where(blocks == start // BLOCK, running, ends)
            last_mass = tl.maximum(last_mass, tl.max(tl.where(p > 0, cols, -1), axis=0))
        # 3. the target, and the token inside the first block that passes it
        target = (u * running.to(tl.float64)).to(tl.float32)
        j = tl.sum((ends <= target).to(tl.int32), axis=0)
        token = last_mass  # the target reached the total
        if j * BLOCK < V:
            before = tl.sum(tl.where(blocks == j - 1, ends, 0.0), axis=0)
            cols = j * BLOCK + offs
            _, cdf = _block_cdf(row_ptr, cols, V, temperature, m_row, s_row, before)
            inside = tl.sum(((cdf <= target) & (cols < V)).to(tl.int32), axis=0)
            token = tl.minimum(j * BLOCK + inside, last_mass)

    token = tl.minimum(tl.maximum(token, 0), V - 1)  # in the row even when it is all NaN or -inf
    x_token = tl.math.div_rn(tl.load(row_ptr + token).to(tl.float32), temperature)
    tl.store(tokens_ptr + row, token.to(tl.int64))
    tl.store(log_probs_ptr + row, x_token - log_z)
    tl.store(log_z_ptr + row, log_z)


def sample_rows(logits: Tensor, packed: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Sample every row from its full distribution at its temperature (see the module doc).

    logits [B, V] (bf16/fp16/fp32, last dim contiguous); packed [4, B] float64 on the same
    device (`reprorl.rollout.sampling.pack_step_params`: uniform, temperature with 0 =
    greedy, top_k, top_p; the last two are not read here). -> (tokens int64 [B], log-probs
    float32 [B], log_z float32 [B]: the log-softmax's normaliser, for rows that another
    path samples)."""
    if logits.dim() != 2 or packed.shape != (4, logits.shape[0]) or packed.dtype != torch.float64:
        raise ValueError(f"sample_rows: expected logits [B, V] and packed [4, B] float64, got "
                         f"{tuple(logits.shape)} and {tuple(packed.shape)} {packed.dtype}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    b, v = logits.shape
    tokens = torch.empty(b, dtype=torch.int64, device=logits.device)
    log_probs = torch.empty(b, dtype=torch.float32, device=logits.device)
    log_z = torch.empty(b, dtype=torch.float32, device=logits.device)
    if b:
        config = row_launch(v)
        _sample_kernel[(b,)](logits, packed.contiguous(), tokens, log_probs, log_z, logits.stride(0), b, v,
                             NUM_BLOCKS=triton.next_power_of_2(triton.cdiv(v, config["BLOCK"])), **config,
                             **PINNED)
    return tokens, log_probs, log_z
