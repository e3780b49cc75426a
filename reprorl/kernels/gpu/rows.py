"""Row writes on CUDA: `dst[rows[i]] = src[i]` into a 2-D view, one program a row.

Why not `dst[rows] = src` (index_put): full determinism turns on
`torch.use_deterministic_algorithms`, and under it CUDA's index_put with accumulate=False
first sorts its indices (its deterministic answer to duplicate rows). The engine writes
each decode step's keys, values and queries that way, three times a layer, and the sort
is paid inside every step. The writers here never need it: their rows are distinct, or the
duplicates all land in the engine's spare padding slot, which no output reads. So each
row is a plain copy, one fixed program per row: the same bytes every run.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from reprorl.kernels.gpu.launch import PINNED


@triton.jit
def _write_rows_kernel(dst_ptr, rows_ptr, src_ptr, C, stride_dst, stride_src, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + i).to(tl.int64)
    for c0 in range(0, C, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        mask = offs < C
        tl.store(dst_ptr + row * stride_dst + offs, tl.load(src_ptr + i * stride_src + offs, mask=mask), mask=mask)


def write_rows(dst: Tensor, rows: Tensor, src: Tensor) -> None:
    """dst [R, C] (rows contiguous), rows [n] integer, src [n, C] of dst's dtype: in place."""
    if dst.dim() != 2 or src.dim() != 2 or src.shape[1] != dst.shape[1] or rows.shape != (src.shape[0],):
        raise ValueError(f"write_rows: dst {tuple(dst.shape)}, rows {tuple(rows.shape)}, src {tuple(src.shape)}; "
                         "expected dst [R, C], rows [n], src [n, C]")
    if dst.dtype != src.dtype or dst.stride(1) != 1:
        raise ValueError(f"write_rows: dst {dst.dtype} with column stride {dst.stride(1)}, src {src.dtype}; "
                         "expected one dtype and contiguous rows")
    src, rows = src.contiguous(), rows.contiguous()  # (the engine's slots are a column of its graph inputs)
    n, c = src.shape
    if n and c:
        block = min(1024, triton.next_power_of_2(c))
        _write_rows_kernel[(n,)](dst, rows, src, c, dst.stride(0), src.stride(0), BLOCK=block, **PINNED)
