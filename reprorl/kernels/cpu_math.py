"""exp, log, softmax, log-softmax, entropy, SwiGLU and GeGLU on the CPU with the same bits on
any x86-64 CPU: torch's are not (its exp, log, tanh and sqrt, from MKL's vector math or the C
library, differ between an AMD EPYC and an Intel Xeon with the same torch build; glibc also
takes other code on a CPU without FMA).

The arithmetic is `csrc/cpu_math.h`'s (plain IEEE operations; row sums in a fixed order),
built into the CPU kernels' extension (`build.py`). These functions always take it, with
their gradients: the CPU batch-invariant kernels (`cpu.py`) are made of them. Code outside
the kernels takes them through `pinned.py` (theirs once a process is pinned, torch's
otherwise).
"""

from __future__ import annotations

import torch
from torch import Tensor

from reprorl.kernels.autograd import with_backward
from reprorl.kernels.build import extension

def _as_float(x: Tensor) -> Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _exp_kernel(x: Tensor) -> Tensor:
    return extension().exp(_as_float(x)).to(x.dtype)


def _exp_backward(grad: Tensor, out: Tensor, x: Tensor) -> Tensor:
    return grad * out


exp = with_backward(_exp_kernel, _exp_backward, saves_output=True)
"""e^x entry by entry (float32 rounded once from double, float64; other dtypes through float32)."""


def log(x: Tensor) -> Tensor:
    """log x entry by entry, in float32 (no gradient: the callers take none)."""
    return extension().log(x.float())


def row_sums(x: Tensor) -> Tensor:
    """The sums over the last dimension, in a fixed order: [..., n] -> [...]."""
    return extension().row_sums(_as_float(x))


def _softmax_backward(grad: Tensor, y: Tensor, x: Tensor) -> Tensor:
    return y * (grad - row_sums(grad * y).unsqueeze(-1))


softmax = with_backward(lambda x: extension().softmax(_as_float(x)), _softmax_backward, saves_output=True)
"""Softmax over the last dimension, float32 (float64 kept)."""


def _log_softmax_backward(grad: Tensor, y: Tensor, x: Tensor) -> Tensor:
    return grad - extension().exp(y) * row_sums(grad).unsqueeze(-1)


log_softmax = with_backward(lambda x: extension().log_softmax(x.float()), _log_softmax_backward, saves_output=True)
"""Log-softmax over the last dimension in float32: (x - max) - log(sum e^(x - max))."""


def _entropy_kernel(log_probs: Tensor) -> Tensor:
    y = log_probs.float()
    return -row_sums(extension().exp(y) * y)


def _entropy_backward(grad: Tensor, log_probs: Tensor) -> Tensor:
    y = log_probs.float()
    return -(extension().exp(y) * (y + 1.0)) * grad.unsqueeze(-1)


entropy = with_backward(_entropy_kernel, _entropy_backward)
"""Each row's entropy from its log-probs: -sum(e^y * y) over the last dimension, float32."""


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up = gate / (1 + e^-gate) * up, SiLU in float32 rounded to gate's dtype."""
    g = gate.float()
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return (g / (1.0 + exp(-g))).to(gate.dtype) * up
    # The same ops in place in one temporary: without grad, fresh [rows, I] tensors cost
    # more than the arithmetic.
    e = extension().exp(torch.neg(g)).add_(1.0)
    return torch.div(g, e, out=e).to(gate.dtype).mul_(up)


# gelu_tanh(g) = g/2 (1 + tanh(u)), u = sqrt(2/pi) (g + 0.044715 g^3), is g sigmoid(2u) exactly
# (1 + tanh(u) = 2 / (1 + e^-2u)): SiLU's form with z = 2u = g (GELU_C1 + GELU_C3 g^2), so it
# needs only the portable exp, and no 1 + tanh near -1 loses its digits.
GELU_C1 = 2 * (2 / 3.141592653589793) ** 0.5
GELU_C3 = GELU_C1 * 0.044715


def gelu_tanh_argument(g: Tensor) -> Tensor:
    """z of gelu_tanh(g) = g / (1 + e^-z), in g's (float) dtype: g (C1 + C3 g^2)."""
    return g * (g * g * GELU_C3 + GELU_C1)


def geglu(gate: Tensor, up: Tensor) -> Tensor:
    """gelu_tanh(gate) * up = gate / (1 + e^-z) * up (z: `gelu_tanh_argument`), GELU in
    float32 rounded to gate's dtype, as `swiglu`."""
    g = gate.float()
    z = gelu_tanh_argument(g)
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return (g / (1.0 + exp(-z))).to(gate.dtype) * up
    e = extension().exp(torch.neg(z)).add_(1.0)
    return torch.div(g, e, out=e).to(gate.dtype).mul_(up)
