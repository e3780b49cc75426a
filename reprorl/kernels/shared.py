"""What every kernel backend shares: the rotary tables, the temperature's division of the
logits, argument checks, the padded batch moved into the layout of the engine's
attention, and the KV cache's row writes."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from reprorl.kernels.pinned import pinned_pow, pinned_sincos

# The KV cache's capacity is a whole number of these (`models.kv_cache.KVCache`), and the
# invariant attention backends read keys in chunks of it; a short sequence pads to less.
KEY_BLOCK = 128


def rope_tables(head_dim: int, theta: float, num_positions: int) -> tuple[Tensor, Tensor]:
    """Plain RoPE's rotary tables (`rotary_tables` of the default inverse frequencies)."""
    inv_freq = 1.0 / pinned_pow(theta, torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    return rotary_tables(inv_freq, num_positions)


def rotary_tables(inv_freq: Tensor, num_positions: int, attention_factor: float = 1.0) -> tuple[Tensor, Tensor]:
    """The rotary tables for positions 0..num_positions-1: (cos, sin_rot), each [P, D] float32,
    D = 2 x len(inv_freq) (models/rope.py computes a variant's inv_freq and attention factor).

    Angles are computed once per model, in float32 the way transformers computes them (its
    cos and sin times the attention factor), so a position's entries are constants: the same
    bits whatever batch asks for them; under full determinism sin and cos are cpu_math's,
    the same bits on any CPU. `sin_rot` is sin with its first half negated, the form
    `apply_rotary` reads. (Su et al. 2021, RoFormer)
    """
    half = inv_freq.shape[0]
    freqs = torch.arange(num_positions, dtype=torch.int64).float()[:, None] * inv_freq[None, :]  # [P, D/2]
    angles = torch.cat((freqs, freqs), dim=-1)  # [P, D]
    sin, cos = pinned_sincos(angles)
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)


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


def scale_logits(logits: Tensor, temperature: float) -> Tensor:
    """logits in float32, divided by `temperature` (<= 0, greedy: as 1, as the engine)."""
    scaled = logits.float()
    if temperature <= 0:
        return scaled
    # Divided by a tensor on the logits' device, as the engine's sampler divides each row:
    # CUDA divides by a host number as a multiplication by its reciprocal, which can round
    # differently in the last bit (the CPU divides either way).
    return scaled / torch.tensor(temperature, dtype=scaled.dtype, device=scaled.device)


def check_window(window: int) -> None:
    """A sliding window: 0 (full causal attention) or W > 0 (a query at position p sees the
    W keys p-W+1..p). A Python int, never a tensor: kernels take it as a constant."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"window = {window!r}; expected an int >= 0 (0: full causal attention, W: the last W keys)")


def seen_keys(pos: Tensor, num_keys: int, window: int) -> Tensor:
    """pos [...] (each query's position) -> [..., num_keys] bool, True where the query sees the
    key: keys 0..pos, or with a window W > 0 keys pos-W+1..pos (transformers' sliding window)."""
    keys = torch.arange(num_keys, device=pos.device)
    seen = keys <= pos[..., None]
    if window:
        seen &= keys > pos[..., None] - window
    return seen


def check_batched_attention(q: Tensor, k: Tensor, v: Tensor, q_start: Tensor, window: int = 0) -> None:
    """The shapes `batched_attention` takes: q [B, Hq, Tq, D], k/v [B, Hkv, Tk, D], q_start [B];
    and its window (`check_window`)."""
    check_window(window)
    b, hq = q.shape[:2]
    if q.dim() != 4 or hq % k.shape[1] or k.shape != v.shape or k.shape[0] != b or q_start.shape != (b,) \
            or k.shape[3] != q.shape[3]:
        raise ValueError(f"batched_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"q_start {tuple(q_start.shape)} do not fit")


class Padding:
    """Where a padded batch's real tokens are: made once a forward, read by every layer's
    `padded_attention` (the sorts behind the moves are per batch, not per layer: 24 pairs of
    them were 0.9 ms of a 256-token Qwen2.5-0.5B forward's 3.5 on the H200).

    `mask` [B, T] bool (True = real; left or right padding), or None: no padding. `moves`,
    worked out on first use: `order` [B, T] moves each row's real tokens to its front, in
    order (a stable sort puts real before padding), `inverse` moves them back, and
    `front_real` [B, T] marks the real ones after the move. `sdpa_mask(window)`, also on
    first use, one a window: the stock backend's [B, 1, T, T] attention mask.
    """

    def __init__(self, attention_mask: Tensor | None, *, in_front: bool = False) -> None:
        self.mask = None if attention_mask is None else attention_mask.bool()
        self.in_front = in_front
        """Each row's real tokens already come first (`front`): attention needs no moves."""
        self._moves: tuple[Tensor, Tensor, Tensor] | None = None
        self._sdpa_masks: dict[int, Tensor] = {}  # window -> its mask

    @staticmethod
    def of(padding: Padding | Tensor | None) -> Padding:
        """A `Padding` from itself, an attention mask, or None (no padding)."""
        return padding if isinstance(padding, Padding) else Padding(padding)

    @property
    def moves(self) -> tuple[Tensor, Tensor, Tensor]:
        if self._moves is None:
            order = torch.argsort((~self.mask).to(torch.uint8), dim=-1, stable=True)  # [B, T]
            inverse = torch.argsort(order, dim=-1)  # inverse[b, order[b, t]] = t
            self._moves = order, inverse, self.mask.gather(1, order)
        return self._moves

    def sdpa_mask(self, window: int = 0) -> Tensor:
        """[B, 1, T, T] bool, True where a query attends: causal, real keys only, with a window
        W > 0 the last W of them (positions count a row's real tokens, as position_ids =
        cumsum(mask) - 1), and each padding query sees itself, so no row is all -inf (which
        would give NaN). The stock backend's mask, made on first use and then shared by
        every layer of that window."""
        check_window(window)
        if window not in self._sdpa_masks:
            t, device = self.mask.shape[1], self.mask.device
            allowed = torch.ones(t, t, dtype=torch.bool, device=device).tril() & self.mask[:, None, None, :]
            if window:
                pos = self.mask.cumsum(-1) - 1  # [B, T]
                allowed &= pos[:, None, :, None] - pos[:, None, None, :] < window
            self._sdpa_masks[window] = allowed | torch.eye(t, dtype=torch.bool, device=device)
        return self._sdpa_masks[window]

    def front(self) -> Padding:
        """This batch with each row's real tokens moved to its front, in order: what a model
        whose every other op is batch-invariant can run its layers on, so that attention needs
        no moves (one gather in and one out a forward, `to_front` and `from_front`, instead
        of eight a layer with the backward; a row's bits do not change, since no invariant op
        reads where its row sits)."""
        return Padding(self.moves[2], in_front=True)

    def to_front(self, x: Tensor) -> Tensor:
        """x [B, T, ...] in this batch's layout -> its rows' real tokens first (`front`)."""
        order, inverse, _ = self.moves
        return _Permute.apply(x, order, inverse)

    def from_front(self, x: Tensor) -> Tensor:
        """The inverse of `to_front`."""
        order, inverse, _ = self.moves
        return _Permute.apply(x, inverse, order)


def unpadded_attention(batched_attention: Callable[..., Tensor], q: Tensor, k: Tensor, v: Tensor,
                       window: int = 0) -> Tensor:
    """Causal attention of a batch with no padding: q [B, T, Hq, D], k/v [B, T, Hkv, D] ->
    [B, T, Hq, D], each row one sequence from position 0 (what `padded_as_sequences` computes
    for an all-real mask, without its moves)."""
    q_start = torch.zeros(q.shape[0], dtype=torch.long, device=q.device)
    return batched_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), q_start,
                             window=window).transpose(1, 2)


def padded_as_sequences(batched_attention: Callable[..., Tensor], q: Tensor, k: Tensor, v: Tensor,
                        padding: Padding | Tensor | None, window: int = 0) -> Tensor:
    """Causal attention of a padded batch through a backend's `batched_attention`.

    q [B, T, Hq, D], k/v [B, T, Hkv, D], padding: a `Padding` or its attention mask [B, T]
    -> [B, T, Hq, D], zeros at padding. Each row's real tokens are moved to its front, in
    order, attended as one sequence from position 0 (the arithmetic of the engine's prefill
    and decode), then moved back. This is how the trainer's forward gives the engine's
    bits; with a window, a token's position is its index after the move (its row's count of
    real tokens before it). Differentiable: both moves are permutations, whose gradient is
    the inverse permutation (`_Permute`).
    """
    padding = Padding.of(padding)
    if padding.mask is None:
        return unpadded_attention(batched_attention, q, k, v, window)
    if padding.in_front:
        return unpadded_attention(batched_attention, q, k, v, window).masked_fill(~padding.mask[:, :, None, None], 0.0)
    b = q.shape[0]
    order, inverse, front_real = padding.moves

    def front(x: Tensor) -> Tensor:  # [B, T, H, D] -> [B, H, T, D]
        return _Permute.apply(x, order, inverse).transpose(1, 2)

    out = batched_attention(front(q), front(k), front(v), order.new_zeros(b), window=window).transpose(1, 2)
    out = out.masked_fill(~front_real[:, :, None, None], 0.0)  # [B, T, Hq, D]
    return _Permute.apply(out, inverse, order)


def _take_along_rows(x: Tensor, index: Tensor) -> Tensor:
    """x [B, T, ...] -> out[b, t] = x[b, index[b, t]] (index [B, T])."""
    return x.gather(1, index.view(*index.shape, *([1] * (x.dim() - 2))).expand_as(x))


class _Permute(torch.autograd.Function):
    """`x[b, perm[b, t]]` along dim 1, with the inverse permutation as its gradient: a gather
    both ways, each entry copied once. (Autograd's own gradient of a gather is a scatter-add,
    which under torch's deterministic algorithms, on by full determinism, sorts its indices
    and runs an index_put: the largest kernel of a bf16 update in bench/train_step.py
    --profile; the figures: docs/performance.md.)"""

    @staticmethod
    def forward(ctx, x: Tensor, perm: Tensor, inverse: Tensor) -> Tensor:
        ctx.save_for_backward(inverse)
        return _take_along_rows(x, perm)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        (inverse,) = ctx.saved_tensors
        return _take_along_rows(grad, inverse), None, None


def write_rows(dst: Tensor, rows: Tensor, src: Tensor) -> None:
    """dst[rows[i]] = src[i] in place: dst [R, C] with contiguous rows, src [n, C]. The rows
    must be distinct where anyone reads them (duplicates race on CUDA). On CUDA one Triton
    launch (`reprorl.kernels.gpu.rows` says why not index_put), elsewhere index_put."""
    if dst.is_cuda:
        from reprorl.kernels.gpu.rows import write_rows as triton_write_rows

        triton_write_rows(dst, rows, src)
    else:
        dst[rows] = src
