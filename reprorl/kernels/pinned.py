"""The pinned deterministic math: exp, softmax, log-softmax, sqrt, sin, cos and pow with the
same bits on any x86-64 CPU once a process is pinned, and a sum whose bits do not follow the
thread count.

For the code outside the kernels that runs on the host (the sampler's probabilities, the
losses of a CPU run, the warm start's loss, the RoPE tables of every device, AdamW's
denominator). `reprorl.determinism.pin_cpu_kernels` calls `pin` under full determinism;
from then on each `pinned_*` function takes `cpu_math`'s portable arithmetic on a CPU
tensor (torch's CPU sqrt is MKL's, not IEEE's, on these machines); on another device, or
in a process never pinned, it is torch's own.
"""

from __future__ import annotations

import torch
from torch import Tensor

from reprorl.kernels.build import extension
from reprorl.kernels.cpu_math import exp, log_softmax, softmax

_pinned = False


def pin() -> None:
    """Make the `pinned_*` functions take the portable arithmetic on CPU tensors."""
    global _pinned
    _pinned = True


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
        return extension().sqrt(x)
    return torch.sqrt(x)


def pinned_sincos(x: Tensor) -> tuple[Tensor, Tensor]:
    """(sin x, cos x) of a float32 tensor: cpu_math's on the CPU of a pinned process
    (accurate for |x| < 1.6e6), torch's otherwise."""
    if _portable_here(x) and x.dtype == torch.float32:
        return tuple(extension().sincos(x))
    return x.sin(), x.cos()


def pinned_pow(base: float, exponents: Tensor) -> Tensor:
    """base ** exponents (base > 0, float32 exponents): cpu_math's on the CPU of a pinned
    process, torch's otherwise."""
    if _portable_here(exponents) and exponents.dtype == torch.float32 and base > 0:
        return extension().pow(float(base), exponents)
    return base ** exponents
