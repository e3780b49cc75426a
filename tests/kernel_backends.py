"""The kernel backends a test can run here, and where their tensors live.

- `cpu-invariant` always (CPU tensors);
- `triton` on CUDA when there is a GPU, else under TRITON_INTERPRET=1 on CPU tensors
  (tests/conftest.py sets it), when triton is installed.
"""

import importlib.util
import os

import pytest
import torch

from reprorl.kernels import CpuInvariantKernels

HAVE_TRITON = importlib.util.find_spec("triton") is not None
ON_GPU = torch.cuda.is_available()
INTERPRETED = not ON_GPU and os.environ.get("TRITON_INTERPRET") == "1"


def triton_kernels():
    from reprorl.kernels.gpu import TritonKernels

    return TritonKernels


BACKENDS = ["cpu-invariant"] + (["triton"] if HAVE_TRITON and (ON_GPU or INTERPRETED) else [])


def backend_and_device(name):
    if name == "cpu-invariant":
        return CpuInvariantKernels, "cpu"
    return triton_kernels(), "cuda" if ON_GPU else "cpu"


@pytest.fixture(params=BACKENDS)
def backend(request):
    """(kernels, device) for each invariant backend that runs here."""
    return backend_and_device(request.param)
