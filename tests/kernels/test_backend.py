"""Every kernel backend has the methods of `Kernels` (reprorl/kernels/backend.py), with its
parameter names: the model code calls any of them through that one protocol."""

import inspect

import pytest

from reprorl.kernels import CpuInvariantKernels, ReferenceKernels, TorchKernels
from reprorl.kernels.backend import Kernels

METHODS = [name for name, value in vars(Kernels).items() if isinstance(value, (staticmethod, classmethod))]


def backends():
    found = [TorchKernels, CpuInvariantKernels, ReferenceKernels]
    try:
        from reprorl.kernels.gpu import FastCudaKernels, TritonKernels
    except ImportError:  # no triton on this machine
        return found
    return found + [FastCudaKernels, TritonKernels]


@pytest.mark.parametrize("backend", backends(), ids=lambda b: b.__name__)
def test_a_backend_satisfies_the_protocol(backend):
    assert isinstance(backend, Kernels)  # every member present (the class itself is the backend)
    assert isinstance(backend.name, str) and isinstance(backend.batch_invariant, bool)
    for name in METHODS:
        want = list(inspect.signature(getattr(Kernels, name)).parameters)
        params = inspect.signature(getattr(backend, name)).parameters
        if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params.values()):
            continue  # a wrapper that forwards its arguments (e.g. to a CUDA-graph-safe launcher)
        assert list(params) == want, (backend.__name__, name)
    assert len(METHODS) == 11  # linear, rms_norm, swiglu, geglu, softmax, log_softmax, entropy, token_log_probs,
    # apply_rotary, batched_attention, padded_attention
