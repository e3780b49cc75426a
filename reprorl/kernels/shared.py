"""What every kernel backend shares: the rotary tables, argument checks, the padded
batch moved into the layout of the engine's attention, and the KV cache's row writes."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

# The KV cache's capacity is a whole number of these (`models.transformer.KVCache`), and the
# invariant attention backends read keys in chunks of it; a short sequence pads to less.
KEY_BLOCK = 128


def rope_tables(head_dim: int, theta: float, num_positions: int) -> tuple[Tensor, Tensor]:
    """The rotary tables for positions 0..num_positions-1: (cos, sin_rot), each [P, D] float32.

    Angles are computed once per model, in float32 the way transformers computes them, so a
    position's entries are constants: the same bits whatever batch asks for them. `sin_rot`
    is sin with its first half negated, the form `apply_rotary` reads. (Su et al. 2021, RoFormer)
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.arange(num_positions, dtype=torch.int64).float()[:, None] * inv_freq[None, :]  # [P, D/2]
    angles = torch.cat((freqs, freqs), dim=-1)  # [P, D]
    sin = angles.sin()
    return angles.cos(), torch.cat((-sin[:, : head_dim // 2], sin[:, head_dim // 2 :]), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin_rot: Tensor) -> Tensor:
    """Rotate query/key heads by their positions' angles (half-split layout, as HF).

    x [..., H, D], cos/sin_rot [..., D] from `rope_tables` (one row per token, broadcast
    over the H heads) -> [..., H, D]. transformers computes x*cos + rotate_half(x)*sin with
    rotate_half(x) = cat(-x2, x1); x.roll(D/2) * sin_rot = cat(x2, x1) * cat(-sin1, sin2) is
    the same products bit for bit (negating a factor is exact), in one op fewer. Elementwise,
    so every backend's rows are independent of the batch.
    """
    cos = cos.to(x.dtype).unsqueeze(-2)
    sin_rot = sin_rot.to(x.dtype).unsqueeze(-2)
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_rot


def check_batched_attention(q: Tensor, k: Tensor, v: Tensor, q_start: Tensor) -> None:
    """The shapes `batched_attention` takes: q [B, Hq, Tq, D], k/v [B, Hkv, Tk, D], q_start [B]."""
    b, hq = q.shape[:2]
    if q.dim() != 4 or hq % k.shape[1] or k.shape != v.shape or k.shape[0] != b or q_start.shape != (b,) \
            or k.shape[3] != q.shape[3]:
        raise ValueError(f"batched_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"q_start {tuple(q_start.shape)} do not fit")


def padded_as_sequences(batched_attention: Callable[..., Tensor], q: Tensor, k: Tensor, v: Tensor,
                        attention_mask: Tensor) -> Tensor:
    """Causal attention of a padded batch through a backend's `batched_attention`.

    q [B, T, Hq, D], k/v [B, T, Hkv, D], attention_mask [B, T] (1 = real; left or right
    padding) -> [B, T, Hq, D], zeros at padding. Each row's real tokens are moved to its
    front, in order (a stable sort puts real before padding), attended as one sequence from
    position 0 (the arithmetic of the engine's prefill and decode), then moved back. This
    is how the trainer's forward gives the engine's bits. Differentiable (gathers and
    scatters).
    """
    b = q.shape[0]
    real = attention_mask.bool()
    order = torch.argsort((~real).to(torch.uint8), dim=-1, stable=True)  # [B, T]

    def front(x: Tensor) -> Tensor:  # [B, T, H, D] -> [B, H, T, D]
        return x.gather(1, order[:, :, None, None].expand_as(x)).transpose(1, 2)

    out = batched_attention(front(q), front(k), front(v), order.new_zeros(b)).transpose(1, 2)
    out = out.masked_fill(~real.gather(1, order)[:, :, None, None], 0.0)  # [B, T, Hq, D]
    return torch.zeros_like(out).scatter(1, order[:, :, None, None].expand_as(out), out)


def write_rows(dst: Tensor, rows: Tensor, src: Tensor) -> None:
    """dst[rows[i]] = src[i] in place: dst [R, C] with contiguous rows, src [n, C]. The rows
    must be distinct where anyone reads them (duplicates race on CUDA). On CUDA one Triton
    launch (`reprorl.kernels.gpu.rows` says why not index_put), elsewhere index_put."""
    if dst.is_cuda:
        from reprorl.kernels.gpu.rows import write_rows as triton_write_rows

        triton_write_rows(dst, rows, src)
    else:
        dst[rows] = src
