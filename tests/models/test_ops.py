"""The op layer: hand-computed examples, batch-invariant vs plain, and row invariance.

Row invariance is checked with torch.equal: a row computed alone must be the same bits
as that row inside batches of 2..64 random rows at random positions, with 1 and 2 threads.
"""

import math
import random

import pytest
import torch

from reprorl.models import ops


def both_modes(fn):
    """fn() in plain mode and in batch-invariant mode."""
    with ops.batch_invariant(False):
        plain = fn()
    with ops.batch_invariant(True):
        invariant = fn()
    return plain, invariant


# ---- hand-computed examples ------------------------------------------------------------


def test_rms_norm_example():
    # x = [3, 4]: mean square 12.5, rms 3.5355339; weight [1, 2].
    x = torch.tensor([[3.0, 4.0]])
    expected = torch.tensor([[3 / math.sqrt(12.5), 2 * 4 / math.sqrt(12.5)]])
    for out in both_modes(lambda: ops.rms_norm(x, torch.tensor([1.0, 2.0]), eps=0.0)):
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=0)


def test_softmax_example():
    x = torch.tensor([[0.0, math.log(2), math.log(3)]])
    expected = torch.tensor([[1 / 6, 2 / 6, 3 / 6]])
    for out in both_modes(lambda: ops.softmax(x)):
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=0)
    for out in both_modes(lambda: ops.log_softmax(x)):
        torch.testing.assert_close(out, expected.log(), rtol=1e-6, atol=0)


def test_swiglu_example():
    # silu(1) = 1 / (1 + e^-1) = 0.7310586, times up = 2; silu(0) = 0.
    gate, up = torch.tensor([1.0, 0.0]), torch.tensor([2.0, 5.0])
    for out in both_modes(lambda: ops.swiglu(gate, up)):
        torch.testing.assert_close(out, torch.tensor([2 / (1 + math.exp(-1)), 0.0]), rtol=1e-6, atol=0)


def test_rotary_example():
    # head_dim 2: inv_freq = [1], so position p rotates (x0, x1) by p radians.
    cos, sin = ops.rope_tables(head_dim=2, theta=10000.0, num_positions=3)
    x = torch.tensor([[[1.0, 0.0]], [[1.0, 0.0]], [[0.0, 1.0]]])  # [T=3, H=1, D=2]
    out = ops.apply_rotary(x, cos, sin)
    expected = torch.tensor([[[1.0, 0.0]], [[math.cos(1), math.sin(1)]], [[-math.sin(2), math.cos(2)]]])
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-7)


def test_linear_example():
    x = torch.tensor([[1.0, 2.0]])
    w = torch.tensor([[1.0, 0.0], [0.5, -1.0], [2.0, 3.0]])
    for out in both_modes(lambda: ops.linear(x, w, torch.tensor([0.0, 1.0, -8.0]))):
        assert torch.equal(out, torch.tensor([[1.0, -0.5, 0.0]]))


def test_invariant_sums_differentiable_after_inference_mode():
    """The invariant norm and log-softmax, first called under inference_mode, still serve autograd."""
    x = torch.randn(3, 48)
    with ops.batch_invariant():
        with torch.inference_mode():
            ops.rms_norm(x, torch.ones(48), 1e-6)
        y = x.clone().requires_grad_()
        ops.log_softmax(ops.rms_norm(y, torch.ones(48), 1e-6))[:, 0].sum().backward()
    assert y.grad is not None and torch.isfinite(y.grad).all()


def test_batch_invariant_context_restores_the_mode():
    assert not ops.is_batch_invariant()
    with ops.batch_invariant():
        assert ops.is_batch_invariant()
        with ops.batch_invariant(False):
            assert not ops.is_batch_invariant()
        assert ops.is_batch_invariant()
    assert not ops.is_batch_invariant()


# ---- batch-invariant path vs plain path ------------------------------------------------

OPS = {
    "linear": (lambda x, p: ops.linear(x, p["w"], p["b"]), 256),
    "linear_odd": (lambda x, p: ops.linear(x, p["w_odd"]), 100),
    "linear_n1": (lambda x, p: ops.linear(x, p["w_n1"]), 256),
    "rms_norm": (lambda x, p: ops.rms_norm(x, p["g"], 1e-6), 256),
    "swiglu": (lambda x, p: ops.swiglu(x, x.flip(-1)), 256),
    "softmax": (lambda x, p: ops.softmax(x), 256),
    "log_softmax": (lambda x, p: ops.log_softmax(x * 4), 256),
}


@pytest.fixture(scope="module")
def params():
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(384, 256, generator=g) * 0.05,
        "b": torch.randn(384, generator=g),
        "w_odd": torch.randn(37, 100, generator=g) * 0.1,
        "w_n1": torch.randn(1, 256, generator=g) * 0.05,
        "g": 1 + 0.1 * torch.randn(256, generator=g),
    }


# rms_norm, softmax and log_softmax are the same torch op in both modes: nothing to compare.
@pytest.mark.parametrize("name", sorted(set(OPS) - {"rms_norm", "softmax", "log_softmax"}))
def test_invariant_op_matches_plain(name, params):
    fn, width = OPS[name]
    x = torch.randn(33, width, generator=torch.Generator().manual_seed(1))
    plain, invariant = both_modes(lambda: fn(x, params))
    # float32 with a different summation order: a few ulps of O(1) values.
    torch.testing.assert_close(invariant, plain, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(OPS))
def test_op_rows_are_batch_invariant(name, params):
    fn, width = OPS[name]
    rng = random.Random(name)
    gen = torch.Generator().manual_seed(2)
    row = torch.randn(1, width, generator=gen)
    with ops.batch_invariant():
        torch.set_num_threads(1)
        alone = fn(row, params)[0]
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for m in (2, 3, 4, 5, 7, 8, 13, 16, 31, 64):
                batch = torch.randn(m, width, generator=gen)
                pos = rng.randrange(m)
                batch[pos] = row[0]
                assert torch.equal(fn(batch, params)[pos], alone), (name, threads, m, pos)


def test_row_harness_detects_plain_silu():
    """The check above can fail: plain F.silu rounds differently in its scalar tail, so a
    row of 7 alone (all tail) and inside a batch (mostly vector path) differ somewhere."""
    gen = torch.Generator().manual_seed(3)
    differs = False
    for _ in range(50):
        row = torch.randn(1, 7, generator=gen) * 4
        batch = torch.cat([row, torch.randn(15, 7, generator=gen)])
        differs |= not torch.equal(ops.swiglu(row, row)[0], ops.swiglu(batch, batch)[0])
    if not differs:
        pytest.skip("this build's F.silu happens to be position-independent")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_rows_invariant_3d_input(dtype):
    g = torch.Generator().manual_seed(4)
    w = (torch.randn(192, 128, generator=g) * 0.05).to(dtype)
    x = torch.randn(3, 5, 128, generator=g).to(dtype)
    with ops.batch_invariant():
        full = ops.linear(x, w)
        for b in range(3):
            for t in range(5):
                assert torch.equal(ops.linear(x[b, t], w), full[b, t])


# ---- attention -------------------------------------------------------------------------


def reference_attention(q, k, v, q_start):
    """Plain float64 loop: query i, head j softmax(q k^T / sqrt(D)) v over keys 0..q_start+i."""
    tq, hq, d = q.shape
    group = hq // k.shape[1]
    out = torch.zeros(tq, hq, d, dtype=torch.float64)
    for i in range(tq):
        for j in range(hq):
            keys = k[: q_start + i + 1, j // group].double()
            weights = torch.softmax(keys @ q[i, j].double() / math.sqrt(d), dim=0)
            out[i, j] = weights @ v[: q_start + i + 1, j // group].double()
    return out


def random_qkv(tq, tk, hq, hkv, d, seed):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(tq, hq, d, generator=g),
        torch.randn(tk, hkv, d, generator=g),
        torch.randn(tk, hkv, d, generator=g),
    )


@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 16), (3, 1, 64), (2, 2, 40)])
@pytest.mark.parametrize("q_start", [0, 5])
def test_attention_matches_reference(hq, hkv, d, q_start):
    q, k, v = random_qkv(9, q_start + 9 + 3, hq, hkv, d, seed=hq + d)  # 3 extra keys must be ignored
    expected = reference_attention(q, k, v, q_start).float()
    for out in both_modes(lambda: ops.attention(q, k, v, q_start)):
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_attention_is_chunking_invariant():
    """A query gives the same bits in a whole prefill, in chunks, decoded alone, and with
    keys after it present. 300 tokens cross the 256-query block and several KEY_BLOCK key chunks."""
    q, k, v = random_qkv(300, 310, 4, 2, 32, seed=5)
    with ops.batch_invariant():
        whole = ops.attention(q, k[:300], v[:300], 0)
        assert torch.equal(ops.attention(q, k, v, 0), whole)  # 10 future keys, masked
        pieces, start = [], 0
        for n in (1, 3, 7, 16, 13, 200, 60):
            pieces.append(ops.attention(q[start : start + n], k[: start + n], v[: start + n], start))
            start += n
        assert torch.equal(torch.cat(pieces), whole)
        for i in (0, 1, 2, 39, 254, 255, 256, 257, 299):
            assert torch.equal(ops.attention(q[i : i + 1], k[: i + 1], v[: i + 1], i)[0], whole[i])


def test_attention_block_sizes_are_invisible(monkeypatch):
    """Query blocks and key chunks are cut at fixed sizes; other sizes give the same values
    (to rounding: a different key chunk is a different summation order)."""
    q, k, v = random_qkv(40, 40, 2, 1, 16, seed=6)
    with ops.batch_invariant():
        whole = ops.attention(q, k, v, 0)
        monkeypatch.setattr(ops, "QUERY_BLOCK", 3)
        assert torch.equal(ops.attention(q, k, v, 0), whole)
        monkeypatch.setattr(ops, "KEY_BLOCK", 16)
        small_chunks = ops.attention(q, k, v, 0)
        torch.testing.assert_close(small_chunks, whole, rtol=1e-5, atol=1e-6)
        for i in (15, 16, 17, 39):  # a decode step sums its chunks like the prefill did
            assert torch.equal(ops.attention(q[i : i + 1], k[: i + 1], v[: i + 1], i)[0], small_chunks[i])


def batched_case(seed, hq, hkv, d, b, tq, max_start):
    """q [B, Hq, Tq, D], k/v [B, Hkv, Tk, D] with random starts, and the starts."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, max_start + 1, (b,), generator=g)
    tk = int(starts.max()) + tq + 5  # keys past the last query must be masked
    return (
        torch.randn(b, hq, tq, d, generator=g),
        torch.randn(b, hkv, tk, d, generator=g),
        torch.randn(b, hkv, tk, d, generator=g),
        starts,
    )


def single(q, k, v, start, tq):
    """Sequence b of a batched case through `attention` alone, over its own keys: [Hq, Tq, D]."""
    keys = k[:, : start + tq].transpose(0, 1)
    return ops.attention(q.transpose(0, 1), keys, v[:, : start + tq].transpose(0, 1), start).transpose(0, 1)


@pytest.mark.parametrize(
    "hq,hkv,d,b,tq,max_start",
    [
        (2, 1, 64, 9, 1, 300),  # decode: lengths on both sides of KEY_BLOCK
        (14, 2, 64, 5, 1, 700),
        (4, 4, 40, 6, 3, 20),  # head_dim padded to COL_QUANTUM
        (6, 2, 16, 4, 17, 260),  # prefill chunks after a cached prefix
        (3, 1, 32, 3, 300, 0),  # whole prompts across a QUERY_BLOCK
    ],
)
def test_batched_attention_rows_equal_single_sequence_attention(hq, hkv, d, b, tq, max_start):
    """The vectorised path against its plain reference, `attention` one sequence at a time:
    bitwise in batch-invariant mode, to float32 rounding in plain mode (SDPA vs matmuls)."""
    q, k, v, starts = batched_case(hq * d + tq, hq, hkv, d, b, tq, max_start)
    for invariant in (False, True):
        with ops.batch_invariant(invariant):
            out = ops.batched_attention(q, k, v, starts)
            for i, start in enumerate(starts.tolist()):
                alone = single(q[i], k[i], v[i], start, tq)
                if invariant:
                    assert torch.equal(out[i], alone), (i, start)
                    # and alone through the batched path itself
                    assert torch.equal(ops.batched_attention(q[i : i + 1], k[i : i + 1], v[i : i + 1], starts[i : i + 1])[0], alone)
                else:
                    torch.testing.assert_close(out[i], alone, rtol=1e-5, atol=1e-5)


def test_batched_attention_groups_and_extra_keys_are_invisible(monkeypatch):
    """Splitting the batch into groups (a tiny SCORE_ELEMENTS), shorter query padding, and
    stale keys past every query change no bit of a real row."""
    q, k, v, starts = batched_case(11, 4, 2, 32, 7, 5, 280)
    with ops.batch_invariant():
        whole = ops.batched_attention(q, k, v, starts)
        monkeypatch.setattr(ops, "SCORE_ELEMENTS", 1)  # one sequence per group
        assert torch.equal(ops.batched_attention(q, k, v, starts), whole)
        stale = torch.cat([k, torch.randn(7, 2, 300, 32)], dim=2), torch.cat([v, torch.randn(7, 2, 300, 32)], dim=2)
        assert torch.equal(ops.batched_attention(q, *stale, starts), whole)
        first = ops.batched_attention(q[:, :, :2], k, v, starts)  # the first 2 queries of each
        assert torch.equal(first, whole[:, :, :2])


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_attention(side):
    b, t, hq, hkv, d = 3, 10, 4, 2, 16
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(b, t, h, d, generator=g) for h in (hq, hkv, hkv))
    lengths = [10, 6, 1]
    mask = torch.zeros(b, t, dtype=torch.long)
    for i, n in enumerate(lengths):
        if side == "left":
            mask[i, t - n :] = 1
        else:
            mask[i, :n] = 1
    plain, invariant = both_modes(lambda: ops.padded_attention(q, k, v, mask))
    for i in range(b):
        real = mask[i].bool()
        with ops.batch_invariant():
            alone = ops.attention(q[i, real], k[i, real], v[i, real], 0)
        assert torch.equal(invariant[i, real], alone)
        torch.testing.assert_close(plain[i, real], alone, rtol=1e-5, atol=1e-5)
        assert torch.isfinite(plain[i]).all()


# ---- wide sweep ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("k,n", [(896, 4864), (4864, 896), (2048, 8192), (896, 32000), (100, 37), (3584, 1)])
def test_linear_rows_invariant_wide(k, n):
    """Model-sized shapes (Qwen2.5-0.5B's MLP and a vocab projection), rows 1..300, 1-4 threads."""
    g = torch.Generator().manual_seed(k + n)
    w = torch.randn(n, k, generator=g) * 0.02
    row = torch.randn(1, k, generator=g)
    rng = random.Random(k * n)
    with ops.batch_invariant():
        torch.set_num_threads(1)
        alone = ops.linear(row, w)[0]
        for threads in (1, 2, 3, 4):
            torch.set_num_threads(threads)
            for m in (2, 3, 4, 5, 6, 9, 17, 64, 65, 300):
                batch = torch.randn(m, k, generator=g)
                pos = rng.randrange(m)
                batch[pos] = row[0]
                assert torch.equal(ops.linear(batch, w)[pos], alone), (threads, m, pos)


@pytest.mark.slow
def test_batched_attention_threads():
    q, k, v, starts = batched_case(12, 14, 2, 64, 24, 1, 600)
    with ops.batch_invariant():
        torch.set_num_threads(1)
        alone = [single(q[i], k[i], v[i], int(s), 1) for i, s in enumerate(starts)]
        for threads in (2, 3):
            torch.set_num_threads(threads)
            out = ops.batched_attention(q, k, v, starts)
            for i in range(len(starts)):
                assert torch.equal(out[i], alone[i]), (threads, i)


@pytest.mark.slow
def test_attention_invariant_long_and_threads():
    q, k, v = random_qkv(600, 600, 14, 2, 64, seed=8)
    with ops.batch_invariant():
        torch.set_num_threads(1)
        whole = ops.attention(q, k, v, 0)
        for threads in (2, 3):
            torch.set_num_threads(threads)
            for i in (0, 17, 255, 256, 599):
                assert torch.equal(ops.attention(q[i : i + 1], k[: i + 1], v[: i + 1], i)[0], whole[i])


@pytest.mark.slow
@pytest.mark.parametrize("name,width", [("log_softmax", 151936), ("log_softmax", 32000), ("rms_norm", 3584)])
def test_fixed_width_sums_rows_invariant_wide(name, width):
    """The fused row reductions at a real vocabulary's and hidden size's width."""
    fn = {"log_softmax": lambda x: ops.log_softmax(x * 3), "rms_norm": lambda x: ops.rms_norm(x, torch.ones(width), 1e-6)}[name]
    g = torch.Generator().manual_seed(width)
    row = torch.randn(1, width, generator=g)
    rng = random.Random(width)
    with ops.batch_invariant():
        torch.set_num_threads(1)
        alone = fn(row)[0]
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for m in (2, 3, 4, 5, 9, 17, 64):
                batch = torch.randn(m, width, generator=g)
                pos = rng.randrange(m)
                batch[pos] = row[0]
                assert torch.equal(fn(batch)[pos], alone), (threads, m, pos)


# ---- the start-up check -------------------------------------------------------------------

class _Shapes:
    hidden_size, intermediate_size, vocab_size = 128, 384, 128
    num_attention_heads, num_key_value_heads, head_dim = 2, 1, 64


def test_verify_batch_invariance_passes_here():
    ops._invariance_problems.cache_clear()
    ops.verify_batch_invariance(_Shapes, torch.float32)  # raises if this machine broke the recipe


def test_verify_batch_invariance_names_a_broken_op(monkeypatch):
    """With the row padding taken out of the invariant matmul (plain MKL: 1, 2-3 and 4+ rows
    take different kernels), the check fails at start and names the op and the CPU."""
    monkeypatch.setattr(ops, "_matmul_rows", lambda a, b, bias=None: a @ b.t() if bias is None else torch.addmm(bias, a, b.t()))
    ops._invariance_problems.cache_clear()
    try:
        with pytest.raises(ops.BatchInvarianceError, match=r"this machine \(.*torch .*\): linear 128->.*differ"):
            ops.verify_batch_invariance(_Shapes, torch.float32)
    finally:
        ops._invariance_problems.cache_clear()


def test_verify_batch_invariance_skips_other_devices():
    ops.verify_batch_invariance(_Shapes, torch.float32, device="meta")  # no CPU recipe to check there
