"""What the kernels that walk a row's softmax share: the softmax, log-softmax and entropy
kernels (`softmax.py`), the engine's sampler (`sampling.py`) and the trainer's fused
log-probs (`log_probs.py`).

Their bits agree because they read a row the same way: blocks of `stats_block(V)` (a width
fixed by V alone, `row_launch`), the logits divided by the temperature in the kernel
(`scaled_block`), each lane's running max and sum of exps (`lane_update`), and the lanes
combined by one fixed pairwise tree (`row_stats`, `tree_sum`). The engine's sampled
log-probs equal the trainer's because both come from these functions.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor


def stats_block(v: int) -> int:
    """The block width of a row of v entries (every kernel that needs `row_stats` uses it)."""
    return min(4096, triton.next_power_of_2(v))


def stats_warps(block: int) -> int:
    return 8 if block >= 2048 else 4


def row_launch(v: int) -> dict[str, int]:
    """The launch constants of a kernel that walks rows of v entries with `row_stats` or
    `tree_sum`: BLOCK, LOG2_BLOCK and num_warps, all fixed by v alone."""
    block = stats_block(v)
    return {"BLOCK": block, "LOG2_BLOCK": block.bit_length() - 1, "num_warps": stats_warps(block)}


@triton.jit
def tree_sum(x, LOG2_N: tl.constexpr):
    """Sum of x [2**LOG2_N] as a fixed pairwise tree: at each level entry 2i plus entry 2i+1
    (a sum of two is one addition, the same bits either way round), whatever x's layout.

    Each level is a `tl.sum` over an axis of 2, not `tl.split` and `+`: the same additions,
    but triton 3.6 lowers the split's layouts at a 4096-wide block into 4,097 float adds (its
    PTX) and takes 2 minutes to compile each kernel that calls it (under a second this way,
    100 adds)."""
    for _ in tl.static_range(LOG2_N):
        x = tl.sum(tl.reshape(x, (x.shape[0] // 2, 2)), axis=1)
    return tl.sum(tl.reshape(x, (1,)), axis=0)  # the one entry left, as a scalar


@triton.jit
def lane_update(m, s, x):
    """One block into the lanes' running max m and sum of exps s (all [BLOCK] float32)."""
    m_new = tl.maximum(m, x)
    seen = m_new > float("-inf")  # a lane that has met only -inf keeps s = 0 (no inf - inf)
    s = tl.where(seen, s * tl.exp(m - m_new) + tl.exp(x - m_new), 0.0)
    return m_new, s


@triton.jit
def row_stats(m, s, LOG2_BLOCK: tl.constexpr):
    """The lanes combined: (row max, row sum of exp(x - max)), the sum by `tree_sum`."""
    m_row = tl.max(m, axis=0)
    s_row = tree_sum(tl.where(m > float("-inf"), s * tl.exp(m - m_row), 0.0), LOG2_BLOCK)
    return m_row, s_row


@triton.jit
def scaled_block(row_ptr, cols, V, temperature):
    """A block of the row's logits / T in float32 (-inf past V, as the softmax kernel pads)."""
    x = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    return tl.math.div_rn(x, temperature)


def contiguous_rows(t: Tensor) -> Tensor:
    """t [..., V] as rows [N, V] whose entries are contiguous (a copy only when they are not)."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()
