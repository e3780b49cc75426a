"""Sliding-window attention (`window` W > 0: a query at position p sees keys p-W+1..p) on
every backend: a hand-computed mask, agreement with the float64 reference, the invariance
gate (a token's output is the same bits in a decode step, in any prefill chunk and in the
trainer's padded batch), window 0 as today's bits, gradients (Triton's backward kernels in a
window: tests/kernels/test_invariant_kernels.py), and the argument's check.

Tolerances as tests/kernels/test_invariant_kernels.py's: float32 1e-5, bfloat16 3e-2
(‖out - ref‖ / ‖ref‖ against float64).

Under Triton's interpreter (no GPU) tl.dot is numpy's matmul, whose summation order is its
BLAS's, not the kernel's. The gate gives it inputs whose every dot product is exact in any
order (q and k multiples of 1/4; each key's value nonzero in one column only, a different
column for each key of a block), so the bits it compares are the kernel's own: its block
walk, its masks, its online softmax. On the CPU and on CUDA the inputs are plain random.
"""

import hashlib

import pytest
import torch

from kernel_backends import BACKENDS, ON_GPU, backend, backend_and_device  # noqa: F401  (the fixture)
from padded_batch import padding_mask
from reprorl.kernels import CpuInvariantKernels, ReferenceKernels, TorchKernels
from reprorl.kernels.shared import Padding

TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
WINDOWS = [1, 3, 5, 128, 130, 1000]  # 1000: longer than every sequence here
DEV = "cuda" if ON_GPU else "cpu"


def rel_err(out, ref):
    out, ref = out.double().cpu(), ref.double().cpu()
    assert torch.isfinite(out).all()
    return float((out - ref).norm() / ref.norm())


def rand(g, *shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, generator=g).to(dtype).to(device)


def every_backend():
    """(kernels, device) of each backend that runs here, the reference's comparisons' subjects."""
    found = [(TorchKernels, DEV), (CpuInvariantKernels, "cpu")]
    if "triton" in BACKENDS:
        from reprorl.kernels.gpu import FastCudaKernels, TritonKernels

        found += [(FastCudaKernels, DEV), (TritonKernels, DEV)]
    return found


# ---- the stock mask, by hand ------------------------------------------------------------


def test_sdpa_mask_by_hand_one_per_window():
    """Window 2; positions count real tokens. Left padding [pad, a, b, c]: the padding query
    sees itself only, c (position 2) sees b and c. Right [a, b, c, pad]: c sees b and c; the
    padding query (its output not meaningful) counts as position 2 too, and sees itself."""
    padding = Padding(torch.tensor([[0, 1, 1, 1], [1, 1, 1, 0]]))
    left = [[1, 0, 0, 0], [0, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]
    right = [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 1, 1, 1]]
    assert torch.equal(padding.sdpa_mask(2)[:, 0], torch.tensor([left, right], dtype=torch.bool))
    full = [[1, 0, 0, 0], [0, 1, 0, 0], [0, 1, 1, 0], [0, 1, 1, 1]]
    assert torch.equal(padding.sdpa_mask(0)[0, 0], torch.tensor(full, dtype=torch.bool))
    assert padding.sdpa_mask(2) is padding.sdpa_mask(2)  # made once, shared by every layer
    assert padding.sdpa_mask(0) is padding.sdpa_mask() and padding.sdpa_mask(0) is not padding.sdpa_mask(2)


# ---- against the float64 reference ------------------------------------------------------


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernels,dev", every_backend(), ids=lambda x: getattr(x, "name", str(x)))
def test_window_matches_reference(kernels, dev, dtype, window):
    """GQA (4 query heads on 2 kv heads): prefill chunks at starts up to 150 and decode rows
    up to 300 (with keys past the last query present, to be masked), and padded batches
    of 140 tokens, left and right (real tokens only: the stock backend's padding rows are
    not meaningful)."""
    g = torch.Generator().manual_seed(window)
    for tq, max_start in ((20, 150), (1, 300)):
        starts = torch.randint(0, max_start + 1, (3,), generator=g)
        tk = int(starts.max()) + tq + 5
        q, k, v = (rand(g, 3, h, t, 16, dtype=dtype, device=dev) for h, t in ((4, tq), (2, tk), (2, tk)))
        out = kernels.batched_attention(q, k, v, starts.to(dev), window)
        assert rel_err(out, ReferenceKernels.batched_attention(q, k, v, starts.to(dev), window)) < TOL[dtype], (tq, max_start)
    q, k, v = (rand(g, 3, 140, h, 16, dtype=dtype, device=dev) for h in (4, 2, 2))
    for side in ("left", "right"):
        mask = padding_mask((140, 70, 1), 140, side)
        mask = mask.to(dev)
        real = mask.bool()
        out = kernels.padded_attention(q, k, v, mask, window=window)
        ref = ReferenceKernels.padded_attention(q, k, v, mask, window=window)
        assert rel_err(out[real], ref[real]) < TOL[dtype], side


# ---- the invariance gate ----------------------------------------------------------------


def gate_inputs(n, hq, hkv, d, dtype, dev, exact, seed):
    """q [1, Hq, n, D], k/v [1, Hkv, n + 5, D] of one sequence (5 stale keys after it).
    `exact`: dot products exact in any order (the module doc): q, k in multiples of 1/4,
    and key j's value nonzero in column j % D only (D = the kernel's key block)."""
    g = torch.Generator().manual_seed(seed)
    if not exact:
        return tuple(rand(g, 1, h, t, d, dtype=dtype, device=dev) for h, t in ((hq, n), (hkv, n + 5), (hkv, n + 5)))
    q, k = (torch.randint(-4, 5, (1, h, t, d), generator=g) / 4 for h, t in ((hq, n), (hkv, n + 5)))
    one_column = torch.arange(n + 5)[:, None] % d == torch.arange(d)  # [Tk, D]
    v = torch.randn(1, hkv, n + 5, d, generator=g) * one_column
    return tuple(x.to(dtype).to(dev) for x in (q, k, v))


def check_window_gate(kernels, dev, dtype, window, *, n, hq, hkv, d, exact, decode_at, chunks, seed=0):
    """One sequence's n tokens in a sliding window: the whole prefill (its own keys, or with
    stale keys after them) == prefill chunks == decode steps == the sequence among others
    in one batched call (other starts, lengths and keys) == the trainer's padded batch
    (left and right padding, and the front layout of the invariant model), bit for bit."""
    q, k, v = gate_inputs(n, hq, hkv, d, dtype, dev, exact, seed)
    zero = torch.zeros(1, dtype=torch.long, device=dev)
    whole = kernels.batched_attention(q, k[:, :, :n], v[:, :, :n], zero, window)  # [1, Hq, n, D]
    assert torch.isfinite(whole).all()
    assert torch.equal(kernels.batched_attention(q, k, v, zero, window), whole), "stale keys"
    pieces, start = [], 0
    for size in chunks:
        pieces.append(kernels.batched_attention(q[:, :, start:start + size], k, v, zero + start, window))
        start += size
    assert start == n and torch.equal(torch.cat(pieces, dim=2), whole), "chunks"
    # Decode: alone, then as the middle row of a batch whose other rows sit elsewhere.
    g = torch.Generator().manual_seed(seed + 1)
    others_k, others_v = (rand(g, 3, hkv, n + 5, d, dtype=dtype, device=dev) for _ in range(2))
    for i in decode_at:
        alone = kernels.batched_attention(q[:, :, i:i + 1], k, v, zero + i, window)
        assert torch.equal(alone, whole[:, :, i:i + 1]), ("decode", i)
        batch_q = rand(g, 3, hq, 1, d, dtype=dtype, device=dev)
        batch_q[1] = q[0, :, i:i + 1]
        batch_k, batch_v = others_k.clone(), others_v.clone()
        batch_k[1], batch_v[1] = k[0], v[0]
        starts = torch.tensor([n + 4, i, (i * 7) % (n + 5)], device=dev)
        batched = kernels.batched_attention(batch_q, batch_k, batch_v, starts, window)
        assert torch.equal(batched[1:2], whole[:, :, i:i + 1]), ("decode in a batch", i)
    # The trainer's padded batch [B, T, H, D]: the sequence in row 1, 9 padding tokens
    # beside it, shorter rows of other tokens around it.
    width = n + 9
    own = [x[0].transpose(0, 1) for x in (q, k[:, :, :n], v[:, :, :n])]  # [n, H, D]
    want = whole[0].transpose(0, 1)  # [n, Hq, D]
    for side in ("left", "right"):
        mask = padding_mask((n // 2, n, 1), width, side).to(dev)
        real = mask[1].bool()
        batch = [rand(g, 3, width, x.shape[1], d, dtype=dtype, device=dev) for x in own]
        for x, seq in zip(batch, own):
            x[1, real] = seq
        padding = Padding(mask)
        assert torch.equal(kernels.padded_attention(*batch, padding, window)[1, real], want), side
        front = [padding.to_front(x) for x in batch]
        front_out = kernels.padded_attention(*front, padding.front(), window)
        assert torch.equal(front_out[1, :n], want), (side, "front layout")


@pytest.mark.parametrize("window", [1, 5, 130, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_window_gate(backend, dtype, window):
    """260 tokens: past two CPU key blocks (128) and four Triton key blocks (64), so whole
    key blocks fall outside the window (skipped) and some rows' first blocks hold none of
    their keys; decode rows at the blocks' edges."""
    kernels, dev = backend
    interpreted = kernels.name == "triton" and dev == "cpu"
    check_window_gate(kernels, dev, dtype, window, n=260, hq=4, hkv=2, d=64 if interpreted else 32,
                      exact=interpreted, decode_at=(0, 1, 63, 64, 127, 128, 129, 200, 259),
                      chunks=(1, 3, 60, 16, 120, 59, 1))


def test_window_zero_is_full_causal_attention(backend):
    """window=0 is the call without a window, and a window longer than every position
    (1000 > 150 tokens) masks nothing: the same bits as full causal attention."""
    kernels, dev = backend
    interpreted = kernels.name == "triton" and dev == "cpu"
    q, k, v = gate_inputs(150, 4, 2, 64, torch.float32, dev, interpreted, seed=3)
    starts = torch.tensor([0], device=dev)
    full = kernels.batched_attention(q, k, v, starts)
    assert torch.equal(kernels.batched_attention(q, k, v, starts, 0), full)
    assert torch.equal(kernels.batched_attention(q, k, v, starts, window=1000), full)
    heads = [x.transpose(1, 2) for x in (q, k[:, :, :150], v[:, :, :150])]
    mask = torch.ones(1, 150, dtype=torch.long, device=dev)
    mask[0, :7] = 0
    padded = kernels.padded_attention(*heads, mask)
    assert torch.equal(kernels.padded_attention(*heads, mask, 0), padded)
    assert torch.equal(kernels.padded_attention(*heads, mask, window=1000), padded)


# `cpu_window_zero_digest()` computed with the kernels as they were before the window existed
# (commit 717f0eb): the window must not move a bit of full causal attention.
CPU_WINDOW_ZERO_SHA256 = "f9866b2c20e4b1eee54a5123a7fcff9bb13616b1ae4e683e7401125230819a59"


def cpu_window_zero_digest() -> str:
    """sha256 of the CPU backend's attention at window 0 (no window argument, as before it
    existed): float32 and bfloat16, batched (GQA, two starts, past a key block) and padded."""
    g = torch.Generator().manual_seed(2024)
    batched = [torch.randn(2, h, t, 32, generator=g) for h, t in ((4, 20), (2, 300), (2, 300))]
    padded = [torch.randn(3, 140, h, 32, generator=g) for h in (4, 2, 2)]
    starts, mask = torch.tensor([0, 270]), padding_mask((140, 70, 1), 140, "left")
    digest = hashlib.sha256()
    for dtype in (torch.float32, torch.bfloat16):
        for out in (CpuInvariantKernels.batched_attention(*(x.to(dtype) for x in batched), starts),
                    CpuInvariantKernels.padded_attention(*(x.to(dtype) for x in padded), mask)):
            digest.update(out.float().numpy().tobytes())
    return digest.hexdigest()


def test_cpu_window_zero_keeps_todays_bits():
    """The CPU kernels' bits are the same on every x86-64 CPU and instruction set, so their
    window-0 outputs can be pinned, to the digest made before the window existed."""
    assert cpu_window_zero_digest() == CPU_WINDOW_ZERO_SHA256


# ---- gradients --------------------------------------------------------------------------


@pytest.mark.parametrize("window", [1, 5, 130])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_window_gradient_matches_the_reference(dtype, window):
    """The CPU backend's padded_attention takes its gradient from math_attention on its own
    products: with a window, dq, dk and dv against float64 autograd of the reference (TOL of
    the dtype), and the same bits twice. 140 tokens, left padding, GQA."""
    g = torch.Generator().manual_seed(21)
    q, k, v = (rand(g, 3, 140, h, 16, dtype=dtype) for h in (4, 2, 2))
    mask = padding_mask((140, 70, 9), 140, "left")
    w = rand(g, 3, 140, 4, 16) * mask[:, :, None, None]  # padding outputs differ by backend: weight 0

    def grads(kernels, cast):
        leaves = [cast(x).detach().requires_grad_() for x in (q, k, v)]
        out = kernels.padded_attention(*leaves, mask, window)
        return torch.autograd.grad((out.double() * w.double()).sum(), leaves)

    first, again = grads(CpuInvariantKernels, lambda x: x), grads(CpuInvariantKernels, lambda x: x)
    ref = grads(ReferenceKernels, lambda x: x.double())
    for name, a, a2, r in zip(("dq", "dk", "dv"), first, again, ref):
        assert torch.equal(a, a2), f"{name} changed between two runs"
        if window == 1 and name != "dv":  # a query sees itself only: probability 1 whatever q and k
            assert not r.any() and not a.any(), name
            continue
        assert rel_err(a, r) < TOL[dtype], f"{name} is {rel_err(a, r):.2e} from float64's"


# ---- the argument -----------------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, 2.5, True, "3", torch.tensor(3)], ids=repr)
@pytest.mark.parametrize("kernels,dev", every_backend() + [(ReferenceKernels, "cpu")],
                         ids=lambda x: getattr(x, "name", str(x)))
def test_bad_window_is_one_value_error(kernels, dev, bad):
    g = torch.Generator().manual_seed(0)
    q, k, v = (rand(g, 1, h, 4, 16, device=dev) for h in (2, 1, 1))
    message = r"^window = .*; expected an int >= 0 \(0: full causal attention, W: the last W keys\)$"
    with pytest.raises(ValueError, match=message):
        kernels.batched_attention(q, k, v, torch.zeros(1, dtype=torch.long, device=dev), bad)
    for mask in (None, torch.tensor([[0, 1, 1, 1]], device=dev)):
        with pytest.raises(ValueError, match=message):
            kernels.padded_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, window=bad)


# ---- on a CUDA GPU (skipped without one; run on the GPU machine) ------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("window", [1, 64, 128, 500, 4096])
@pytest.mark.parametrize("heads", [(14, 2, 64), (28, 4, 128)], ids=["qwen2.5-0.5b", "qwen2.5-7b"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_window_gate_on_cuda(dtype, heads, window):
    """The gate at real heads on the GPU: 1100 tokens (18 key blocks), decode rows at block
    edges, chunks from 1 to 700 tokens."""
    from reprorl.kernels.gpu import TritonKernels

    hq, hkv, d = heads
    check_window_gate(TritonKernels, "cuda", dtype, window, n=1100, hq=hq, hkv=hkv, d=d, exact=False,
                      decode_at=(0, 1, 63, 64, 127, 128, 500, 1023, 1024, 1099), chunks=(1, 7, 64, 300, 700, 28))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("window", [0, 3, 128])
def test_window_attention_replays_in_a_cuda_graph(window):
    """The engine captures its decode steps in CUDA graphs with the Triton callable: with a
    window (a constant of the kernel) it still reads nothing on the host, and a replay at
    new positions gives the eager call's bits."""
    from reprorl.kernels.gpu.attention import batched_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    b, hq, hkv, d, tk = 8, 14, 2, 64, 1024
    q = torch.randn(b, hq, 1, d, device="cuda", generator=g).bfloat16()
    k, v = (torch.randn(b, hkv, tk, d, device="cuda", generator=g).bfloat16() for _ in range(2))
    starts = torch.zeros(b, dtype=torch.long, device="cuda")
    batched_attention(q, k, v, starts, window)  # compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = batched_attention(q, k, v, starts, window)
    for positions in ([0, 1, 2, 3, 4, 5, 6, 7], [1023, 500, 129, 128, 127, 64, 3, 0]):
        starts.copy_(torch.tensor(positions))
        graph.replay()
        assert torch.equal(out, batched_attention(q, k, v, starts, window)), positions
