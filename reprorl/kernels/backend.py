"""`Kernels`: the methods every kernel backend has (the package doc says what each promises).

A backend is a class of static methods (`TorchKernels`, `CpuInvariantKernels`,
`TritonKernels`, `FastCudaKernels`, `ReferenceKernels`), used as the class itself: a model
holds the one it runs with (`CausalLM.kernels`) and passes it down its layers as
`kernels`, the one name it has in the model code.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import Tensor

from reprorl.kernels.shared import Padding


@runtime_checkable
class Kernels(Protocol):
    name: str
    batch_invariant: bool

    @staticmethod
    def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor: ...

    @staticmethod
    def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor: ...

    @staticmethod
    def swiglu(gate: Tensor, up: Tensor) -> Tensor: ...

    @staticmethod
    def geglu(gate: Tensor, up: Tensor) -> Tensor: ...

    @staticmethod
    def softmax(x: Tensor) -> Tensor: ...

    @staticmethod
    def log_softmax(x: Tensor) -> Tensor: ...

    @staticmethod
    def entropy(log_probs: Tensor) -> Tensor: ...

    @classmethod
    def token_log_probs(cls, logits: Tensor, tokens: Tensor, temperature: float,
                        with_entropy: bool = False) -> tuple[Tensor, Tensor | None]: ...

    @staticmethod
    def apply_rotary(x: Tensor, cos: Tensor, sin_rot: Tensor) -> Tensor: ...

    @staticmethod
    def batched_attention(q: Tensor, k: Tensor, v: Tensor, q_start: Tensor, window: int = 0) -> Tensor: ...

    @classmethod
    def padded_attention(cls, q: Tensor, k: Tensor, v: Tensor, padding: Padding | Tensor | None,
                         window: int = 0) -> Tensor: ...
