"""Shared fixtures: the project's tokenizer and per-test scratch directories.

Without a CUDA device, Triton kernels run under its interpreter (on CPU tensors), so CI
checks their arithmetic; the variable must be set before triton is first imported.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from reprorl.models.tokenizer import make_char_tokenizer


@pytest.fixture(scope="session")
def char_tokenizer():
    """The tiny models' character-level ChatML tokenizer (vocab 128)."""
    return make_char_tokenizer()


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray for one test module, shut down after it if this fixture started it.

    Modules never inherit each other's Ray (its actors, its reserved CPUs), so each runs
    the same alone and in the full suite.
    """
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()
