"""Gradients of the kernels: their own backward kernels, or the backward of the plain
torch version.

A kernel with a backward kernel of its own (the Triton RMSNorm, SiLU-and-mul, rotary and
log-softmax) takes it through `with_backward`: one launch a backward, no recompute.

Otherwise, a batch-invariant kernel (a Triton kernel, the CPU tile runner) computes the same function
as a few stock torch ops, with a different reduction order. Training needs its gradient,
deterministic (the same bits every run) but not batch-invariant (the kernels issue). So
the backward recomputes the op with stock torch ops and differentiates that: the gradient
of the same function, through torch's deterministic backward kernels (no atomics with
`torch.use_deterministic_algorithms`). The linear layer, where recomputing would cost a
third more matmuls, has its own backward (`linear_with_matmul_backward`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor


def _needs_grad(tensors: tuple[Any, ...]) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in tensors)


class _RecomputeBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kernel: Callable, torch_fn: Callable, static: dict, *args: Any) -> Tensor:
        ctx.torch_fn, ctx.static = torch_fn, static
        ctx.args = [None if isinstance(a, Tensor) else a for a in args]  # constants kept as they are
        ctx.save_for_backward(*[a for a in args if isinstance(a, Tensor)])
        return kernel(*args, **static)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        saved = iter(ctx.saved_tensors)
        needs = ctx.needs_input_grad[3:]
        args = [next(saved).detach().requires_grad_(need) if a is None else a for a, need in zip(ctx.args, needs)]
        wrt = [a for a, need in zip(args, needs) if need]
        with torch.enable_grad():
            grads = iter(torch.autograd.grad(ctx.torch_fn(*args, **ctx.static), wrt, grad))
        return (None, None, None, *[next(grads) if need else None for need in needs])


class _KernelBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kernel: Callable, backward: Callable, saves_output: bool, static: dict, *args: Any) -> Tensor:
        ctx.backward_fn, ctx.static, ctx.saves_output = backward, static, saves_output
        ctx.args = [None if isinstance(a, Tensor) else a for a in args]
        out = kernel(*args, **static)
        ctx.save_for_backward(*([out] if saves_output else []), *[a for a in args if isinstance(a, Tensor)])
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        saved = iter(ctx.saved_tensors)
        out = (next(saved),) if ctx.saves_output else ()
        args = [next(saved) if a is None else a for a in ctx.args]
        grads = ctx.backward_fn(grad, *out, *args, **ctx.static)
        grads = grads if isinstance(grads, tuple) else (grads,)
        needs = ctx.needs_input_grad[4:]
        if any(needs[len(grads):]):
            raise RuntimeError(f"{ctx.backward_fn.__name__} gives the gradients of the first {len(grads)} "
                               "argument(s) only; a later one needs a gradient here")
        grads = [g if need else None for g, need in zip(grads, needs)] + [None] * (len(needs) - len(grads))
        return (None, None, None, None, *grads)


def with_backward(kernel: Callable[..., Tensor], backward: Callable[..., Any], saves_output: bool = False
                  ) -> Callable[..., Tensor]:
    """`kernel(*args, **static)` whose gradient is `backward(grad, [out,] *args, **static)`:
    the gradients of the leading positional tensors (one, or a tuple; later arguments,
    such as rotary tables or an eps, take none). With `saves_output` the backward gets the
    forward's output after the gradient (what the log-softmax's needs) and the inputs are
    kept as well."""
    def run(*args: Any, **static: Any) -> Tensor:
        if _needs_grad(args):
            return _KernelBackward.apply(kernel, backward, saves_output, static, *args)
        return kernel(*args, **static)

    run.__name__ = getattr(kernel, "__name__", "kernel")
    return run


def with_torch_backward(kernel: Callable[..., Tensor], torch_fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """`kernel(*args, **static)` whose gradient is that of `torch_fn(*args, **static)`.

    Without grad (inference, the engine) the kernel runs bare. Positional tensors may need
    grad; other positional values (None for no bias, an eps) and `static` keyword
    arguments are constants of the op.
    """
    def run(*args: Any, **static: Any) -> Tensor:
        if _needs_grad(args):
            return _RecomputeBackward.apply(kernel, torch_fn, static, *args)
        return kernel(*args, **static)

    run.__name__ = getattr(kernel, "__name__", "kernel")
    return run


GradMatmul = Callable[[Tensor, Tensor], Tensor]
"""`a [M, J] @ b [N, J]^T -> float32 [M, N]`: the products of a linear layer's backward."""


class _LinearBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, matmul: Callable, grad_matmul: GradMatmul | None, x: Tensor, weight: Tensor,
                bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.grad_matmul = bias is not None, grad_matmul
        return matmul(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])  # [M, N]
        x2 = x.reshape(-1, x.shape[-1])  # [M, K]
        needs_x, needs_w, needs_b = ctx.needs_input_grad[2:5]
        mm = ctx.grad_matmul
        if mm is None:  # stock torch matmuls
            gx = (g @ weight).reshape(x.shape) if needs_x else None
            gw = g.t() @ x2 if needs_w else None
            gb = g.sum(0) if ctx.has_bias and needs_b else None
        else:  # each entry one sum in a fixed order, as the forward's
            gx = mm(g, weight.t().contiguous()).to(x.dtype).reshape(x.shape) if needs_x else None
            gw = mm(g.t().contiguous(), x2.t().contiguous()).to(weight.dtype) if needs_w else None
            gb = (mm(g.new_ones(1, g.shape[0]), g.t().contiguous())[0].to(g.dtype)
                  if ctx.has_bias and needs_b else None)
        return None, None, gx, gw, gb


def linear_with_matmul_backward(matmul: Callable[[Tensor, Tensor, Tensor | None], Tensor],
                                grad_matmul: GradMatmul | None = None) -> Callable[..., Tensor]:
    """`matmul(x [..., K], weight [N, K], bias [N] | None) -> [..., N]` with the linear layer's
    analytic backward (grad_x = g W, grad_W = g^T x, grad_b = sum g): its products by
    `grad_matmul` (bias: ones @ g), or by stock torch matmuls when None."""
    def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        if _needs_grad((x, weight, bias)):
            return _LinearBackward.apply(matmul, grad_matmul, x, weight, bias)
        return matmul(x, weight, bias)

    return linear
