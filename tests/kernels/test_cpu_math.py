"""cpu_math and pinned: exp, log, sin, cos and pow within half a float ulp of the true value (so the same float as
the correctly rounded one but for near-ties), special values as IEEE's, row sums in their
documented order at any thread count, gradients against float64 autograd, the pinned
switch, and golden digests: the same bits on any x86-64 CPU (the CPU kernels' ISA test
builds the other instruction sets; these digests hold across machines and C libraries)."""

import functools
import math

import pytest
import torch

from reprorl.determinism import tensor_digest
from reprorl.kernels import cpu_math, pinned

# Digests of each function over its arguments below (`_ours_and_float64`). They move only
# with cpu_math.h's arithmetic: regenerate them on purpose, and say so in the commit.
GOLDEN = {"exp": "6d394d9b48ca121f4446d0b38ab5cd4e", "log": "094c3bc21485f269bad1a300d3bb2708",
          "sin": "d4776055e92c9fadc38131ee2fcf4e0c", "cos": "83474d16d266abcd3e0cf5ecc893f605",
          "pow": "deada8c32d57b7ab947b0bc004a7297f"}

GRID = torch.linspace(-110.0, 90.0, 1 << 20, dtype=torch.float32)
POSITIVE = torch.logspace(-44.0, 38.0, 1 << 20, dtype=torch.float32)


def _ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of float32 at |x| (the smallest subnormal at 0), in float64."""
    f = x.float().abs()
    return (torch.nextafter(f, torch.tensor(math.inf)) - f).double().clamp(min=2.0**-149)


ANGLES = torch.linspace(-1.5e6, 1.5e6, 1 << 20, dtype=torch.float32)
ROPE_EXPONENTS = torch.arange(0, 256, 2, dtype=torch.float32) / 256


def _ours_and_float64(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(cpu_math's float32 result, float64's) of `name` over its test arguments."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pinned, "_pinned", True)
        if name == "exp":
            return cpu_math.exp(GRID), torch.exp(GRID.double())
        if name == "log":
            return cpu_math.log(POSITIVE), torch.log(POSITIVE.double())
        if name in ("sin", "cos"):
            sin, cos = pinned.pinned_sincos(ANGLES)
            return (sin if name == "sin" else cos), getattr(torch, name)(ANGLES.double())
        bases = (10000.0, 500000.0, 1e6, 1.5)
        return (torch.cat([pinned.pinned_pow(b, ROPE_EXPONENTS) for b in bases]),
                torch.cat([b ** ROPE_EXPONENTS.double() for b in bases]))


@pytest.mark.parametrize("name", ["exp", "log", "sin", "cos", "pow"])
def test_within_half_an_ulp_of_the_float64_value(name):
    ours, true = _ours_and_float64(name)
    ours = ours.double()
    finite = true.abs() < torch.finfo(torch.float32).max
    err = (ours - true).abs()[finite] / _ulp(true[finite])
    # half an ulp, plus the float64 reference's own error and the polynomial's (< 1e-12 ulp)
    assert err.max().item() <= 0.5 + 1e-6, f"{name}: {err.max().item():.3f} ulp from float64's"


def test_special_values():
    inf, nan = math.inf, math.nan
    e = cpu_math.exp(torch.tensor([nan, -inf, inf, 0.0, -0.0, 89.0, -104.0, 1.0]))
    assert e[0].isnan() and e[1:].tolist() == [0.0, inf, 1.0, 1.0, inf, 0.0, float(torch.tensor(math.e))]
    lg = cpu_math.log(torch.tensor([nan, -1.0, 0.0, -0.0, inf, 1.0, 2.0**-149]))
    assert lg[0].isnan() and lg[1].isnan()
    assert lg[2:].tolist() == [-inf, -inf, inf, 0.0, float(torch.tensor(-149 * math.log(2.0)))]


def test_row_sums_take_sixteen_lanes_then_a_fixed_tree():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 37, generator=g) * 1e3
    lanes = [torch.zeros(5) for _ in range(16)]
    for i in range(37):
        lanes[i % 16] = lanes[i % 16] + x[:, i]
    width = 8
    while width:
        for lane in range(width):
            lanes[lane] = lanes[lane] + lanes[lane + width]
        width //= 2
    assert torch.equal(cpu_math.row_sums(x), lanes[0])


def test_the_bits_do_not_depend_on_the_thread_count():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(300, 4097, generator=g) * 5
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 4):
            torch.set_num_threads(n)
            results.append([cpu_math.exp(x), cpu_math.log(x.abs()), cpu_math.softmax(x), cpu_math.log_softmax(x),
                            cpu_math.entropy(cpu_math.log_softmax(x)), cpu_math.row_sums(x)])
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


@pytest.mark.parametrize("n", [pinned.TORCH_SERIAL_SUM + 1, 1_000_003])
def test_a_long_sum_is_the_same_bits_at_any_thread_count(n):
    # torch's own x.sum() of these, in its portable build (as under full determinism and in
    # these tests), gives two or three different floats over 1..8 threads.
    g = torch.Generator().manual_seed(2)
    x = (torch.rand(n, dtype=torch.float64, generator=g) * torch.rand(n, dtype=torch.float64, generator=g) ** 8)
    x.requires_grad_(True)
    threads = torch.get_num_threads()
    try:
        sums = set()
        for t in (1, 2, 3, 8):
            torch.set_num_threads(t)
            sums.add(pinned.thread_free_sum(x).item())
    finally:
        torch.set_num_threads(threads)
    assert len(sums) == 1
    assert sums.pop() == pytest.approx(math.fsum(x.tolist()), rel=1e-14)
    pinned.thread_free_sum(x).backward()
    assert torch.equal(x.grad, torch.ones_like(x))


def test_a_short_sum_is_torchs():
    x = torch.randn(pinned.TORCH_SERIAL_SUM, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    assert torch.equal(pinned.thread_free_sum(x), x.sum())


def test_golden_digests():
    digests = {name: tensor_digest(_ours_and_float64(name)[0]) for name in GOLDEN}
    assert digests == GOLDEN, f"cpu_math's bits moved: {digests}"


def test_row_functions_match_float64_and_their_gradients_are_autograds():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(7, 5000, generator=g) * 4
    x[0, :10] = -math.inf  # masked entries, as attention's
    cases = {"softmax": (cpu_math.softmax, lambda t: torch.softmax(t, -1)),
             "log_softmax": (cpu_math.log_softmax, lambda t: torch.log_softmax(t, -1)),
             "entropy": (lambda t: cpu_math.entropy(cpu_math.log_softmax(t)),
                         lambda t: -(torch.softmax(t, -1) * torch.log_softmax(t, -1)).nan_to_num().sum(-1)),
             "exp": (cpu_math.exp, torch.exp)}
    for name, (ours, reference) in cases.items():
        # exp of -inf is 0 with a NaN gradient in torch too; entropy needs finite log-probs
        a = (x[1:] if name in ("exp", "entropy") else x).clone().requires_grad_()
        b = a.detach().double().requires_grad_()
        out, ref = ours(a), reference(b)
        finite = ref.isfinite()
        assert torch.equal(out.isfinite(), finite), name
        assert (out.double() - ref)[finite].abs().max() <= 1e-5 * ref[finite].abs().max().clamp(min=1), name
        w = torch.randn(out.shape, generator=g, dtype=torch.float64)
        (ga,) = torch.autograd.grad((out.double() * w).sum(), a)
        (gb,) = torch.autograd.grad((ref * w).sum(), b)
        assert (ga.double() - gb).abs().max() <= 1e-4 * gb.abs().max(), f"{name}: gradient"


@pytest.mark.parametrize("name,seed,torch_act", [
    ("swiglu", 3, torch.nn.functional.silu),
    ("geglu", 4, functools.partial(torch.nn.functional.gelu, approximate="tanh")),
])
def test_gated_activation_with_and_without_grad_are_the_same_bits_and_match_torch(name, seed, torch_act):
    gated = getattr(cpu_math, name)
    g = torch.Generator().manual_seed(seed)
    gate, up = torch.randn(9, 300, generator=g) * 6, torch.randn(9, 300, generator=g)
    with torch.no_grad():
        bare = gated(gate, up)
    traced = gated(gate.requires_grad_(), up)
    assert torch.equal(bare, traced.detach())
    assert (bare.double() - torch_act(gate.detach().double()) * up.double()).abs().max() < 1e-5


def test_pinned_functions_follow_the_pin(monkeypatch):
    x = torch.linspace(-20, 20, 10001)
    monkeypatch.setattr(pinned, "_pinned", False)
    assert torch.equal(pinned.pinned_exp(x), torch.exp(x))
    assert torch.equal(pinned.pinned_softmax(x[None]), torch.softmax(x[None], -1))
    monkeypatch.setattr(pinned, "_pinned", True)
    assert torch.equal(pinned.pinned_exp(x), cpu_math.exp(x))
    assert torch.equal(pinned.pinned_log_softmax(x[None]), cpu_math.log_softmax(x[None]))
    assert torch.equal(pinned.pinned_softmax(x[None].double()), cpu_math.softmax(x[None].double()))


def test_sqrt_is_ieees(monkeypatch):
    """torch's CPU sqrt is MKL's vector math on these machines, whose bits differ between an
    AMD and an Intel CPU; pinned_sqrt is the IEEE root (float64's root rounded to float32
    is the correctly rounded float32 root)."""
    monkeypatch.setattr(pinned, "_pinned", True)
    x = torch.cat([POSITIVE, torch.tensor([0.0, -0.0, math.inf, 2.0**-149])])
    assert torch.equal(pinned.pinned_sqrt(x), torch.sqrt(x.double()).float())
    assert pinned.pinned_sqrt(torch.tensor([-1.0])).isnan().all()
