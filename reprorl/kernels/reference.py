"""The float64 reference: every op in double precision, written the plainest way.

Tests compare each backend's kernels with it (‖out − ref‖ / ‖ref‖ against a tolerance
stated with its reason). Results are float64 whatever the inputs' dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

from reprorl.kernels.shared import Padding, apply_rotary, check_batched_attention, padded_as_sequences, seen_keys


def _d(x: Tensor | None) -> Tensor | None:
    return None if x is None else x.double()


class ReferenceKernels:
    name = "reference"
    batch_invariant = False  # one reduction order, but nobody runs a model on it for speed

    @staticmethod
    def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        out = _d(x) @ _d(weight).t()
        return out if bias is None else out + _d(bias)

    @staticmethod
    def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
        x = _d(x)
        return _d(weight) * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)

    @staticmethod
    def swiglu(gate: Tensor, up: Tensor) -> Tensor:
        g = _d(gate)
        return g / (1 + torch.exp(-g)) * _d(up)

    @staticmethod
    def geglu(gate: Tensor, up: Tensor) -> Tensor:
        g = _d(gate)
        return 0.5 * g * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (g + 0.044715 * g**3))) * _d(up)

    @staticmethod
    def softmax(x: Tensor) -> Tensor:
        return torch.softmax(_d(x), dim=-1)

    @staticmethod
    def log_softmax(x: Tensor) -> Tensor:
        return torch.log_softmax(_d(x), dim=-1)

    @staticmethod
    def entropy(log_probs: Tensor) -> Tensor:
        y = _d(log_probs)
        return -(y.exp() * y).sum(dim=-1)

    @classmethod
    def token_log_probs(cls, logits: Tensor, tokens: Tensor, temperature: float, with_entropy: bool = False
                        ) -> tuple[Tensor, Tensor | None]:
        scaled = _d(logits) / temperature if temperature > 0 else _d(logits)
        log_p = cls.log_softmax(scaled)
        return log_p.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), (cls.entropy(log_p) if with_entropy else None)

    @staticmethod
    def apply_rotary(x: Tensor, cos: Tensor, sin_rot: Tensor) -> Tensor:
        return apply_rotary(_d(x), _d(cos), _d(sin_rot))

    @staticmethod
    def batched_attention(q: Tensor, k: Tensor, v: Tensor, q_start: Tensor, window: int = 0) -> Tensor:
        check_batched_attention(q, k, v, q_start, window)
        b, hq, tq, d = q.shape
        group = hq // k.shape[1]
        k, v = _d(k).repeat_interleave(group, 1), _d(v).repeat_interleave(group, 1)  # [B, Hq, Tk, D]
        scores = _d(q) @ k.transpose(-1, -2) / d**0.5  # [B, Hq, Tq, Tk]
        pos = q_start[:, None] + torch.arange(tq, device=q.device)  # [B, Tq]
        masked = ~seen_keys(pos[:, None, :], k.shape[2], window)  # [B, 1, Tq, Tk]
        return torch.softmax(scores.masked_fill(masked, float("-inf")), dim=-1) @ v

    @classmethod
    def padded_attention(cls, q: Tensor, k: Tensor, v: Tensor, padding: Padding | Tensor | None,
                         window: int = 0) -> Tensor:
        return padded_as_sequences(cls.batched_attention, q, k, v, padding, window)
