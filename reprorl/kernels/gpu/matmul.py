"""Batch-invariant linear layer on CUDA: `x @ weight.T + bias`, a row's bits independent of M.

A row's result depends on the sequence of MMA steps that sums its products, and every tile
here runs the same one: the products of a row and a column are summed in k order, 16 at a
time (one MMA k-step for 16-bit inputs; fp32 runs IEEE FMAs in k order), into one fp32
accumulator that is carried from each K block to the next. BLOCK_K only groups those steps,
BLOCK_M and BLOCK_N only say how many outputs one program computes, and there is no split-K
(no second accumulator, no reduction across programs). Rows past M are zeros that no real
row reads. So a token's projection is the same bits alone, in a decode step of 256
sequences or in a 4096-token training micro-batch. cuBLAS picks its kernel and its split-K
from M, which is why it is not row-invariant at every shape (docs/kernels.md).

That tiles do not change bits is also measured, not only argued: a probe
(bench/tile_bits.py, since removed) compared the outputs of the candidate tiles on both
kernels (its result: docs/performance.md); tests/kernels/test_gpu.py compares rows alone
with rows inside batches of up to 4096, across all the row buckets below, at every linear of
four Qwen models; and the start-up check (`reprorl.kernels.check`) puts a row in a batch
past each bucket.

Hence the table reads M as well as (N, K, dtype): small batches take narrow tiles, which
give the GPU enough programs when there is one row of tiles, and large ones take wide
tiles, which re-read less. It is fixed (from a sweep on an H200, bench/kernels.py
--sweep): a tile chosen by timing at run time could differ between two processes.

Two kernels, chosen per tile; they too give the same bits:
- `_matmul_tma_kernel` (16-bit inputs on Hopper, and under the interpreter): tiles come in
  through the bulk tensor copy engine (TMA descriptors; rows past M read as zeros), and a
  persistent grid of at most one program per SM walks them. The order in which a program
  takes tiles changes no tile's arithmetic.
- `_matmul_kernel` (fp32, and GPUs before Hopper): one program per tile, plain loads.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from reprorl.kernels.gpu.interpret import INTERPRETED
from reprorl.kernels.gpu.launch import PINNED


@dataclass(frozen=True)
class Tile:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    tma: bool = True
    """16-bit inputs on Hopper: the TMA persistent kernel (else the plain one)."""


CANDIDATE_TILES = tuple(Tile(bm, bn, bk, warps, stages, tma=tma) for bm, bn, bk, warps, stages in (
    (64, 64, 64, 4, 4), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4), (128, 128, 64, 8, 3), (128, 128, 64, 8, 4),
    (128, 128, 64, 4, 4), (128, 256, 64, 8, 3), (64, 256, 64, 8, 3), (128, 64, 128, 8, 3), (64, 64, 128, 4, 3),
    # Narrow: one row of 64-wide tiles is 14 programs for 132 SMs at 0.5B's down projection.
    (64, 32, 64, 4, 4), (64, 16, 64, 4, 4), (64, 32, 128, 4, 3), (64, 16, 128, 4, 3), (64, 32, 256, 4, 3),
    (64, 16, 256, 4, 3)) for tma in (False, True))
"""The tiles `tile_for` may choose from: the ones bench/kernels.py --sweep times and
that were checked for equal bits on an H200 (docs/performance.md; the probe, bench/tile_bits.py,
is in git history); tests/kernels/test_matmul_tiles.py holds the table to them."""

ROW_BUCKETS = (128, 1024)
"""Row counts where the 16-bit tile changes: M <= 128, M <= 1024, larger."""


def tile_for(n: int, k: int, dtype: torch.dtype, m: int) -> Tile:
    """The tile for M rows of an output of width n over a reduction of length k.

    bf16, per row bucket of `ROW_BUCKETS`: at each Qwen2.5-0.5B/7B linear, the fastest
    candidate (CUDA-graph replays over cuBLAS's time, bench/kernels.py --sweep): of the 32
    in `CANDIDATE_TILES` at M = 64 and 256, of the first 20 at M = 4096. The sweep's
    figures, and the shapes no tile brings close to cuBLAS: docs/performance.md.
    """
    if dtype == torch.float32:  # IEEE fp32 on the CUDA cores: small tiles
        return Tile(64, 64, 32, 4, 3, tma=False)
    if m <= ROW_BUCKETS[0]:  # one row of tiles: as many programs as the SMs can take
        if n >= 16384:  # LM heads, 7B's gate/up (whose plain kernel was 1.09x cuBLAS, the TMA one 1.37x)
            return Tile(64, 128, 64, 4, 4, tma=k < 2048)
        if n >= 4096:  # 0.5B's gate/up: 76 programs of 64 columns
            return Tile(64, 64, 128, 4, 3)
        if n >= 2048:  # 7B's q, o, down: 112 programs of 32 columns (64 columns: 1.33-1.70x)
            return Tile(64, 32, 256, 4, 3)
        return Tile(64, 16, 256, 4, 3)  # 0.5B's q, k, v, o, down, 7B's k, v (64 columns: 1.11-1.57x)
    if m <= ROW_BUCKETS[1]:
        if n >= 65536:  # LM heads
            return Tile(128, 256, 64, 8, 3)
        if n >= 4096:  # gate/up
            return Tile(128, 128, 64, 4, 4)
        if n >= 2048 and k >= 2048:  # 7B's q, o, down
            return Tile(64, 128, 64, 4, 4)
        if n <= 512:  # k, v: 0.96-1.04x at 256 rows (64 columns: 1.11-1.24x)
            return Tile(64, 16, 256, 4, 3)
        if k >= 2048:  # 0.5B's down: 1.09x (64 columns: 1.26x)
            return Tile(64, 32, 256, 4, 3)
        return Tile(64, 64, 128, 4, 3)  # 0.5B's q, o
    if n <= 256:  # 0.5B's k, v
        return Tile(64, 64, 128, 4, 3)
    if n >= 16384 or 512 < n <= 1024:  # LM heads, 7B's gate/up; 0.5B's q, o, down
        return Tile(128, 256, 64, 8, 3)
    return Tile(128, 128, 64, 4, 4)  # 7B's q, k, v, o, down; 0.5B's gate/up


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(a_ptr, b_ptr, bias_ptr, c_ptr, M, N, K,
                   stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
                   HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # Programs walk the tiles in groups of GROUP_M rows of tiles (weights reused from L2);
    # the order of programs changes no tile's arithmetic.
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_size
    pid_n = (pid % in_group) // group_size

    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
        if UPCAST:  # the interpreter only (see interpret.py)
            a, b = a.to(tl.float32), b.to(tl.float32)
        if IEEE or UPCAST:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit(do_not_specialize=["M"])
def _matmul_tma_kernel(a_desc, b_desc, c_desc, bias_ptr, M, N, K,
                       HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_PROGRAMS, flatten=True):
        first_m = (tile // in_group) * GROUP_M
        group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (tile % in_group) % group_size
        pid_n = (tile % in_group) // group_size
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(k_tiles):
            a = a_desc.load([pid_m * BLOCK_M, kb * BLOCK_K])
            b = b_desc.load([pid_n * BLOCK_N, kb * BLOCK_K])
            if UPCAST:  # the interpreter only (see interpret.py)
                acc = tl.dot(a.to(tl.float32), b.to(tl.float32).T, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b.T, acc)
        if HAS_BIAS:
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(c_desc.dtype))


def _uses_tma(x: Tensor) -> bool:
    """Whether the GPU can run the TMA kernel: 16-bit inputs on Hopper or later (and under the
    interpreter, which checks its arithmetic). From the dtype and the device, never the shape."""
    if x.dtype == torch.float32:
        return False
    return INTERPRETED or _gpu(x.device)[0] >= 9


def _num_programs(device: torch.device) -> int:
    return 4 if INTERPRETED else _gpu(device)[1]


@functools.lru_cache(maxsize=None)
def _gpu(device: torch.device) -> tuple[int, int]:
    """(compute capability major, SM count) of a GPU, asked once: every linear call needs them."""
    props = torch.cuda.get_device_properties(device)
    return props.major, props.multi_processor_count


def _tma_ready(t: Tensor) -> Tensor:
    """t itself when a TMA descriptor can read it (row-major, 16-byte aligned), else a copy."""
    if t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0:
        return t
    return t.contiguous() if not t.is_contiguous() else t.clone()


def matmul(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [..., K] @ weight [N, K].T + bias [N] -> [..., N] in x's dtype, fp32 accumulation."""
    k = x.shape[-1]
    n = weight.shape[0]
    if weight.dim() != 2 or weight.shape[1] != k or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"linear: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                         f"bias {None if bias is None else tuple(bias.shape)} do not fit")
    if x.dtype != weight.dtype:
        raise ValueError(f"linear: x is {x.dtype}, weight {weight.dtype}; expected one dtype")
    a = x.reshape(-1, k)
    m = a.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*x.shape[:-1], n)
    t = tile_for(n, k, x.dtype, m)
    tiles = triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n)
    if t.tma and _uses_tma(x) and (k * x.element_size()) % 16 == 0 and (n * x.element_size()) % 16 == 0:
        a, w = _tma_ready(a), _tma_ready(weight)
        programs = _num_programs(x.device)
        _matmul_tma_kernel[(min(programs, tiles),)](
            TensorDescriptor.from_tensor(a, [t.block_m, t.block_k]), TensorDescriptor.from_tensor(w, [t.block_n, t.block_k]),
            TensorDescriptor.from_tensor(out, [t.block_m, t.block_n]), bias if bias is not None else weight, m, n, k,
            HAS_BIAS=bias is not None, UPCAST=INTERPRETED, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
            GROUP_M=t.group_m, NUM_PROGRAMS=programs, num_warps=t.num_warps, num_stages=t.num_stages, **PINNED,
        )
        return out.reshape(*x.shape[:-1], n)
    grid = (tiles,)
    _matmul_kernel[grid](
        a, weight, bias if bias is not None else weight, out, m, n, k,
        a.stride(0), a.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, UPCAST=INTERPRETED and x.dtype != torch.float32,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m,
        num_warps=t.num_warps, num_stages=t.num_stages, **PINNED,
    )
    return out.reshape(*x.shape[:-1], n)
