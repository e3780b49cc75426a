"""Kernels: every op of a model's forward pass (and its backward), one backend a module.

| backend | module | promise |
|---|---|---|
| `TorchKernels` | `torch_ops` | stock torch; none about batching |
| `FastCudaKernels` | `gpu` | plain mode on CUDA: stock torch with Triton's element-wise ops; none |
| `CpuInvariantKernels` | `cpu` | batch-invariant on any CPU (fixed-shape single-threaded tiles) |
| `TritonKernels` | `gpu` | batch-invariant on CUDA GPUs (Triton kernels, tiles fixed by N and K) |
| `ReferenceKernels` | `reference` | float64, for tests |

Beside them: `build` builds the CPU extension from `csrc/` on first use; `cpu_math` is the
portable exp, log and softmax the CPU backend is made of; `pinned` is that math for the code
outside the kernels (algos, the sampler, the optimizer, RoPE), taken once a process is
pinned; `check` is the start-up check that an invariant backend keeps its promise here.

Batch-invariant means: each output row depends only on that row's inputs, not on how many
rows are in the call, where the row sits, what the other rows hold, or the thread count.
Attention reduces over keys in one fixed block order, so a token's output is the same bits
in a decode step, in any prefill chunk and in the trainer's padded batch (docs/design.md,
contract point 2). Gradients are deterministic, not batch-invariant.

Every backend has the same methods (`backend.Kernels`, the protocol the model code is typed
with, its parameter always named `kernels`): `linear(x, weight, bias)`, `rms_norm(x, weight, eps)`,
`swiglu(gate, up)`, `geglu(gate, up)` (tanh-approximated GELU), `softmax(x)`, `log_softmax(x)`, `entropy(log_probs)` (of each row's
distribution, from a log_softmax's output), `token_log_probs(logits, tokens, temperature,
with_entropy)` (the log-softmax of logits / T at the tokens, and the entropy: what the
trainer's log-probs are), `apply_rotary(x, cos, sin_rot)`,
`batched_attention(q [B, Hq, Tq, D], k, v [B, Hkv, Tk, D], q_start [B], window=0)` (causal,
GQA; a query at position p sees keys 0..p; keys past it must only be finite) and
`padded_attention(q, k, v [B, T, H, D], padding, window=0)` (a `shared.Padding`, made once a
forward from the attention mask [B, T], or the mask itself); and `name` and
`batch_invariant`.

`window`, a Python int: 0 is full causal attention; W > 0 is transformers' sliding window,
a query at position p sees the W keys p-W+1..p (itself included), and in a padded batch
positions count each row's real tokens (position_ids = cumsum(mask) - 1). Keys outside the
window get probability exactly 0, so the promise holds in a window too: the invariant
backends walk the same fixed key blocks, skipping only blocks that no query of a tile sees,
which is provably the same bits (cpu_attention.cpp, gpu/attention.py). Anything but an
int >= 0 is a ValueError naming `window`. A model holds the backend it runs with (`CausalLM.kernels`); the
engine, the trainer's workers and the reward model choose it once with `select_kernels`.
"""

from __future__ import annotations

import torch

from reprorl.kernels.backend import Kernels
from reprorl.kernels.check import BatchInvarianceError, verify_batch_invariance
from reprorl.kernels.cpu import CpuInvariantKernels
from reprorl.kernels.reference import ReferenceKernels
from reprorl.kernels.shared import KEY_BLOCK, apply_rotary, rope_tables
from reprorl.kernels.torch_ops import TorchKernels

__all__ = [
    "KEY_BLOCK", "BatchInvarianceError", "CpuInvariantKernels", "Kernels", "ReferenceKernels", "TorchKernels",
    "apply_rotary", "rope_tables", "select_kernels", "verify_batch_invariance",
]


def select_kernels(device: torch.device | str, batch_invariant: bool):
    """The backend for a model on `device`: the fastest without `batch_invariant` (stock
    torch, on CUDA with the Triton element-wise ops), else the CPU tiles or (CUDA) the
    Triton kernels. Other devices have no invariant backend."""
    device = torch.device(device)
    if not batch_invariant:
        if device.type == "cuda":
            from reprorl.kernels.gpu import FastCudaKernels

            return FastCudaKernels
        return TorchKernels
    if device.type == "cpu":
        return CpuInvariantKernels
    if device.type == "cuda":
        from reprorl.kernels.gpu import TritonKernels  # triton is imported only where it runs

        return TritonKernels
    raise NotImplementedError(f"no batch-invariant kernels for device {device}; expected cpu or cuda")
