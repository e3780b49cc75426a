"""The optimizer's element-wise arithmetic (reprorl/kernels/optim_math.py): every step one
IEEE operation rounded once, on the host's kernel and on a GPU's torch ops alike."""

import numpy as np
import pytest
import torch

from reprorl.kernels.optim_math import AdamWScalars, adamw_step_, adamw_torch, chunk_sums_of_squares, f32

needs_cuda = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _state(n: int, seed: int) -> list[torch.Tensor]:
    """p, g, m, v over many magnitudes, with zeros and subnormal gradients among them."""
    g = torch.Generator().manual_seed(seed)
    scale = lambda lo, hi: 10.0 ** torch.randint(lo, hi, (n,), generator=g).float()  # noqa: E731
    p = torch.randn(n, generator=g) * scale(-6, 3)
    grad = torch.randn(n, generator=g) * scale(-44, 2)  # down to float32's subnormals
    grad[::97] = 0.0
    m = torch.randn(n, generator=g) * scale(-9, 0)
    v = torch.rand(n, generator=g) * scale(-16, 0)
    return [p, grad, m, v]


SCALARS = AdamWScalars.of(lr=3e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, grad_scale=0.37,
                          bias1=1 - 0.9**7, bias2=(1 - 0.999**7) ** 0.5)


def _reference(p, g, m, v, s: AdamWScalars):
    """The step in float64, rounded to float32 after every operation: for +, -, *, / and sqrt
    that is the float32 operation rounded once (float64 holds the exact product of two
    float32 values, and its rounding before the second is innocuous)."""
    r = lambda x: x.astype(np.float32).astype(np.float64)  # noqa: E731
    p, g, m, v = (t.double().numpy() for t in (p, g, m, v))
    g = r(g * s.grad_scale)
    p = r(p * s.decay)
    m = r(r(m * s.beta1) + r(g * s.rest1))
    v = r(r(v * s.beta2) + r(r(g * g) * s.rest2))
    denom = r(r(r(np.sqrt(v)) / s.bias2) + s.eps)
    p = r(p - r(r(m / denom) * s.step_size))
    return [torch.from_numpy(x.astype(np.float32)) for x in (p, m, v)]


def test_the_hosts_adamw_rounds_each_operation_once():
    p, g, m, v = _state(50_021, seed=0)
    want = _reference(p, g, m, v, SCALARS)
    adamw_step_(p, g, m, v, SCALARS)
    for got, ref in zip((p, m, v), want):
        assert torch.equal(got, ref)


def test_the_hosts_adamw_does_not_follow_the_thread_count():
    runs = []
    for threads in (1, 2):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            state = _state(300_007, seed=1)
            adamw_step_(*state, SCALARS)
        finally:
            torch.set_num_threads(before)
        runs.append(state)
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_scalars_are_float32_values():
    assert all(f32(x) == x for x in SCALARS.as_list())
    assert f32(0.1) != 0.1 and f32(f32(0.1)) == f32(0.1)


def _halving(x: torch.Tensor, width: int) -> torch.Tensor:
    s = (x * x).view(-1, width).double().numpy().astype(np.float32)
    while s.shape[1] > 1:
        half = s.shape[1] // 2
        s = s[:, :half] + s[:, half:]
    return torch.from_numpy(s[:, 0].copy())


def test_chunk_sums_halve_in_a_fixed_order():
    x = torch.randn(4096 * 9, generator=torch.Generator().manual_seed(2))
    got = chunk_sums_of_squares(x, 4096)
    assert torch.equal(got, _halving(x, 4096))
    in_turn = torch.from_numpy(np.cumsum((x * x).view(-1, 4096).numpy(), axis=1)[:, -1].copy())
    assert not torch.equal(got, in_turn)  # another order gives other bits: the order is what is pinned
    with pytest.raises(ValueError, match="whole chunks"):
        chunk_sums_of_squares(x[:-1], 4096)


@pytest.mark.parametrize("offset", [0, 1])
def test_the_kernel_needs_contiguous_float32(offset):
    p, g, m, v = _state(64, seed=3)
    with pytest.raises(ValueError, match="g must be contiguous float32 on the host, got torch.float64"):
        adamw_step_(p, g.double(), m, v, SCALARS)
    with pytest.raises(ValueError, match="p must be contiguous float32 on the host, got torch.float32, not contig"):
        adamw_step_(p[offset::2], g[offset::2], m[offset::2], v[::2], SCALARS)
    with pytest.raises(ValueError, match=r"m is \(63,\) on cpu, p \(64,\) on cpu"):
        adamw_step_(p, g, m[1:], v, SCALARS)


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=needs_cuda)])
def test_a_gpu_steps_as_the_host(device):
    """What makes `optimizer_offload` change no bit: torch's ops on the GPU (`adamw_torch`)
    and the host's kernel give the same parameter and moments, and the same chunk sums."""
    host = _state(1_000_003, seed=4)
    gpu = [t.to(device) for t in host]
    adamw_step_(*host, SCALARS)
    adamw_torch(*gpu, SCALARS)
    assert all(torch.equal(a, b.cpu()) for a, b in zip(host, gpu))
    x = _state(4096 * 301, seed=5)[0]
    assert torch.equal(chunk_sums_of_squares(x, 4096), chunk_sums_of_squares(x.to(device), 4096).cpu())
