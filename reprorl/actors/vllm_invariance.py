"""A gap in vLLM's batch invariance that reprorl closes inside vLLM's worker process.

Under `VLLM_BATCH_INVARIANT=1`, vLLM's `RMSNorm.forward_cuda` hands every norm to
`rms_norm_batch_invariant`. Without a residual that is a Triton kernel with one fixed
reduction order per row. With a residual (every decoder layer's norms but the first, and the
final norm) it calls the fused add-and-norm CUDA kernel instead, whose block size, and with it
the order of each row's sum of squares, follows the step's token count: 1024 threads below
256 tokens, 256 from there on (vLLM issue 48271, fixed after 0.25.1 by pull request 48391).
A sequence's logits then depend on how many tokens shared its engine step, which arrival
times and the replica count change.

`invariant_residual_norm` wraps that function so that the residual path adds first, rounded
to the activations' dtype as the fused kernel rounds it, then normalises with the
fixed-order kernel. It takes effect where the function is looked up at call time: eager mode
(`rollout.vllm_enforce_eager=true`); a graph compiled or captured before the patch keeps
the kernel it traced.
"""

from __future__ import annotations

from typing import Any

_PATCHED = "_reprorl_invariant_residual"


def invariant_residual_norm() -> bool:
    """Route vLLM's residual RMSNorm through its fixed-order kernel; True when that is in place.

    False (nothing changed) without `VLLM_BATCH_INVARIANT`, or when the installed vLLM has no
    `rms_norm_batch_invariant` for its RMSNorm to call.
    """
    import vllm.envs as envs

    if not envs.VLLM_BATCH_INVARIANT:
        return False
    from vllm.model_executor.layers import layernorm

    original = getattr(layernorm, "rms_norm_batch_invariant", None)
    if original is None:
        return False
    if getattr(original, _PATCHED, False):
        return True

    def rms_norm(input: Any, weight: Any, eps: float = 1e-6, residual: Any = None) -> Any:
        if residual is None:
            return original(input, weight, eps)
        residual.add_(input)  # in place, as the fused kernel updates its residual
        return original(residual, weight, eps), residual

    setattr(rms_norm, _PATCHED, True)
    layernorm.rms_norm_batch_invariant = rms_norm
    return True
