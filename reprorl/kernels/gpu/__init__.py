"""Batch-invariant kernels on CUDA GPUs, written in Triton: one op a module.

| op | module |
|---|---|
| linear (matmul + bias) | `matmul` |
| RMSNorm | `rms_norm` |
| softmax, log-softmax, entropy | `softmax` |
| log-probs of given tokens (fused: LM head's logits in, one float a token out) | `log_probs` |
| SiLU-and-mul, rotary | `elementwise` |
| causal GQA attention (optionally in a sliding window) | `attention` |

`FastCudaKernels` is the plain (not batch-invariant) backend on CUDA: stock torch's
cuBLAS linears, SDPA attention and softmaxes, with these Triton kernels for RMSNorm,
rotary, SiLU-and-mul, the entropy and the tokens' log-probs, where stock torch launches a
chain of small element-wise kernels (on the H200: 0.1-0.2x stock's time for RMSNorm,
0.1-0.8x for rotary, 0.4-0.6x for SiLU-and-mul; bench/kernels.py).

Forward passes are these kernels. RMSNorm, SiLU-and-mul, rotary, log-softmax and the
tokens' log-probs have backward kernels here too (one launch each, no atomics), and
attention has two (its `attention` module); the linear's backward is stock torch's
matmuls (deterministic, see `reprorl.kernels.autograd`). Under `TRITON_INTERPRET=1` the
same kernels run on CPU tensors (slowly), which is how CI checks their arithmetic without
a GPU.
"""

from __future__ import annotations

from torch import Tensor

from reprorl.kernels.autograd import linear_with_matmul_backward, with_backward, with_torch_backward
from reprorl.kernels.gpu import attention as tl_attention
from reprorl.kernels.gpu import elementwise as tl_elementwise
from reprorl.kernels.gpu import log_probs as tl_log_probs
from reprorl.kernels.gpu import matmul as tl_matmul
from reprorl.kernels.gpu import rms_norm as tl_rms_norm
from reprorl.kernels.gpu import softmax as tl_softmax
from reprorl.kernels.shared import Padding, padded_as_sequences
from reprorl.kernels.torch_ops import TorchKernels


class TritonKernels:
    """Batch-invariant kernels on CUDA (see `reprorl.kernels` for the interface)."""

    name = "triton"
    batch_invariant = True
    row_buckets = tl_matmul.ROW_BUCKETS  # the start-up check puts a row past each

    linear = staticmethod(linear_with_matmul_backward(tl_matmul.matmul))
    rms_norm = staticmethod(with_backward(tl_rms_norm.rms_norm, tl_rms_norm.rms_norm_backward))
    swiglu = staticmethod(with_backward(tl_elementwise.swiglu, tl_elementwise.swiglu_backward))
    geglu = staticmethod(with_backward(tl_elementwise.geglu, tl_elementwise.geglu_backward))
    apply_rotary = staticmethod(with_backward(tl_elementwise.apply_rotary, tl_elementwise.apply_rotary_backward))
    softmax = staticmethod(with_torch_backward(tl_softmax.softmax, TorchKernels.softmax))
    entropy = staticmethod(with_torch_backward(tl_softmax.entropy, TorchKernels.entropy))
    token_log_probs = staticmethod(tl_log_probs.token_log_probs)
    log_softmax = staticmethod(with_backward(tl_softmax.log_softmax, tl_softmax.log_softmax_backward,
                                             saves_output=True))
    batched_attention = staticmethod(tl_attention.batched_attention)  # its own backward kernels

    @classmethod
    def padded_attention(cls, q, k, v, padding: Padding | Tensor | None, window: int = 0):
        return padded_as_sequences(cls.batched_attention, q, k, v, padding, window)


class FastCudaKernels(TorchKernels):
    """Plain mode on CUDA (module doc): no promise about batching, as `TorchKernels`."""

    name = "torch+triton"
    batch_invariant = False

    rms_norm = staticmethod(TritonKernels.rms_norm)
    swiglu = staticmethod(TritonKernels.swiglu)
    geglu = staticmethod(TritonKernels.geglu)
    apply_rotary = staticmethod(TritonKernels.apply_rotary)
    entropy = staticmethod(TritonKernels.entropy)
    token_log_probs = staticmethod(TritonKernels.token_log_probs)


from reprorl.kernels.gpu.sampling import row_cumsum  # noqa: E402  (the engine's GPU sampler)
