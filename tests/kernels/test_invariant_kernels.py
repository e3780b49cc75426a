"""Every batch-invariant backend (CPU tiles; Triton on CUDA, or interpreted on the CPU in CI):
hand-computed examples, agreement with the float64 reference, row invariance with
torch.equal, attention's paths against each other, gradients, and the start-up check.

Tolerances (‖out - ref‖ / ‖ref‖ against float64): float32 kernels 1e-5 (float32 rounding of
sums of up to a few thousand terms stays near 1e-6); bfloat16 3e-2 (8-bit mantissas: one
rounding of the output alone is up to 4e-3 relative, and inputs rounded to bf16 feed
several roundings before the output).
"""

import dataclasses
import math
import os
import random

import pytest
import torch

from kernel_backends import BACKENDS, INTERPRETED, backend, backend_and_device  # noqa: F401  (the fixture)
from reprorl.kernels import (
    BatchInvarianceError, CpuInvariantKernels, ReferenceKernels, TorchKernels, rope_tables, verify_batch_invariance,
)
from reprorl.kernels import check as kernel_check
from reprorl.kernels.shared import Padding
from reprorl.models.arch import ModelArgs

TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
THREADS = sorted({1, 2, min(16, os.cpu_count() or 1)})  # 1, 2 here; 1, 2, 16 on the GPU machine's Xeon


def skip_interpreted_dots(kernels):
    """Bitwise tests of kernels built on `tl.dot` run on the GPU: under the interpreter the
    dot is numpy's matmul, which is itself not row-invariant (its arithmetic is tested here)."""
    if INTERPRETED and kernels.name == "triton":
        pytest.skip("interpreted tl.dot is numpy's matmul; the gpu run checks these bits")


def rel_err(out, ref):
    out, ref = out.double().cpu(), ref.double().cpu()
    assert torch.isfinite(out).all()
    return float((out - ref).norm() / ref.norm())


def rand(g, *shape, dtype=torch.float32, device="cpu", scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)


# ---- hand-computed examples ------------------------------------------------------------


def test_linear_example(backend):
    k, dev = backend
    x = torch.tensor([[1.0, 2.0]], device=dev)
    w = torch.tensor([[1.0, 0.0], [0.5, -1.0], [2.0, 3.0]], device=dev)
    out = k.linear(x, w, torch.tensor([0.0, 1.0, -8.0], device=dev))
    assert torch.equal(out.cpu(), torch.tensor([[1.0, -0.5, 0.0]]))


def test_rms_norm_softmax_swiglu_examples(backend):
    k, dev = backend
    # x = [3, 4]: mean square 12.5; weight [1, 2].
    out = k.rms_norm(torch.tensor([[3.0, 4.0]], device=dev), torch.tensor([1.0, 2.0], device=dev), 0.0)
    torch.testing.assert_close(out.cpu(), torch.tensor([[3 / math.sqrt(12.5), 8 / math.sqrt(12.5)]]), rtol=1e-6, atol=0)
    x = torch.tensor([[0.0, math.log(2), math.log(3)]], device=dev)
    torch.testing.assert_close(k.softmax(x).cpu(), torch.tensor([[1 / 6, 2 / 6, 3 / 6]]), rtol=1e-6, atol=0)
    torch.testing.assert_close(k.log_softmax(x).cpu(), torch.tensor([[1 / 6, 2 / 6, 3 / 6]]).log(), rtol=1e-6, atol=0)
    # silu(1) = 1 / (1 + e^-1), times up = 2; silu(0) = 0.
    out = k.swiglu(torch.tensor([1.0, 0.0], device=dev), torch.tensor([2.0, 5.0], device=dev))
    torch.testing.assert_close(out.cpu(), torch.tensor([2 / (1 + math.exp(-1)), 0.0]), rtol=1e-6, atol=0)


def test_rotary_example(backend):
    k, dev = backend
    # head_dim 16, position p: the first frequency is 1, so (x0, x8) rotates by p radians.
    cos, sin = rope_tables(head_dim=16, theta=10000.0, num_positions=3)
    x = torch.zeros(3, 1, 16)
    x[:, 0, 0] = 1.0
    out = k.apply_rotary(x.to(dev), cos.to(dev), sin.to(dev)).cpu()
    for p in range(3):
        torch.testing.assert_close(out[p, 0, [0, 8]], torch.tensor([math.cos(p), math.sin(p)]), rtol=1e-6, atol=1e-7)


# ---- against the float64 reference -----------------------------------------------------

SHAPES = [(37, 100, 64), (70, 256, 384), (5, 64, 1000)]  # (M, K, N): odd sizes, past a 64-row tile


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ops_match_reference(backend, dtype):
    k, dev = backend
    g = torch.Generator().manual_seed(1)
    for m, kk, n in SHAPES:
        x, w, b = rand(g, m, kk, dtype=dtype, device=dev), rand(g, n, kk, dtype=dtype, device=dev, scale=0.1), \
            rand(g, n, dtype=dtype, device=dev)
        assert rel_err(k.linear(x, w, b), ReferenceKernels.linear(x, w, b)) < TOL[dtype]
        norm_w = 1 + rand(g, kk, dtype=dtype, device=dev, scale=0.1)
        assert rel_err(k.rms_norm(x, norm_w, 1e-6), ReferenceKernels.rms_norm(x, norm_w, 1e-6)) < TOL[dtype]
        assert rel_err(k.swiglu(x, x.flip(-1)), ReferenceKernels.swiglu(x, x.flip(-1))) < TOL[dtype]
        assert rel_err(k.geglu(x, x.flip(-1)), ReferenceKernels.geglu(x, x.flip(-1))) < TOL[dtype]
        logits = rand(g, m, n, device=dev, scale=4)  # softmaxes take float32 logits
        assert rel_err(k.softmax(logits), ReferenceKernels.softmax(logits)) < 1e-5
        assert rel_err(k.log_softmax(logits), ReferenceKernels.log_softmax(logits)) < 1e-5
        cos, sin = (t.to(dev) for t in rope_tables(64, 10000.0, m))
        heads = rand(g, m, 3, 64, dtype=dtype, device=dev)
        rot = k.apply_rotary(heads, cos, sin)
        assert rel_err(rot, ReferenceKernels.apply_rotary(heads, cos, sin)) < TOL[dtype]
        # phi3's partial rotary: the first 96 of 128 dimensions, a strided view, a width
        # that is no power of two.
        cos, sin = (t.to(dev) for t in rope_tables(96, 10000.0, m))
        heads = rand(g, m, 3, 128, dtype=dtype, device=dev)[..., :96]
        rot = k.apply_rotary(heads, cos, sin)
        assert rel_err(rot, ReferenceKernels.apply_rotary(heads, cos, sin)) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d,tq,max_start", [(4, 2, 64, 1, 150), (6, 2, 32, 9, 70), (2, 1, 16, 70, 0)])
def test_attention_matches_reference(backend, dtype, hq, hkv, d, tq, max_start):
    k, dev = backend
    q, kk, vv, starts = attention_case(hq * d + tq, hq, hkv, d, 3, tq, max_start, dtype, dev)
    assert rel_err(k.batched_attention(q, kk, vv, starts), ReferenceKernels.batched_attention(q, kk, vv, starts)) \
        < TOL[dtype]


# ---- row invariance --------------------------------------------------------------------


def row_ops(dev, dtype):
    g = torch.Generator().manual_seed(0)
    w, b = rand(g, 384, 256, dtype=dtype, device=dev, scale=0.05), rand(g, 384, dtype=dtype, device=dev)
    w_odd = rand(g, 37, 100, dtype=dtype, device=dev, scale=0.1)
    norm_w = 1 + rand(g, 256, dtype=dtype, device=dev, scale=0.1)
    return {
        "linear": (256, lambda k, x: k.linear(x, w, b)),
        "linear_odd": (100, lambda k, x: k.linear(x, w_odd)),
        "rms_norm": (256, lambda k, x: k.rms_norm(x, norm_w, 1e-6)),
        "swiglu": (256, lambda k, x: k.swiglu(x, x.flip(-1))),
        "geglu": (256, lambda k, x: k.geglu(x, x.flip(-1))),
        "log_softmax": (1000, lambda k, x: k.log_softmax(x.float() * 4)),
        "softmax": (1000, lambda k, x: k.softmax(x.float() * 4)),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_are_batch_invariant(backend, dtype):
    """A row alone (1 thread) and inside batches of 2..300 rows at random places (THREADS
    threads on the CPU): the same bits."""
    k, dev = backend
    gen = torch.Generator().manual_seed(2)
    # 300 rows: the CPU kernels cut a batch into row tasks by thread count. A Triton row kernel
    # runs one program a row (elementwise ones a block of 1024 values), the same code at any
    # grid: interpreted (a Python loop over the programs) 300 rows were most of the test's time
    # and cover nothing that 65 do not; the GPU run takes all the sizes.
    sizes = (2, 3, 5, 13, 33, 65) if INTERPRETED and k.name == "triton" else (2, 3, 5, 13, 33, 65, 300)
    for name, (width, fn) in row_ops(dev, dtype).items():
        if INTERPRETED and k.name == "triton" and name.startswith("linear"):
            continue  # interpreted, tl.dot is numpy's matmul, itself not row-invariant: the GPU run tests these
        rng = random.Random(name)
        row = rand(gen, 1, width, dtype=dtype, device=dev)
        torch.set_num_threads(1)
        alone = fn(k, row)[0]
        for threads in THREADS:
            torch.set_num_threads(threads)
            for m in sizes:
                batch = rand(gen, m, width, dtype=dtype, device=dev)
                pos = rng.randrange(m)
                batch[pos] = row[0]
                assert torch.equal(fn(k, batch)[pos], alone), (name, threads, m, pos)


def test_linear_3d_input_rows(backend):
    k, dev = backend
    skip_interpreted_dots(k)
    g = torch.Generator().manual_seed(4)
    w = rand(g, 192, 128, device=dev, scale=0.05)
    x = rand(g, 3, 5, 128, device=dev)
    full = k.linear(x, w)
    for b in range(3):
        for t in range(5):
            assert torch.equal(k.linear(x[b, t], w), full[b, t])


# The CPU matmul kernels' edges: K past one k block (512) with a tail past the last vector,
# N and K off the register blocks, rows 1..5 of a register block, many row tasks (64 rows).
CPU_MATMUL_SHAPES = [(1100, 37), (1551, 70), (64, 29), (7, 5)]  # (K, N)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_matmuls_row_invariant_at_their_edges(dtype):
    """matmul_nt, matmul_nn and matmul_rows (the linear): a row alone (1 thread) equals it
    inside batches of 2..150 rows at THREADS threads, bit for bit, and all agree with float64.
    matmul_rows takes its few-rows path (columns as lanes) up to 8 rows and rows as lanes
    above, so a row alone and in a batch of 66 went through different loops; matmul_rows's
    bits are matmul_nn's on the weight transposed (one running sum over k in order)."""
    from reprorl.kernels import cpu

    gen = torch.Generator().manual_seed(5)
    rng = random.Random(5)
    threads_before = torch.get_num_threads()
    empty = torch.zeros(1, 0, 8, dtype=dtype)
    assert cpu.matmul_nt(empty, torch.ones(1, 3, 8, dtype=dtype)).shape == (1, 0, 3)
    assert cpu.matmul_nn(empty, torch.ones(1, 8, 3, dtype=dtype)).shape == (1, 0, 3)
    assert cpu.matmul_rows(empty[0], torch.ones(3, 8, dtype=dtype)).shape == (0, 3)
    assert torch.equal(cpu.matmul_rows(torch.ones(2, 0, dtype=dtype), torch.ones(3, 0, dtype=dtype)), torch.zeros(2, 3))
    try:
        check_cpu_matmul_rows(cpu, dtype, gen, rng)
    finally:
        torch.set_num_threads(threads_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_matmul_plans_change_no_bit(dtype):
    """How matmul_nt splits its work (k blocks, rows and columns a task) is a speed choice
    that bench/tune/cpu_plans.py may tune per machine: every plan gives the default's bits, at
    THREADS threads, at the edges (a K tail, N off the register block, odd M, G > 1)."""
    from reprorl.kernels import cpu

    gen = torch.Generator().manual_seed(11)
    threads_before = torch.get_num_threads()
    lanes = cpu.nt_plan(1, 1, 1, 1)["lanes"]
    rows = cpu.nt_plan(1, 1, 1, 1)["block_rows"]
    plans = [(lanes, rows, 1), (4 * lanes, 2 * rows, 3), (256, 16, 2), (512, 64, 8), (2048, 128, 40)]
    try:
        for g, m, kk, n in ((1, 1, 1100, 37), (1, 67, 1551, 70), (3, 13, 64, 29), (2, 150, 7, 5)):
            a, b = rand(gen, g, m, kk, dtype=dtype), rand(gen, g, n, kk, dtype=dtype, scale=0.1)
            torch.set_num_threads(1)
            default = cpu.matmul_nt(a, b)
            for threads in THREADS:
                torch.set_num_threads(threads)
                for plan in plans:
                    assert torch.equal(cpu.matmul_nt(a, b, plan), default), (g, m, kk, n, threads, plan)
        with pytest.raises(ValueError, match=rf"plan: kc = {lanes + 1}; a positive multiple of the lanes \({lanes}\)"):
            cpu.matmul_nt(a, b, (lanes + 1, rows, 1))
        with pytest.raises(ValueError, match=r"plan: rows = 0"):
            cpu.matmul_nt(a, b, (lanes, 0, 1))
    finally:
        torch.set_num_threads(threads_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_linear_plans_change_no_bit(dtype):
    """How matmul_rows (the linear) splits its work (k blocks, row vectors and columns a
    task) is a speed choice that bench/tune/cpu_plans.py may tune per machine: every plan gives
    the default's bits, at THREADS threads, at the edges (a K tail, N off the register
    block, rows off the vectors, one k block or many)."""
    from reprorl.kernels import cpu

    gen = torch.Generator().manual_seed(12)
    threads_before = torch.get_num_threads()
    plans = [(1, 1, 1), (16, 1, 5), (7, 3, 13), (256, 4, 64), (512, 16, 1000), (10**6, 10**6, 10**6)]
    try:
        for m, kk, n in ((9, 1100, 37), (67, 1551, 70), (150, 7, 5), (300, 64, 29)):
            a, b = rand(gen, m, kk, dtype=dtype), rand(gen, n, kk, dtype=dtype, scale=0.1)
            torch.set_num_threads(1)
            default = cpu.matmul_rows(a, b)
            for threads in THREADS:
                torch.set_num_threads(threads)
                for plan in plans:
                    assert torch.equal(cpu.matmul_rows(a, b, plan), default), (m, kk, n, threads, plan)
        with pytest.raises(ValueError, match=r"matmul_rows plan: vecs = 0; a positive integer expected"):
            cpu.matmul_rows(a, b, (16, 0, 1))
        with pytest.raises(ValueError, match=r"matmul_rows plan: \(kc, vecs, cols\) expected, got \(16, 1\)"):
            cpu.matmul_rows(a, b, (16, 1))
    finally:
        torch.set_num_threads(threads_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_attention_rows_independent_of_threads_and_layout(dtype):
    """The CPU attention (one extension call, tasks of a head's chunk of queries): a sequence
    alone at 1 thread equals it inside a batch of others with later starts at THREADS threads,
    bit for bit, with q/k/v packed or strided (the padded path's transposes), 1 to 300
    queries (past one query block and one 24-query chunk), head sizes on and off the vector."""
    from reprorl.kernels import cpu

    gen = torch.Generator().manual_seed(9)
    threads_before = torch.get_num_threads()
    try:
        for hq, hkv, d, tq in ((8, 2, 64, 1), (8, 2, 64, 30), (4, 4, 80, 300), (6, 2, 8, 129)):
            tk = tq + 200
            q, k, v = (rand(gen, 3, h, t, d, dtype=dtype) for h, t in ((hq, tq), (hkv, tk), (hkv, tk)))
            starts = torch.tensor([5, 0, 200])
            torch.set_num_threads(1)
            alone = cpu._batched_attention(q[1:2], k[1:2], v[1:2], starts[1:2])
            for threads in THREADS:
                torch.set_num_threads(threads)
                packed = cpu._batched_attention(q, k, v, starts)
                strided = cpu._batched_attention(*(x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v)),
                                                 starts)
                assert torch.equal(packed[1:2], alone), (hq, hkv, d, tq, threads)
                assert torch.equal(strided, packed), (hq, hkv, d, tq, threads)
    finally:
        torch.set_num_threads(threads_before)


def check_cpu_matmul_rows(cpu, dtype, gen, rng):
    for kk, n in CPU_MATMUL_SHAPES:
        b_nt, b_nn = rand(gen, 1, n, kk, dtype=dtype, scale=0.1), rand(gen, 1, kk, n, dtype=dtype, scale=0.1)
        row = rand(gen, 1, 1, kk, dtype=dtype)
        torch.set_num_threads(1)
        alone = cpu.matmul_nt(row, b_nt)[0, 0], cpu.matmul_nn(row, b_nn)[0, 0], cpu.matmul_rows(row[0], b_nt[0])[0]
        ref = row.double() @ b_nt.double().transpose(1, 2), row.double() @ b_nn.double()
        assert rel_err(alone[0], ref[0][0, 0]) < TOL[torch.float32]  # float32 sums of bf16 products too
        assert rel_err(alone[1], ref[1][0, 0]) < TOL[torch.float32]
        assert rel_err(alone[2], ref[0][0, 0]) < TOL[torch.float32]
        for threads in THREADS:
            torch.set_num_threads(threads)
            for m in (2, 3, 4, 5, 6, 7, 8, 9, 17, 66, 150):
                batch = rand(gen, 1, m, kk, dtype=dtype)
                pos = rng.randrange(m)
                batch[0, pos] = row[0, 0]
                assert torch.equal(cpu.matmul_nt(batch, b_nt)[0, pos], alone[0]), ("nt", kk, n, threads, m, pos)
                assert torch.equal(cpu.matmul_nn(batch, b_nn)[0, pos], alone[1]), ("nn", kk, n, threads, m, pos)
                rows = cpu.matmul_rows(batch[0], b_nt[0])
                assert torch.equal(rows[pos], alone[2]), ("rows", kk, n, threads, m, pos)
                assert torch.equal(rows, cpu.matmul_nn(batch, b_nt.transpose(1, 2).contiguous())[0]), ("rows", kk, n, m)


def test_plain_torch_is_not_row_invariant_here():
    """The harness can fail: stock F.silu rounds its scalar tail differently from its vector
    path on this CPU, so a row of 7 alone and inside a batch differ somewhere."""
    gen = torch.Generator().manual_seed(3)
    differs = False
    for _ in range(50):
        row = torch.randn(1, 7, generator=gen) * 4
        batch = torch.cat([row, torch.randn(15, 7, generator=gen)])
        differs |= not torch.equal(TorchKernels.swiglu(row, row)[0], TorchKernels.swiglu(batch, batch)[0])
    if not differs:
        pytest.skip("this build's F.silu happens to be position-independent")


# ---- attention: one arithmetic for every path -------------------------------------------


def attention_case(seed, hq, hkv, d, b, tq, max_start, dtype=torch.float32, dev="cpu"):
    """q [B, Hq, Tq, D], k/v [B, Hkv, Tk, D] with random starts (keys past the last query
    present, to be masked), and the starts."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, max_start + 1, (b,), generator=g)
    tk = int(starts.max()) + tq + 5
    return (rand(g, b, hq, tq, d, dtype=dtype, device=dev), rand(g, b, hkv, tk, d, dtype=dtype, device=dev),
            rand(g, b, hkv, tk, d, dtype=dtype, device=dev), starts.to(dev))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d,b,tq,max_start", [(2, 1, 64, 6, 1, 300), (14, 2, 64, 3, 1, 200),
                                                    (6, 2, 16, 4, 17, 140), (3, 1, 32, 2, 70, 0)])
def test_batched_rows_equal_each_sequence_alone(backend, dtype, hq, hkv, d, b, tq, max_start):
    k, dev = backend
    skip_interpreted_dots(k)
    q, kk, vv, starts = attention_case(hq * d + tq, hq, hkv, d, b, tq, max_start, dtype, dev)
    out = k.batched_attention(q, kk, vv, starts)
    for i, s in enumerate(starts.tolist()):
        own = s + tq  # its own keys only: no stale keys after them, no other sequences
        alone = k.batched_attention(q[i : i + 1], kk[i : i + 1, :, :own], vv[i : i + 1, :, :own], starts[i : i + 1])
        assert torch.equal(out[i], alone[0]), (i, s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_equals_prefill_equals_chunks(backend, dtype):
    """A query's output: the same bits in a whole prefill, in prefill chunks, decoded alone,
    and with stale keys after it. 150 tokens cross query and key blocks."""
    k, dev = backend
    skip_interpreted_dots(k)
    q, kk, vv, _ = attention_case(5, 4, 2, 32, 1, 150, 0, dtype, dev)
    zero = torch.zeros(1, dtype=torch.long, device=dev)
    whole = k.batched_attention(q, kk[:, :, :150], vv[:, :, :150], zero)
    assert torch.equal(k.batched_attention(q, kk, vv, zero), whole)  # 5 stale keys, masked
    pieces, start = [], 0
    for n in (1, 3, 60, 16, 70):
        pieces.append(k.batched_attention(q[:, :, start : start + n], kk, vv, zero + start))
        start += n
    assert torch.equal(torch.cat(pieces, dim=2), whole)
    for i in (0, 1, 63, 64, 65, 127, 128, 149):
        assert torch.equal(k.batched_attention(q[:, :, i : i + 1], kk, vv, zero + i), whole[:, :, i : i + 1]), i


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_attention_equals_sequences(backend, side):
    k, dev = backend
    skip_interpreted_dots(k)
    b, t, hq, hkv, d = 3, 10, 4, 2, 16
    g = torch.Generator().manual_seed(7)
    q, kk, vv = (rand(g, b, t, h, d, device=dev) for h in (hq, hkv, hkv))
    mask = torch.zeros(b, t, dtype=torch.long)
    for i, n in enumerate([10, 6, 1]):
        mask[i, t - n :] = 1 if side == "left" else 0
        if side == "right":
            mask[i, :n] = 1
    out = k.padded_attention(q, kk, vv, mask.to(dev))
    for i in range(b):
        real = mask[i].bool().to(dev)
        n = int(real.sum())
        alone = k.batched_attention(q[i, real].transpose(0, 1)[None], kk[i, real].transpose(0, 1)[None],
                                    vv[i, real].transpose(0, 1)[None], torch.zeros(1, dtype=torch.long, device=dev))
        assert torch.equal(out[i, real], alone[0].transpose(0, 1)), i
        assert n == 0 or torch.equal(out[i, ~real], torch.zeros_like(out[i, ~real]))


def test_stock_padded_attention_shares_one_mask_and_matches_each_sequence():
    """The stock backend (no promise of bits) attends through SDPA with the `Padding`'s one
    mask, made on first use for every layer: each row's real outputs match its sequence
    alone (to float32 rounding: another kernel sums them), and padding rows stay finite."""
    b, t, hq, hkv, d = 3, 10, 4, 2, 16
    g = torch.Generator().manual_seed(13)
    q, kk, vv = (rand(g, b, t, h, d) for h in (hq, hkv, hkv))
    mask = torch.ones(b, t, dtype=torch.long)
    mask[0, :4] = 0  # left
    mask[1, 7:] = 0  # right
    padding = Padding(mask)
    out = TorchKernels.padded_attention(q, kk, vv, padding)
    shared = padding.sdpa_mask()  # made by the first call, then the same tensor for every layer
    assert torch.equal(TorchKernels.padded_attention(q, kk, vv, padding), out) and padding.sdpa_mask() is shared
    assert torch.isfinite(out).all()
    for i in range(b):
        real = mask[i].bool()
        alone = TorchKernels.padded_attention(q[i, real][None], kk[i, real][None], vv[i, real][None], None)
        torch.testing.assert_close(out[i, real], alone[0], rtol=1e-5, atol=1e-6)


def test_padding_made_once_or_absent_gives_the_masks_bits(backend):
    """The model makes one `Padding` a forward and passes it to every layer, or none when
    the caller gave no mask: the same bits as the mask itself, and an all-real mask's."""
    k, dev = backend
    skip_interpreted_dots(k)
    b, t, hq, hkv, d = 2, 9, 4, 2, 16
    g = torch.Generator().manual_seed(11)
    q, kk, vv = (rand(g, b, t, h, d, device=dev) for h in (hq, hkv, hkv))
    mask = torch.ones(b, t, dtype=torch.long, device=dev)
    mask[1, :3] = 0
    padding = Padding(mask)
    for _ in range(2):  # the second call reuses the first's sorts
        assert torch.equal(k.padded_attention(q, kk, vv, padding), k.padded_attention(q, kk, vv, mask))
    # In the front layout (the model's, with an invariant backend): the moved rows' bits.
    front = [padding.to_front(x) for x in (q, kk, vv)]
    assert torch.equal(k.padded_attention(*front, padding.front()),
                       padding.to_front(k.padded_attention(q, kk, vv, mask)))
    # No padding: the bits of the same rows behind one padding token, which takes the moves.
    all_real = torch.ones(b, t, dtype=torch.long, device=dev)
    unpadded = k.padded_attention(q, kk, vv, Padding(None))
    behind = [torch.cat([x[:, :1], x], dim=1) for x in (q, kk, vv)]
    one_pad = torch.cat([torch.zeros_like(all_real[:, :1]), all_real], dim=1)
    assert torch.equal(k.padded_attention(*behind, one_pad)[:, 1:], unpadded)
    assert torch.equal(k.padded_attention(q, kk, vv, None), unpadded)
    assert torch.equal(k.padded_attention(q, kk, vv, all_real), unpadded)


# ---- gradients -------------------------------------------------------------------------


def test_gradients_are_torchs_and_deterministic(backend):
    """The backward is stock torch's: close to the plain path's gradient (the forwards
    differ in summation order only) and the same bits on every run."""
    k, dev = backend
    g = torch.Generator().manual_seed(9)
    w = rand(g, 48, 32, device=dev, scale=0.2).requires_grad_()
    norm_w = (1 + rand(g, 48, device=dev, scale=0.1)).requires_grad_()
    x0 = rand(g, 2, 7, 32, device=dev)
    mask = torch.ones(2, 7, dtype=torch.long, device=dev)
    mask[1, :2] = 0

    def loss_and_grads(kern):
        x = x0.clone().requires_grad_()
        h = kern.rms_norm(kern.linear(x, w), norm_w, 1e-6)  # [2, 7, 48]
        heads = h.view(2, 7, 3, 16)
        att = kern.padded_attention(heads, heads[:, :, :1], heads[:, :, 1:2], mask)
        # padding positions' outputs differ between backends by design (zeros / not meaningful)
        loss = (kern.log_softmax(kern.swiglu(att.flatten(-2), h))[..., 0] * mask).sum()
        return torch.autograd.grad(loss, (x, w, norm_w))

    first, again, plain = loss_and_grads(k), loss_and_grads(k), loss_and_grads(TorchKernels)
    for a, b, p in zip(first, again, plain):
        assert torch.equal(a, b)
        assert p.abs().sum() > 0
        assert rel_err(a, p) < 1e-4  # attention's softmax and the norm reduce in other orders


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_backward_kernels_match_the_float64_gradient(dtype):
    """RMSNorm, SiLU-and-mul, rotary and log-softmax have backward kernels of their own:
    each gradient against float64 autograd of the same function, and the same bits twice;
    and the entropy's kernel (gradient by torch's formula) with its forward as well.
    37 rows: past one RMSNorm backward program's 32, so the weight gradient adds partials;
    5000 columns: two of the log-softmax's blocks. Tolerances as the forwards' (TOL); the
    log-softmax's gradient is float32 whatever the input (its output is)."""
    if "triton" not in BACKENDS:
        pytest.skip("triton is not installed, or neither a GPU nor its interpreter is here")
    k, dev = backend_and_device("triton")
    g = torch.Generator().manual_seed(11)
    x = rand(g, 37, 48, dtype=dtype, device=dev)
    norm_w = (1 + rand(g, 48, scale=0.1)).to(dtype).to(dev)
    heads = rand(g, 5, 3, 64, dtype=dtype, device=dev)
    positions = torch.tensor([0, 3, 7, 100, 1000])
    cos, sin = (t[positions].to(dev) for t in rope_tables(64, 10000.0, 1024))
    cos96, sin96 = (t[positions].to(dev) for t in rope_tables(96, 10000.0, 1024))  # phi3's partial rotary
    wide_heads = rand(g, 5, 3, 128, dtype=dtype, device=dev)
    logits = rand(g, 6, 5000, device=dev, scale=3.0)
    cases = {  # name: (function of (kernels, *inputs), inputs)
        "rms_norm": (lambda kern, a, w: kern.rms_norm(a, w, 1e-6), (x, norm_w)),
        "swiglu": (lambda kern, a, b: kern.swiglu(a, b), (x, x.flip(0))),
        "geglu": (lambda kern, a, b: kern.geglu(a, b), (x, x.flip(0))),
        "rotary": (lambda kern, a: kern.apply_rotary(a, cos, sin), (heads,)),
        "partial_rotary": (lambda kern, a: kern.apply_rotary(a[..., :96], cos96, sin96), (wide_heads,)),
        "log_softmax": (lambda kern, a: kern.log_softmax(a)[torch.arange(6), torch.tensor([1, 7, 4095, 4096, 4999, 0])],
                        (logits,)),
        "entropy": (lambda kern, a: kern.entropy(kern.log_softmax(a)), (logits,)),
    }
    for name, (fn, inputs) in cases.items():
        weights = rand(torch.Generator().manual_seed(12), *fn(TorchKernels, *inputs).shape, device=dev)

        def grads(kern, cast):
            leaves = [cast(t).detach().requires_grad_() for t in inputs]
            out = fn(kern, *leaves)
            return torch.autograd.grad((out.double() * weights.double()).sum(), leaves)

        if name == "entropy":
            assert rel_err(fn(k, *inputs), fn(ReferenceKernels, *(t.double() for t in inputs))) < TOL[torch.float32]
        first, again = grads(k, lambda t: t), grads(k, lambda t: t)
        ref = grads(ReferenceKernels, lambda t: t.double())
        for i, (a, b, r) in enumerate(zip(first, again, ref)):
            assert torch.equal(a, b), f"{name}: gradient {i} changed between two runs"
            tol = TOL[torch.float32 if name == "log_softmax" else dtype]
            assert rel_err(a, r) < tol, f"{name}: gradient {i} is {rel_err(a, r):.2e} from float64's"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_fused_token_log_probs_are_the_log_softmax_bits_and_their_gradient(dtype, temperature):
    """The trainer's log-probs (`token_log_probs`, one Triton pass over the LM head's
    logits): torch.equal to the log-softmax kernel's output at the tokens and to the entropy
    kernel on it (the engine's sampler shares that arithmetic); the gradient of log-probs
    plus entropy against float64 autograd (TOL of the logits' dtype: the gradient is
    written in it), the same bits twice, and right without the entropy too.
    5000 columns: two blocks; temperature 0 counts as 1 (greedy)."""
    if "triton" not in BACKENDS:
        pytest.skip("triton is not installed, or neither a GPU nor its interpreter is here")
    from reprorl.kernels.shared import scale_logits

    k, dev = backend_and_device("triton")
    g = torch.Generator().manual_seed(13)
    logits = rand(g, 2, 3, 5000, dtype=dtype, device=dev, scale=3.0)
    tokens = torch.tensor([[1, 7, 4095], [4096, 4999, 0]], device=dev)
    log_probs, entropy = k.token_log_probs(logits, tokens, temperature, with_entropy=True)
    log_p = k.log_softmax(scale_logits(logits, temperature))
    assert torch.equal(log_probs, log_p.gather(-1, tokens.unsqueeze(-1)).squeeze(-1))
    assert torch.equal(entropy, k.entropy(log_p))
    assert k.token_log_probs(logits, tokens, temperature)[1] is None

    w_lp, w_h = rand(g, 2, 3, device=dev), rand(g, 2, 3, device=dev)

    def grads(kern, cast, with_entropy=True):
        x = cast(logits).detach().requires_grad_()
        lp, h = kern.token_log_probs(x, tokens, temperature, with_entropy=with_entropy)
        loss = (lp.double() * w_lp.double()).sum() + ((h.double() * w_h.double()).sum() if with_entropy else 0)
        return torch.autograd.grad(loss, x)[0]

    for with_entropy in (True, False):
        first, again = grads(k, lambda t: t, with_entropy), grads(k, lambda t: t, with_entropy)
        ref = grads(ReferenceKernels, lambda t: t.double(), with_entropy)
        assert first.dtype == dtype and torch.equal(first, again)
        assert rel_err(first, ref) < TOL[dtype], f"entropy in the loss: {with_entropy}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d,b,tq,max_start,window", [
    (4, 2, 64, 2, 1, 150, 0), (6, 2, 32, 3, 9, 70, 0), (2, 1, 16, 2, 70, 0, 0), (14, 2, 64, 2, 40, 90, 0),
    (4, 1, 256, 1, 40, 90, 0),  # Gemma 3's heads
    (4, 2, 16, 2, 70, 80, 3), (4, 2, 16, 2, 70, 80, 64), (4, 2, 16, 2, 70, 80, 100),  # sliding windows
])
def test_triton_attention_backward_matches_the_float64_gradient(dtype, hq, hkv, d, b, tq, max_start, window):
    """Attention's two backward kernels (dK and dV per key block, dQ per query block):
    dq, dk and dv against float64 autograd of the same attention, and the same bits twice.
    Cases: decode rows at late positions, chunks after a prefix, a prefix alone past one
    key block (70 keys), Qwen2.5-0.5B's 14/2 heads past one row block (40 x 7 rows), heads
    of 256, and 70 queries in windows after starts up to 80 (keys past one 64-key block and
    before some windows); keys past the last query are present (masked, their gradient
    zero), and so are keys before every window. Tolerances: TOL of the dtype (the bf16
    kernels round p and ds to bf16 before their matmuls)."""
    if "triton" not in BACKENDS:
        pytest.skip("triton is not installed, or neither a GPU nor its interpreter is here")
    k, dev = backend_and_device("triton")
    q, kk, vv, starts = attention_case(hq * d + tq + 1, hq, hkv, d, b, tq, max_start, dtype, dev)
    w = rand(torch.Generator().manual_seed(14), *q.shape, device=dev)

    def grads(kern, cast):
        leaves = [cast(t).detach().requires_grad_() for t in (q, kk, vv)]
        out = kern.batched_attention(*leaves, starts, window)
        return torch.autograd.grad((out.double() * w.double()).sum(), leaves)

    first, again = grads(k, lambda t: t), grads(k, lambda t: t)
    ref = grads(ReferenceKernels, lambda t: t.double())
    for name, a, a2, r in zip(("dq", "dk", "dv"), first, again, ref):
        assert torch.equal(a, a2), f"{name} changed between two runs"
        assert rel_err(a, r) < TOL[dtype], f"{name} is {rel_err(a, r):.2e} from float64's"
    keys = torch.arange(kk.shape[2], device=dev)
    unseen = keys > (starts + tq - 1)[:, None]  # [B, Tk]: keys no query sees
    if window:
        unseen |= keys < (starts - window + 1)[:, None]
    assert not first[1].abs().sum(dim=(1, 3))[unseen].any() and not first[2].abs().sum(dim=(1, 3))[unseen].any()


# ---- the start-up check ----------------------------------------------------------------

TINY = ModelArgs(model_type="qwen2", vocab_size=128, hidden_size=128, intermediate_size=384, num_hidden_layers=1,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=64)


def test_startup_check_passes(backend):
    k, dev = backend
    skip_interpreted_dots(k)
    verify_batch_invariance(k, TINY, torch.float32, dev)


def test_startup_check_names_a_broken_op(backend):
    """A backend whose linear is stock torch's (cuBLAS or MKL: kernels picked by M) fails
    the check, which names the op, the device and the backend."""
    k, dev = backend

    class Broken(k):
        name = "broken"
        linear = staticmethod(lambda x, w, b=None: TorchKernels.linear(x.double(), w.double(), None if b is None
                                                                    else b.double()).float()
                              + x.shape[0] * 1e-7)  # a row's value moves with the batch size

    with pytest.raises(BatchInvarianceError, match=r"broken kernels.*linear 128->.*differ"):
        verify_batch_invariance(Broken, TINY, torch.float32, dev)
    kernel_check._invariance_problems.cache_clear()


def test_startup_check_checks_the_models_own_activation():
    """A GeGLU model's check runs geglu (and names it when it moves with the batch); a
    SwiGLU model's does not run it."""

    class BrokenGeglu(CpuInvariantKernels):
        name = "broken-geglu"
        geglu = staticmethod(lambda gate, up: CpuInvariantKernels.geglu(gate, up) + gate.shape[0] * 1e-6)

    verify_batch_invariance(BrokenGeglu, TINY, torch.float32, "cpu")
    gemma_shape = dataclasses.replace(TINY, hidden_act="gelu_pytorch_tanh")
    with pytest.raises(BatchInvarianceError, match=r"broken-geglu kernels.*geglu over"):
        verify_batch_invariance(BrokenGeglu, gemma_shape, torch.float32, "cpu")
    kernel_check._invariance_problems.cache_clear()


def test_startup_check_skips_backends_without_the_promise():
    verify_batch_invariance(TorchKernels, TINY, torch.float32, "cpu")  # no promise, nothing to check


def test_plain_mode_on_cuda_is_stock_torch_with_tritons_element_wise_ops():
    """Determinism off on CUDA: cuBLAS linears and SDPA attention, Triton's RMSNorm, rotary
    and SiLU-and-mul (one launch each where stock torch chains several); their arithmetic
    here under the interpreter, on CUDA when there is one."""
    pytest.importorskip("triton")
    from reprorl.kernels import select_kernels
    from reprorl.kernels.gpu import FastCudaKernels, TritonKernels

    k = select_kernels("cuda", False)
    assert k is FastCudaKernels and not k.batch_invariant
    assert (k.linear, k.batched_attention, k.log_softmax) == \
        (TorchKernels.linear, TorchKernels.batched_attention, TorchKernels.log_softmax)
    assert (k.rms_norm, k.swiglu, k.apply_rotary) == \
        (TritonKernels.rms_norm, TritonKernels.swiglu, TritonKernels.apply_rotary)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(3)
    x, w = rand(g, 9, 96, device=dev), 1 + rand(g, 96, device=dev, scale=0.1)
    assert rel_err(k.rms_norm(x, w, 1e-6), ReferenceKernels.rms_norm(x, w, 1e-6)) < TOL[torch.float32]
    assert rel_err(k.swiglu(x, x.flip(-1)), ReferenceKernels.swiglu(x, x.flip(-1))) < TOL[torch.float32]
    cos, sin = (t.to(dev) for t in rope_tables(64, 10000.0, 9))
    heads = rand(g, 9, 2, 64, device=dev)
    assert rel_err(k.apply_rotary(heads, cos, sin), ReferenceKernels.apply_rotary(heads, cos, sin)) < TOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64])
def test_write_rows_is_index_put(dtype):
    """The KV cache's row writes (Triton on CUDA, interpreted here): each row copied to its
    place, every other row untouched; strided rows and source, and a 1-column int64 one."""
    pytest.importorskip("triton")
    from reprorl.kernels.gpu.rows import write_rows

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(4)
    for r, c, n in ((40, 64, 7), (9, 1, 9), (300, 1500, 3)):
        dst = (torch.randn(r, c, generator=g) * 100).to(dtype).to(dev)
        src = (torch.randn(c, n, generator=g) * 100).to(dtype).to(dev).t()  # [n, C], not contiguous
        rows = torch.randperm(r, generator=g)[:n].repeat_interleave(3).to(dev)[::3]  # strided, as a graph's slots
        expected = dst.clone()
        expected[rows] = src
        write_rows(dst, rows, src)
        assert torch.equal(dst, expected)
    with pytest.raises(ValueError, match="expected one dtype"):
        write_rows(dst, rows, src.float() if dtype != torch.float32 else src.double())
