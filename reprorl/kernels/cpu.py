"""Batch-invariant kernels for any CPU.

Each output row depends only on that row's inputs: not on how many rows are in the call,
where the row sits, what the other rows hold, or the number of threads. How:

- matmul (the linear, and attention's two products): our own kernels, not a BLAS. A BLAS
  picks its kernels, its edge paths and its thread split from the call's shape and the
  machine: padding M to MKL's kernel quanta held on an AMD EPYC and failed on an Intel
  Xeon, and even fixed-shape single-threaded MKL calls gave a row different bits at places
  0 and 1 of a tile there. Our kernels write each entry's arithmetic out as one fixed
  sequence of fused multiply-adds, so vectorisation, blocking and threads cannot change a
  bit: the linear (`csrc/cpu_linear.cpp`) and attention's p v (`cpu_matmul.cpp`'s mm_nn) one
  running sum in k order, with rows (or, up to 8 rows, columns) as the vector lanes;
  attention's scores 16 lane sums in k order on every instruction set, then a fixed tree.
- attention: scores and p v are such products; a row's keys past its position (and, in a
  sliding window, before it) get probability exactly 0, so extra keys add exact zeros.
  The whole attention is one call into the extension (`cpu_attention.cpp`: scores, mask, torch's own softmax kernel, p v,
  per head and chunk of queries, in one parallel region): as a dozen torch ops a query
  block, the ops' fixed costs were 10x the arithmetic at 16 rows.
- exp and log (SiLU, softmax, log-softmax, entropy, attention's softmax): `cpu_math`'s,
  plain IEEE operations, not torch's (MKL's vector math or the C library's), whose bits
  differ between an AMD and an Intel machine;
  `F.silu` is not even position-invariant on the CPU (its vector and scalar-tail paths
  round differently).
- sums over the last dim: log-softmax over a vocabulary and softmax over keys in
  `cpu_math`'s fixed order of 16 lane sums; RMSNorm over a hidden size by torch's fused
  `rms_norm`, which reduces each row on its own, vector lane by index, in an order set by
  the width (torch's portable build has one width). Attention's scores are padded with
  -inf to whole KEY_BLOCKs, which adds exact zeros.
- +, -, *, /, sqrt, max and gathers are exact, so they never depend on the batch.

The matmul and attention kernels are a small C++ extension built on first use for this
machine (-march=native; about 25 s on 2 cores, then cached by torch in ~/.cache/torch_extensions); it
needs a C++ compiler and ninja. `REPRORL_CPU_MARCH` builds it for another instruction set
(`x86-64`: no vector unit beyond SSE2; `haswell`: AVX2; `skylake-avx512`): the bits are the
same for each (tests/kernels/test_cpu_isa.py), only the speed differs.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from reprorl.kernels import cpu_math
from reprorl.kernels.build import extension
from reprorl.kernels.autograd import linear_with_matmul_backward, with_torch_backward
from reprorl.kernels.shared import (
    KEY_BLOCK, Padding, apply_rotary, check_batched_attention, padded_as_sequences, unpadded_attention,
)
from reprorl.kernels.torch_ops import TorchKernels, math_attention


# `batched_attention` takes queries in blocks of KEY_BLOCK: a block's softmax rows span its
# keys only (a causal prefill's early blocks skip the later keys: 3/4 of the products at
# 256 tokens, about half at 4096); no row's bits depend on the block.
QUERY_BLOCK = KEY_BLOCK


def matmul_nt(a: Tensor, b: Tensor, plan: tuple[int, int, int] | None = None) -> Tensor:
    """a [G, M, K] @ b [G, N, K]^T -> float32 [G, M, N], each entry independent of the rest.

    plan: how the work is split, (kc, rows, col_blocks): K in blocks of kc (a multiple of
    the lanes), tasks of up to `rows` rows (a multiple of the register block's) x
    `col_blocks` register blocks of columns; None takes `nt_plan`'s. It changes speed, never
    a bit (tests compare plans; attention's scores take the default)."""
    if plan is None:
        return extension().mm_nt(a, b)
    _check_plan(plan)
    return extension().mm_nt_plan(a, b, list(plan))


@functools.cache
def _register_block() -> dict[str, int]:  # (constants of the build: cached, so a timed call pays no lookup)
    return nt_plan(1, 1, 1, 1)


def _check_plan(plan: tuple[int, int, int]) -> None:
    """A plan's fields checked here, by name (the extension's own check cannot say which)."""
    if len(plan) != 3:
        raise ValueError(f"matmul_nt plan: (kc, rows, col_blocks) expected, got {tuple(plan)}")
    block = _register_block()
    units = ((block["lanes"], f"a positive multiple of the lanes ({block['lanes']})"),
             (block["block_rows"], f"a positive multiple of the register block's rows ({block['block_rows']})"),
             (1, "a positive integer"))
    for name, value, (unit, expected) in zip(("kc", "rows", "col_blocks"), plan, units):
        if not (isinstance(value, int) and value > 0 and value % unit == 0):
            raise ValueError(f"matmul_nt plan: {name} = {value!r}; {expected} expected")


def nt_plan(g: int, m: int, n: int, k: int) -> dict[str, int]:
    """The plan `matmul_nt` takes for [g, m, k] @ [g, n, k]^T at torch's thread count, with
    this machine's lanes and register block (rows x columns)."""
    kc, rows, col_blocks, lanes, block_rows, block_cols = extension().nt_plan(g, m, n, k)
    return {"kc": kc, "rows": rows, "col_blocks": col_blocks, "lanes": lanes, "block_rows": block_rows,
            "block_cols": block_cols}


def matmul_rows(a: Tensor, b: Tensor, plan: tuple[int, int, int] | None = None) -> Tensor:
    """a [M, K] @ b [N, K]^T -> float32 [M, N] (the linear layer), rows of a as the vector
    lanes: each entry one running sum over k in order, the bits of `matmul_nn(a, b^T)`,
    with b read in place (`cpu_linear.cpp`).

    plan: how the work is split, (kc, vecs, cols): K in blocks of kc, tasks of up to `vecs`
    vectors of rows x about `cols` columns; None takes `rows_plan`'s. It changes speed,
    never a bit (bench/tune/cpu_plans.py times plans). Up to 8 rows the columns are the lanes
    instead (tiles of b transposed in L1), with no plan to take."""
    if plan is None:
        return extension().mm_rows(a, b, [])
    if len(plan) != 3:
        raise ValueError(f"matmul_rows plan: (kc, vecs, cols) expected, got {tuple(plan)}")
    for name, value in zip(("kc", "vecs", "cols"), plan):
        if not (isinstance(value, int) and value > 0):
            raise ValueError(f"matmul_rows plan: {name} = {value!r}; a positive integer expected")
    return extension().mm_rows(a, b, list(plan))


def rows_plan(m: int, n: int, k: int) -> dict[str, int]:
    """The plan `matmul_rows` takes for [m, k] @ [n, k]^T at torch's thread count, with this
    machine's lanes and the register block it runs (vectors of rows x columns; 0 vectors up
    to 8 rows, where the columns are the lanes)."""
    kc, vecs, cols, lanes, block_vecs, block_cols = extension().rows_plan(m, n, k)
    return {"kc": kc, "vecs": vecs, "cols": cols, "lanes": lanes, "block_vecs": block_vecs, "block_cols": block_cols}


def matmul_nn(a: Tensor, b: Tensor) -> Tensor:
    """a [G, M, K] @ b [G, K, N] -> float32 [G, M, N], each entry independent of the rest."""
    return extension().mm_nn(a, b)


def _linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x [..., K] @ weight [N, K].T + bias -> [..., N] in x's dtype, accumulated in float32;
    the bias is added in float32 before the one rounding."""
    out = matmul_rows(x.reshape(-1, x.shape[-1]), weight)
    if bias is not None:
        out.add_(bias.float())  # in place: the kernel's fresh output (a new [M, N] costs page faults)
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def _bmm(a: Tensor, b: Tensor) -> Tensor:
    """a [..., M, K] @ b [..., K, N] (the same leading dims) -> [..., M, N] in a's dtype, by
    `matmul_nn`: each entry one running sum over k in order."""
    out = matmul_nn(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]))
    return out.to(a.dtype).reshape(*a.shape[:-1], b.shape[-1])


class _Bmm(torch.autograd.Function):
    """`_bmm` with its gradients by `_bmm` too (g b^T, a^T g): no BLAS in the backward, whose
    kernels (and so bits) differ between an AMD and an Intel CPU."""

    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor) -> Tensor:
        ctx.save_for_backward(a, b)
        return _bmm(a, b)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        a, b = ctx.saved_tensors
        ga = _bmm(grad, b.transpose(-1, -2)) if ctx.needs_input_grad[0] else None
        gb = _bmm(a.transpose(-1, -2), grad) if ctx.needs_input_grad[1] else None
        return ga, gb


def _math_attention(q: Tensor, k: Tensor, v: Tensor, q_start: Tensor, window: int = 0) -> Tensor:
    """`math_attention` on these kernels' products: the form the attention's gradient is taken from."""
    return math_attention(q, k, v, q_start, window, matmul=_Bmm.apply, softmax=cpu_math.softmax)


def _batched_attention(q: Tensor, k: Tensor, v: Tensor, q_start: Tensor, window: int = 0) -> Tensor:
    """One call into `cpu_matmul.cpp`'s attention: scores by mm_nt, scaled and masked by
    adding 0 or -inf, torch's softmax over whole KEY_BLOCKs of keys, p v by mm_nn, each
    head's chunk of queries a task of one parallel region. (As a dozen torch ops a query
    block, the ops' own costs were 10x the arithmetic at 16 rows.) With a window W > 0 a
    task skips the whole KEY_BLOCKs before its queries' windows (cpu_attention.cpp: the
    same bits as masking them)."""
    check_batched_attention(q, k, v, q_start, window)
    return extension().attention(q, k, v, q_start, q.shape[-1] ** -0.5, QUERY_BLOCK, KEY_BLOCK, window)


class CpuInvariantKernels:
    """Batch-invariant kernels on the CPU (see the module doc). Same interface as every
    backend (`reprorl.kernels`); the linear's and attention's gradients are products of
    these kernels too (no BLAS), the rest stock torch's (deterministic)."""

    name = "cpu-invariant"
    batch_invariant = True

    apply_rotary = staticmethod(apply_rotary)
    rms_norm = staticmethod(TorchKernels.rms_norm)
    softmax = staticmethod(cpu_math.softmax)
    log_softmax = staticmethod(cpu_math.log_softmax)
    entropy = staticmethod(cpu_math.entropy)
    token_log_probs = classmethod(TorchKernels.token_log_probs.__func__)
    swiglu = staticmethod(cpu_math.swiglu)
    geglu = staticmethod(cpu_math.geglu)
    linear = staticmethod(linear_with_matmul_backward(_linear, matmul_rows))
    batched_attention = staticmethod(with_torch_backward(_batched_attention, _math_attention))

    @classmethod
    def padded_attention(cls, q: Tensor, k: Tensor, v: Tensor, padding: Padding | Tensor | None,
                         window: int = 0) -> Tensor:
        padding = Padding.of(padding)
        # An all-real mask skips the moves too (a host read costs nothing here).
        if padding.mask is None or bool(padding.mask.all()):
            return unpadded_attention(cls.batched_attention, q, k, v, window)
        return padded_as_sequences(cls.batched_attention, q, k, v, padding, window)
