"""exp, log, pow, sin, cos, sqrt, softmax, log-softmax and entropy on the CPU with the same
bits on any x86-64 CPU: torch's are not (its exp, log, tanh and sqrt, from MKL's vector math
or the C library, differ between an AMD EPYC and an Intel Xeon with the same torch build;
glibc also takes other code on a CPU without FMA).

The arithmetic is `cpu_math.h`'s (plain IEEE operations; row sums in a fixed order), built
into the CPU kernels' extension. Two ways in:
- `exp`, `softmax`, `log_softmax`, `entropy`, `swiglu`, `geglu`: always these, with their gradients
  (the CPU batch-invariant kernels are made of them);
- `pinned_exp`, `pinned_softmax`, `pinned_log_softmax`, `pinned_sincos`, `pinned_pow`,
  `pinned_sqrt` (torch's CPU sqrt is MKL's, not IEEE's, on these machines):
  these on a CPU tensor once `reprorl.determinism.pin_cpu_kernels` has pinned the
  process's CPU math (full determinism), torch's otherwise: for the code outside the
  kernels that runs on the host (the sampler's probabilities, the losses of a CPU run,
  the warm start's loss, the RoPE tables of every device, AdamW's denominator).
"""

from __future__ import annotations

import torch
from torch import Tensor

from reprorl.kernels.autograd import with_backward

_pinned = False


def pin() -> None:
    """Make the `pinned_*` functions take the portable arithmetic on CPU tensors."""
    global _pinned
    _pinned = True


def _ext():
    from reprorl.kernels.cpu import extension

    return extension()


def _as_float(x: Tensor) -> Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _exp_kernel(x: Tensor) -> Tensor:
    return _ext().exp(_as_float(x)).to(x.dtype)


def _exp_backward(grad: Tensor, out: Tensor, x: Tensor) -> Tensor:
    return grad * out


exp = with_backward(_exp_kernel, _exp_backward, saves_output=True)
"""e^x entry by entry (float32 rounded once from double, float64; other dtypes through float32)."""


def log(x: Tensor) -> Tensor:
    """log x entry by entry, in float32 (no gradient: the callers take none)."""
    return _ext().log(x.float())


def row_sums(x: Tensor) -> Tensor:
    """The sums over the last dimension, in a fixed order: [..., n] -> [...]."""
    return _ext().row_sums(_as_float(x))


def _softmax_backward(grad: Tensor, y: Tensor, x: Tensor) -> Tensor:
    return y * (grad - row_sums(grad * y).unsqueeze(-1))


softmax = with_backward(lambda x: _ext().softmax(_as_float(x)), _softmax_backward, saves_output=True)
"""Softmax over the last dimension, float32 (float64 kept)."""


def _log_softmax_backward(grad: Tensor, y: Tensor, x: Tensor) -> Tensor:
    return grad - _ext().exp(y) * row_sums(grad).unsqueeze(-1)


log_softmax = with_backward(lambda x: _ext().log_softmax(x.float()), _log_softmax_backward, saves_output=True)
"""Log-softmax over the last dimension in float32: (x - max) - log(sum e^(x - max))."""


def _entropy_kernel(log_probs: Tensor) -> Tensor:
    y = log_probs.float()
    return -row_sums(_ext().exp(y) * y)


def _entropy_backward(grad: Tensor, log_probs: Tensor) -> Tensor:
    y = log_probs.float()
    return -(_ext().exp(y) * (y + 1.0)) * grad.unsqueeze(-1)


entropy = with_backward(_entropy_kernel, _entropy_backward)
"""Each row's entropy from its log-probs: -sum(e^y * y) over the last dimension, float32."""


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up = gate / (1 + e^-gate) * up, SiLU in float32 rounded to gate's dtype."""
    g = gate.float()
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return (g / (1.0 + exp(-g))).to(gate.dtype) * up
    # The same ops in place in one temporary: without grad, fresh [rows, I] tensors cost
    # more than the arithmetic.
    e = _ext().exp(torch.neg(g)).add_(1.0)
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
    e = _ext().exp(torch.neg(z)).add_(1.0)
    return torch.div(g, e, out=e).to(gate.dtype).mul_(up)


def _portable_here(x: Tensor) -> bool:
    return _pinned and x.device.type == "cpu"


TORCH_SERIAL_SUM = 32768
"""The most elements torch sums on one thread (its grain size): a longer CPU sum to one
value is split over the threads, each part summed on its own, so its bits follow the
thread count."""


def thread_free_sum(x: Tensor) -> Tensor:
    """`x.sum()` whose bits do not follow the CPU thread count, with its gradient.

    torch's own where one thread does it (any GPU tensor, and up to `TORCH_SERIAL_SUM`
    elements on the CPU: their bits stay as they were); a longer CPU tensor is summed in
    rows of `TORCH_SERIAL_SUM` (torch splits a reduction to several values over its
    outputs, so each row is summed whole on one thread), then the rows' sums the same way.
    The last row is padded with zeros."""
    if x.device.type != "cpu" or x.numel() <= TORCH_SERIAL_SUM:
        return x.sum()
    flat = x.reshape(-1)
    rows = torch.nn.functional.pad(flat, (0, -flat.numel() % TORCH_SERIAL_SUM))
    return thread_free_sum(rows.view(-1, TORCH_SERIAL_SUM).sum(dim=-1))


def pinned_exp(x: Tensor) -> Tensor:
    """`exp` on a CPU tensor of a pinned process, torch.exp otherwise."""
    return exp(x) if _portable_here(x) else torch.exp(x)


def pinned_softmax(x: Tensor) -> Tensor:
    """`softmax` on a CPU tensor of a pinned process, torch.softmax otherwise (over the last dim)."""
    return softmax(x) if _portable_here(x) else torch.softmax(x, dim=-1)


def pinned_log_softmax(x: Tensor) -> Tensor:
    """`log_softmax` (float32) on a CPU tensor of a pinned process, torch's otherwise (over
    the last dim); float64 stays torch's, in float64 (no portable float64 log here)."""
    if _portable_here(x) and x.dtype != torch.float64:
        return log_softmax(x)
    return torch.log_softmax(x, dim=-1)


def pinned_sqrt(x: Tensor) -> Tensor:
    """The IEEE square root of a float32 tensor on the CPU of a pinned process (torch's CPU
    sqrt is MKL's vector math there, whose bits differ between an AMD and an Intel CPU),
    torch.sqrt otherwise. No gradient."""
    if _portable_here(x) and x.dtype == torch.float32:
        return _ext().sqrt(x)
    return torch.sqrt(x)


def pinned_sincos(x: Tensor) -> tuple[Tensor, Tensor]:
    """(sin x, cos x) of a float32 tensor: cpu_math's on the CPU of a pinned process
    (accurate for |x| < 1.6e6), torch's otherwise."""
    if _portable_here(x) and x.dtype == torch.float32:
        return tuple(_ext().sincos(x))
    return x.sin(), x.cos()


def pinned_pow(base: float, exponents: Tensor) -> Tensor:
    """base ** exponents (base > 0, float32 exponents): cpu_math's on the CPU of a pinned
    process, torch's otherwise."""
    if _portable_here(exponents) and exponents.dtype == torch.float32 and base > 0:
        return _ext().pow(float(base), exponents)
    return base ** exponents
