"""The learning-rate schedule, gradient clipping and the guarded optimizer step."""

import math

import pytest
import torch

from reprorl.workers.optim import (
    LRSchedule,
    NonFiniteError,
    OptimArgs,
    clip_grads,
    exact_cos,
    exact_power,
    guarded_step,
    lr_multiplier,
    make_adamw,
    set_lr,
    step_in_chunks,
)


def test_constant_with_warmup():
    got = [lr_multiplier(s, warmup_steps=4, total_steps=10, schedule="constant") for s in range(6)]
    assert got == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert lr_multiplier(0, warmup_steps=0, total_steps=10, schedule="constant") == 1.0


def test_cosine_with_warmup():
    # warmup 2, total 6: after warm-up p = (s - 2) / 4 -> 0.5 * (1 + cos(pi p)).
    got = [lr_multiplier(s, warmup_steps=2, total_steps=6, schedule="cosine") for s in range(8)]
    half_sqrt2 = 0.5 + math.sqrt(2) / 4  # cos(pi/4) = sqrt(2)/2
    expected = [0.5, 1.0, 1.0, half_sqrt2, 0.5, 1 - half_sqrt2, 0.0, 0.0]
    assert got == pytest.approx(expected, abs=1e-12)


def test_bad_schedule_name():
    with pytest.raises(ValueError, match="constant, cosine"):
        lr_multiplier(0, warmup_steps=0, total_steps=1, schedule="linear")
    with pytest.raises(ValueError, match="lr_schedule"):
        OptimArgs(lr=1.0, lr_schedule="linear")


def test_lr_schedule_state():
    s = LRSchedule(base_lr=2.0, warmup_steps=2, total_steps=4, schedule="constant")
    assert s.lr() == 1.0
    s.step += 1
    t = LRSchedule(base_lr=2.0, warmup_steps=2, total_steps=4, schedule="constant")
    t.load_state_dict(s.state_dict())
    assert t.lr() == 2.0


def _params_with_grads(grads):
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    return params


def test_clip_grads_caps_the_norm():
    # Norm sqrt(3^2 + 4^2 + 0^2) = 5 -> clipped to 1: every entry scaled by 1 / (5 + 1e-6).
    params = _params_with_grads([torch.tensor([3.0, 0.0]), torch.tensor([[4.0]])])
    norm = clip_grads(params, max_norm=1.0)
    assert norm == 5.0
    after = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in params]))
    assert after <= 1.0 and after == pytest.approx(1.0, abs=1e-6)
    assert params[0].grad[0] == pytest.approx(3.0 / 5.0, abs=1e-6)
    # Under the cap: untouched.
    params = _params_with_grads([torch.tensor([0.3, 0.4])])
    assert clip_grads(params, max_norm=1.0) == pytest.approx(0.5)
    assert torch.equal(params[0].grad, torch.tensor([0.3, 0.4]))


def test_guarded_step_refuses_non_finite_gradients():
    layer = torch.nn.Linear(2, 1)
    opt = make_adamw(layer.parameters(), OptimArgs(lr=0.1))
    params = list(layer.parameters())
    layer(torch.ones(1, 2)).sum().backward()
    guarded_step(opt, params, 1.0, "warm")  # creates the Adam state
    before = [p.detach().clone() for p in params]
    state_before = {k: v.clone() for k, v in opt.state[params[0]].items()}
    (layer(torch.ones(1, 2)) * float("nan")).sum().backward()
    with pytest.raises(NonFiniteError, match="actor update 3, mini-batch 1: gradient norm is nan"):
        guarded_step(opt, params, 1.0, "actor update 3, mini-batch 1")
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert all(torch.equal(opt.state[params[0]][k], v) for k, v in state_before.items())
    assert all(p.grad is None for p in params)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_a_step_in_chunks_gives_the_bits_of_a_whole_step(device):
    """Three steps (state made by the first) with weight decay, chunks that do not divide the
    parameter: parameter, moments and step count equal one whole step's bit for bit, keep
    torch's AdamW's state keys and dtypes, and stay within float32 rounding of torch's
    AdamW (the same algorithm, its fused operations rounded once each here)."""
    g = torch.Generator().manual_seed(0)
    start = (torch.randn(10_007, generator=g) * 10.0 ** torch.randint(-6, 3, (10_007,), generator=g)).to(device)
    grads = [(torch.randn(10_007, generator=g) * 10.0 ** torch.randint(-8, 2, (10_007,), generator=g)).to(device)
             for _ in range(3)]
    args = OptimArgs(lr=3e-4, weight_decay=0.1)
    whole, chunked, ref = (torch.nn.Parameter(start.clone()) for _ in range(3))
    opt_whole, opt_chunked = make_adamw([whole], args), make_adamw([chunked], args)
    opt_ref = torch.optim.AdamW([ref], lr=args.lr, betas=args.betas, weight_decay=args.weight_decay, foreach=False)
    for step, grad in enumerate(grads):
        opt_ref.param_groups[0]["lr"] = args.lr * (step + 1)
        set_lr(opt_whole, args.lr * (step + 1))
        set_lr(opt_chunked, args.lr * (step + 1))
        whole.grad, chunked.grad, ref.grad = grad.clone(), grad.clone(), grad.clone()
        step_in_chunks(opt_whole, whole)
        step_in_chunks(opt_chunked, chunked, chunk=1000)
        opt_ref.step()
        assert torch.equal(whole, chunked)
        a, b, r = opt_whole.state[whole], opt_chunked.state[chunked], opt_ref.state[ref]
        assert set(a) == set(b) == set(r) and torch.equal(a["step"], b["step"]) and a["step"].dtype == r["step"].dtype
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
        torch.testing.assert_close(whole.detach(), ref.detach(), rtol=1e-6, atol=1e-9)
    assert not torch.equal(whole, start)


def test_the_scalars_are_correctly_rounded():
    """exact_power and exact_cos against 100-digit decimal arithmetic: the C library's pow
    and cos are not correctly rounded everywhere (glibc 2.36: 0.999 ** 2904, cos at the
    warm start's step 263 of 1500), and may differ between machines."""
    from decimal import Decimal, localcontext

    with localcontext() as ctx:
        ctx.prec = 100
        for base in (0.9, 0.95, 0.98, 0.99, 0.999, 0.9999):
            for n in (1, 2, 13, 263, 2904, 100_000):
                assert exact_power(base, n) == float(Decimal(base) ** n), (base, n)
        pi = Decimal("3.14159265358979323846264338327950288419716939937510582097494459230781640628620899863")
        for step in range(0, 1501, 7):
            x = math.pi * step / 1500
            want = 1 + sum((-1) ** k * Decimal(x) ** (2 * k) / math.factorial(2 * k) for k in range(1, 60))
            assert exact_cos(x) == float(want), step
        assert exact_cos(0.0) == 1.0 and float(pi) == math.pi
    with pytest.raises(ValueError, match="exact_cos"):
        exact_cos(5.0)


def test_a_step_takes_the_exact_scalars():
    """At step 2904 (0.999 ** 2904 is where glibc's pow is not correctly rounded), the step
    takes exact_power's bias corrections and math.sqrt's root: its parameter and moments are
    `adamw_step_`'s with those scalars, and with glibc's pow they would differ."""
    from reprorl.kernels.optim_math import AdamWScalars, adamw_step_

    g = torch.Generator().manual_seed(4)
    param = torch.nn.Parameter(torch.randn(5000, generator=g))
    opt = make_adamw([param], OptimArgs(lr=1e-3, weight_decay=0.1))
    param.grad = torch.randn(5000, generator=g)
    state = opt.state[param]
    state["step"] = torch.tensor(2903.0)
    state["exp_avg"], state["exp_avg_sq"] = torch.randn(5000, generator=g) * 1e-3, torch.rand(5000, generator=g) * 1e-6
    p, m, v, grad = param.detach().clone(), state["exp_avg"].clone(), state["exp_avg_sq"].clone(), param.grad
    step_in_chunks(opt, param, chunk=999)
    scalars = AdamWScalars.of(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, grad_scale=1.0,
                              bias1=1 - exact_power(0.9, 2904), bias2=math.sqrt(1 - exact_power(0.999, 2904)))
    adamw_step_(p, grad, m, v, scalars)
    assert torch.equal(param.detach(), p) and torch.equal(state["exp_avg_sq"], v) and state["step"].item() == 2904.0
