"""The op layer: every linear, norm, softmax, rotary embedding and attention of a model.

This module is the ONE place where batch invariance lives. Outside the mode each op is
the plain, fastest torch call. Inside it (`batch_invariant()`), each output row depends
only on that row's inputs: not on how many rows are in the call, where the row sits, what
the other rows hold, or the number of CPU threads. The engine's rollouts, the reward
model and the trainer's log-probs all run through here, which is what lets a token's
log-prob be the same bits whatever it was batched with (DESIGN.md, contract point 2).

How each op gets there (CPU, torch 2.13 + MKL; measured, and tested in
tests/models/test_ops.py):
- matmul: MKL's sgemm takes one kernel for 1 row, another for 2-3 rows and a third for
  4 or more, and rows past a multiple of 4 go to the small kernels; with N or K not a
  multiple of its blocking, the thread split changes some columns' results. Padding M to
  a multiple of 4 and N, K to multiples of 16 gave the same bits for a row in every M
  tried (1..2048), at every position, with 1..6 threads, for K up to 65536 and N up to
  32000; batched matmul entries give the same bits as 2-D ones. So no fixed row tile is
  needed: ~1.0x the plain cost from 8 rows up (`_matmul_rows`).
- attention: scores and p v are such matmuls. p v sums over keys, and a sum longer than
  MKL's K block is grouped by that block, so it is cut into fixed KEY_BLOCK chunks.
  Masked keys get probability exactly 0, so extra keys change no bit.
- sums over the last dim (RMSNorm over a hidden size, log-softmax over a vocabulary,
  softmax over keys): torch's fused `rms_norm`, `log_softmax` and `softmax` reduce each
  row on its own in an order set by the width alone, and -inf padding (masked keys) does
  not change a softmax row's bits (tested: widths up to 151936, 1-3 threads).
- exp and log are elementwise and position-independent here (MKL VML); `F.silu` and
  `torch.sigmoid` are NOT (their vector and scalar-tail paths round differently), so
  SiLU is built from exp and IEEE ops.
- +, -, *, /, sqrt, max and gathers are exact, so they never depend on the batch.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor

_BATCH_INVARIANT = False

# MKL picks its sgemm kernel from M (1, 2-3, >=4 rows) and splits columns across threads
# in blocks; padding to these quanta keeps every row on the same kernel and block edges.
ROW_QUANTUM = 4
COL_QUANTUM = 16
# Batch-invariant attention works on blocks of queries (bounds the [rows, keys] score
# matrix) and sums p v over fixed chunks of keys (see `_attend_invariant`). 128 keys: a
# short sequence (a reward model's ~70 tokens) pads its p v to less; 30% faster there
# than 256, the same for decode steps.
QUERY_BLOCK = 256
KEY_BLOCK = 128
# `batched_attention` takes sequences in groups whose score matrix holds at most this many
# entries (16 MiB of float32): memory stays bounded, and no row's bits depend on the group.
SCORE_ELEMENTS = 1 << 22


def set_batch_invariant(enabled: bool) -> None:
    """Turn batch-invariant mode on or off for the whole process."""
    global _BATCH_INVARIANT
    _BATCH_INVARIANT = bool(enabled)


def is_batch_invariant() -> bool:
    """Whether batch-invariant mode is on."""
    return _BATCH_INVARIANT


@contextmanager
def batch_invariant(enabled: bool = True) -> Iterator[None]:
    """Run a block with batch-invariant mode set to `enabled`, restoring the previous mode."""
    previous = _BATCH_INVARIANT
    set_batch_invariant(enabled)
    try:
        yield
    finally:
        set_batch_invariant(previous)


def _check_cpu(x: Tensor) -> None:
    # The quanta above were measured for MKL on the CPU; a GPU needs its own kernels.
    if x.device.type != "cpu":
        raise NotImplementedError(f"batch-invariant ops are implemented for CPU tensors only, got {x.device}")


def _matmul_rows(a: Tensor, b: Tensor, bias: Tensor | None = None) -> Tensor:
    """`a @ b.T (+ bias)` with each output row independent of the other rows and the thread count.

    a [M, K], b [N, K], bias [N] | None -> [M, N]. Zero padding changes no real entry: padded
    rows and columns are dropped, and a zero pair adds an exact 0 to each dot product. The
    bias goes in through the GEMM itself (addmm: one op; each row gets it the same way).
    """
    _check_cpu(a)
    m, k = a.shape
    n = b.shape[0]
    pad_m, pad_k, pad_n = -m % ROW_QUANTUM, -k % COL_QUANTUM, -n % COL_QUANTUM
    # Always hand MKL the same layout (contiguous a, contiguous b used transposed).
    a = F.pad(a, (0, pad_k, 0, pad_m)) if pad_m or pad_k else a.contiguous()
    b = F.pad(b, (0, pad_k, 0, pad_n)) if pad_k or pad_n else b.contiguous()
    if bias is None:
        out = a @ b.t()
    else:
        out = torch.addmm(F.pad(bias, (0, pad_n)) if pad_n else bias, a, b.t())
    return out[:m, :n] if pad_m or pad_n else out


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`x @ weight.T + bias`: x [..., K], weight [N, K], bias [N] | None -> [..., N]."""
    if not _BATCH_INVARIANT:
        return F.linear(x, weight, bias)
    return _matmul_rows(x.reshape(-1, x.shape[-1]), weight, bias).reshape(*x.shape[:-1], weight.shape[0])


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim, computed in float32 (as transformers does).

    x [..., H], weight [H] -> [..., H] in x's dtype times weight's.
    y = weight * (x / sqrt(mean(x^2) + eps)).  (Zhang & Sennrich 2019)
    """
    # torch's fused kernel reduces each row on its own, in an order fixed by the width alone
    # (tested row-invariant, like every op here): one op in either mode.
    xf = torch.rms_norm(x.float(), (x.shape[-1],), None, eps)
    return weight * xf.to(x.dtype)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """The gated MLP activation silu(gate) * up: [..., I], [..., I] -> [..., I]. (Shazeer 2020)"""
    if not _BATCH_INVARIANT:
        return F.silu(gate) * up
    g = gate.float()
    return (g / (1.0 + torch.exp(-g))).to(gate.dtype) * up


def softmax(x: Tensor) -> Tensor:
    """Softmax over the last dim, in float32: [..., V] -> [..., V] float32.

    torch's kernel is row-invariant, and a row padded with -inf to any width gives the same
    bits (tested: widths 16..4096, 1..256 rows, 1-2 threads), which attention needs: a
    row's key count depends on the longest sequence in its batch. One op in either mode.
    """
    return torch.softmax(x.float(), dim=-1)


def log_softmax(x: Tensor) -> Tensor:
    """Log-softmax over the last dim, in float32: [..., V] -> [..., V] float32.

    torch's kernel is row-invariant over a fixed width (a vocabulary): each row's max, sum
    of exps and log in an order set by V alone (tested up to V = 151936, threads 1-3).
    """
    return torch.log_softmax(x.float(), dim=-1)


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
    the same products bit for bit (negating a factor is exact), in one op fewer.
    """
    cos = cos.to(x.dtype).unsqueeze(-2)
    sin_rot = sin_rot.to(x.dtype).unsqueeze(-2)
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_rot


def attention(q: Tensor, k: Tensor, v: Tensor, q_start: int) -> Tensor:
    """Causal attention of ONE sequence over its keys, with grouped-query heads.

    q [Tq, Hq, D]: queries at cache positions q_start .. q_start+Tq-1.
    k, v [Tk, Hkv, D]: keys/values at cache positions 0..Tk-1, Tk >= q_start + Tq, Hq % Hkv == 0.
    Query i attends to keys 0..q_start+i; query head j reads key head j // (Hq // Hkv).
    Returns [Tq, Hq, D]. In batch-invariant mode a query's output is the same bits whether
    it came alone (decode), in any prefill chunk, or with more keys after it in the cache.
    """
    tq, hq, d = q.shape
    tk, hkv, _ = k.shape
    if hq % hkv != 0 or tk < q_start + tq:
        raise ValueError(f"attention: q {tuple(q.shape)}, k {tuple(k.shape)}, q_start {q_start} do not fit")
    if not _BATCH_INVARIANT:
        mask = None
        if tq > 1 or tk != q_start + tq:
            mask = torch.arange(tk, device=q.device)[None, :] <= q_start + torch.arange(tq, device=q.device)[:, None]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask, enable_gqa=True
        )  # [1, Hq, Tq, D]
        return out[0].transpose(0, 1)
    group = hq // hkv
    keys, values = k.transpose(0, 1), v.transpose(0, 1)  # [Hkv, Tk, D]
    blocks = []
    for start in range(0, tq, QUERY_BLOCK):
        n = min(QUERY_BLOCK, tq - start)
        num_keys = q_start + start + n  # keys past the block's last query are left out
        # rows of kv head h: its G query heads, each over the block's n queries: [Hkv, G*n, D]
        rows = q[start : start + n].view(n, hkv, group, d).permute(1, 2, 0, 3).reshape(hkv, group * n, d)
        q_pos = q_start + start + torch.arange(n, device=q.device).repeat(group)  # [G*n]
        allowed = torch.arange(num_keys, device=q.device)[None, :] <= q_pos[:, None]  # [G*n, keys]
        out = _attend_invariant(rows, keys[:, :num_keys], values[:, :num_keys], allowed)  # [Hkv, G*n, D]
        blocks.append(out.view(hkv, group, n, d).permute(2, 0, 1, 3).reshape(n, hq, d))
    return torch.cat(blocks) if blocks else q.new_zeros(0, hq, d)


def batched_attention(q: Tensor, k: Tensor, v: Tensor, q_start: Tensor) -> Tensor:
    """Causal attention of B sequences at once, with grouped-query heads (head-major layout).

    q [B, Hq, Tq, D]: sequence b's queries, at positions q_start[b] .. q_start[b]+Tq-1.
    k, v [B, Hkv, Tk, D]: keys/values at positions 0..Tk-1 (views of a KV cache are fine).
    q_start [B] int64. A query at position p sees keys 0..min(p, Tk-1); keys past it are
    masked out and must only be finite (stale cache entries, padding). Returns [B, Hq, Tq, D].
    Query rows past a sequence's real ones (padding) give finite values the caller drops.

    In batch-invariant mode row (b, head, t) is bitwise `attention` of that one query over
    its sequence's keys (tested): the same arithmetic as `_attend_invariant`, vectorised
    over sequences. A row's dot products have a fixed length (D), its softmax sums over
    keys in our pairwise order (masked keys add exact zeros), and p v sums fixed KEY_BLOCK
    chunks from key 0 in order; so neither B, Tq, Tk nor the other sequences reach its bits.
    This is the engine's decode path (Tq = 1), its prefill and the reward model's (Tq > 1),
    and the trainer's (`padded_attention`).
    """
    b, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    if hq % hkv or k.shape != v.shape or k.shape[0] != b or q_start.shape != (b,):
        raise ValueError(f"batched_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"q_start {tuple(q_start.shape)} do not fit")
    if b == 0 or tq == 0:
        return q.new_zeros(b, hq, tq, d)
    group = hq // hkv
    blocks = []
    for qs in range(0, tq, QUERY_BLOCK):
        qn = min(QUERY_BLOCK, tq - qs)
        rows = q[:, :, qs : qs + qn].reshape(b, hkv, group * qn, d)  # [B, Hkv, G*qn, D]
        per_seq = hkv * group * qn * min(tk, int(q_start.max()) + qs + qn)  # score entries per sequence
        step = max(1, SCORE_ELEMENTS // per_seq)
        outs = [
            _attend_batch(rows[i : i + step], k[i : i + step], v[i : i + step], q_start[i : i + step] + qs, qn)
            for i in range(0, b, step)
        ]
        out = outs[0] if len(outs) == 1 else torch.cat(outs)  # [B, Hkv, G*qn, D]
        blocks.append(out.reshape(b, hq, qn, d))
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=2)


def _attend_batch(rows: Tensor, k: Tensor, v: Tensor, first_pos: Tensor, qn: int) -> Tensor:
    """rows [B, Hkv, G*qn, D] (row g*qn + t is query t, at position first_pos[b] + t),
    k, v [B, Hkv, Tk, D] -> [B, Hkv, G*qn, D]. See `batched_attention`."""
    b, hkv, r, d = rows.shape
    # Keys any row here can see, in whole COL_QUANTUMs (a row's scores do not depend on
    # how many columns the matmul has; masked columns are exact zeros after the softmax).
    nk = min(int(first_pos.max()) + qn, k.shape[2])
    if not _BATCH_INVARIANT:
        pos = first_pos[:, None] + _row_offsets(r, qn, 0, 0, rows.device)  # [B, R]
        masked = torch.arange(nk, device=rows.device) > pos[:, None, :, None]
        scores = torch.matmul(rows, k[:, :, :nk].transpose(-1, -2)).float() * d**-0.5  # [B, Hkv, R, nk]
        probs = torch.softmax(scores.masked_fill_(masked, float("-inf")), dim=-1).to(v.dtype)
        return torch.matmul(probs, v[:, :, :nk])
    _check_cpu(rows)
    pad_r, pad_d = -r % ROW_QUANTUM, -d % COL_QUANTUM
    nk_p = nk + (-nk % COL_QUANTUM)
    nb = nk + (-nk % KEY_BLOCK)
    rows = F.pad(rows, (0, pad_d, 0, pad_r)) if pad_r or pad_d else rows.contiguous()
    k, v = _keys_upto(k, nk_p, pad_d), _keys_upto(v, nb, pad_d)  # [B, Hkv, nk_p | nb, Dp]
    pos = first_pos[:, None] + _row_offsets(r, qn, pad_r, nk_p if pad_r else 0, rows.device)  # [B, Rp]
    masked = torch.arange(nk_p, device=rows.device) > pos[:, None, :, None]  # [B, 1, Rp, nk_p]
    scores = torch.matmul(rows, k.transpose(-1, -2)).float() * d**-0.5  # [B, Hkv, Rp, nk_p]
    probs = softmax(scores.masked_fill_(masked, float("-inf"))).to(v.dtype)
    if nb > nk_p:
        probs = F.pad(probs, (0, nb - nk_p))
    out = None
    for kb in range(0, nb, KEY_BLOCK):
        chunk = probs[..., kb : kb + KEY_BLOCK].contiguous()  # [B, Hkv, Rp, KEY_BLOCK]
        part = torch.matmul(chunk, v[:, :, kb : kb + KEY_BLOCK])
        out = part if out is None else out + part
    return out[:, :, :r, :d]


@functools.lru_cache(maxsize=256)
def _row_offsets(r: int, qn: int, pad: int, see_all: int, device: torch.device) -> Tensor:
    """[r + pad] int64: row i's query offset, i % qn; padding rows get `see_all`, so that
    they see every key and no row is all -inf (no NaN). Cached: every layer asks again."""
    with torch.inference_mode(False):
        return torch.tensor([i % qn for i in range(r)] + [see_all] * pad, device=device)


def _keys_upto(x: Tensor, n: int, pad_d: int) -> Tensor:
    """x [B, Hkv, T, D] -> its first n positions (zero rows past T), D zero-padded by pad_d;
    rows contiguous, the layout every invariant matmul reads."""
    if n <= x.shape[2] and not pad_d and x.stride(-1) == 1:
        return x[:, :, :n]
    return F.pad(x[:, :, :n], (0, pad_d, 0, max(0, n - x.shape[2])))


def _attend_invariant(rows: Tensor, keys: Tensor, values: Tensor, allowed: Tensor) -> Tensor:
    """The row-invariant core of attention, batched over leading dims [...]:
    softmax(rows keys^T / sqrt(D), masked to `allowed`) values.

    rows [..., R, D], keys/values [..., L, D], allowed [..., R, L] (broadcastable) -> [..., R, D].
    Padding as in `_matmul_rows` (batched matmul entries give the same bits as 2-D ones).
    Masked and padded keys get probability exactly 0, so they change no bit. p v sums
    over keys, and MKL groups a long sum by its own K blocks, so it is cut into fixed
    KEY_BLOCK chunks (every call the same K) added in order; chunks past a row's last key
    add exact zeros.
    """
    _check_cpu(rows)
    r, d = rows.shape[-2:]
    length = keys.shape[-2]
    pad_r, pad_d, pad_l = -r % ROW_QUANTUM, -d % COL_QUANTUM, -length % KEY_BLOCK
    # Every matmul gets row-major operands, so MKL always sees the same layout.
    rows = F.pad(rows, (0, pad_d, 0, pad_r)).contiguous()
    keys = F.pad(keys, (0, pad_d, 0, pad_l)).contiguous()
    values = F.pad(values, (0, pad_d, 0, pad_l)).contiguous()  # [..., Lp, Dp]
    allowed = F.pad(allowed, (0, pad_l), value=False)
    if allowed.shape[-2] != 1:  # padding rows may see every key: no all -inf row, no NaN
        allowed = F.pad(allowed, (0, 0, 0, pad_r), value=True)
    scores = torch.matmul(rows, keys.transpose(-1, -2)).float() * d**-0.5  # [..., Rp, Lp]
    probs = softmax(scores.masked_fill(~allowed, float("-inf"))).to(values.dtype)
    out = None
    for kb in range(0, length, KEY_BLOCK):
        chunk = probs[..., kb : kb + KEY_BLOCK].contiguous()  # [..., Rp, KEY_BLOCK]
        part = torch.matmul(chunk, values[..., kb : kb + KEY_BLOCK, :])
        out = part if out is None else out + part
    return out[..., :r, :d]


def padded_attention(q: Tensor, k: Tensor, v: Tensor, attention_mask: Tensor) -> Tensor:
    """Causal attention of a padded batch (left or right padding).

    q [B, T, Hq, D], k/v [B, T, Hkv, D], attention_mask [B, T] (1 = real token) -> [B, T, Hq, D].
    A query sees the real keys at or before it. Outputs at padding positions are not
    meaningful (zeros in batch-invariant mode). In batch-invariant mode each sequence's
    real tokens go through `batched_attention` as one sequence from position 0, the
    arithmetic the engine uses, so the two paths give the same bits.
    """
    b, t, hq, d = q.shape
    real = attention_mask.bool()
    if _BATCH_INVARIANT:
        # Each row's real tokens moved to its front, in order (a stable sort puts real before
        # padding), as one sequence from position 0; then moved back, zeros at padding.
        order = torch.argsort((~real).to(torch.uint8), dim=-1, stable=True)  # [B, T]

        def front(x: Tensor) -> Tensor:  # [B, T, H, D] -> [B, H, T, D]
            return x.gather(1, order[:, :, None, None].expand_as(x)).transpose(1, 2)

        out = batched_attention(front(q), front(k), front(v), q_start=order.new_zeros(b)).transpose(1, 2)
        out = out.masked_fill(~real.gather(1, order)[:, :, None, None], 0.0)  # [B, T, Hq, D]
        return torch.zeros_like(out).scatter(1, order[:, :, None, None].expand_as(out), out)
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    # Padding queries see only themselves, so no row is all -inf (which would give NaN).
    mask = (causal & real[:, None, None, :]) | torch.eye(t, dtype=torch.bool, device=q.device)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=True
    )  # [B, Hq, T, D]
    return out.transpose(1, 2)


# ---- a start-up check that this machine's kernels keep the promise -----------------------

class BatchInvarianceError(RuntimeError):
    """This machine's kernels do not give the row invariance that batch-invariant mode promises."""


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


@functools.lru_cache(maxsize=None)
def _invariance_problems(hidden: int, intermediate: int, vocab: int, num_heads: int, num_kv_heads: int,
                         head_dim: int, dtype: torch.dtype, threads: int) -> tuple[str, ...]:
    """Each op of a model of these shapes on a random row: alone with one thread, then inside
    batches of other sizes, at other positions, with `threads` threads. Returns what differed."""
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    w_up, w_down = rand(intermediate, hidden) * 0.05, rand(hidden, intermediate) * 0.05
    # A vocabulary-sized matrix from 4096 random rows, repeated: drawing 150k x 1k normals
    # would cost seconds, and invariance needs no distinct values.
    w_head = (rand(min(vocab, 4096), hidden) * 0.05).repeat(-(-vocab // 4096), 1)[:vocab].contiguous()
    norm_w = 1 + 0.1 * rand(hidden)
    w_q, w_kv = rand(num_heads * head_dim, hidden) * 0.05, rand(num_kv_heads * head_dim, hidden) * 0.05
    b_q = rand(num_heads * head_dim)
    w_o = rand(hidden, num_heads * head_dim) * 0.05
    checks = {
        f"linear {hidden}->{num_heads * head_dim} with bias (q)": (hidden, lambda x: linear(x, w_q, b_q)),
        f"linear {hidden}->{num_kv_heads * head_dim} (k, v)": (hidden, lambda x: linear(x, w_kv)),
        f"linear {num_heads * head_dim}->{hidden} (o)": (num_heads * head_dim, lambda x: linear(x, w_o)),
        f"linear {hidden}->{intermediate}": (hidden, lambda x: linear(x, w_up)),
        f"linear {intermediate}->{hidden}": (intermediate, lambda x: linear(x, w_down)),
        f"linear {hidden}->{vocab} (LM head)": (hidden, lambda x: linear(x, w_head)),
        f"rms_norm over {hidden}": (hidden, lambda x: rms_norm(x, norm_w, 1e-6)),
        f"swiglu over {intermediate}": (intermediate, lambda x: swiglu(x, x.flip(-1))),
        f"log_softmax over {vocab}": (vocab, lambda x: log_softmax(x * 4)),
    }
    problems = []
    previous = torch.get_num_threads()
    try:
        with batch_invariant(), torch.inference_mode():
            for name, (width, fn) in checks.items():
                row = rand(1, width)
                torch.set_num_threads(1)
                alone = fn(row)[0]
                torch.set_num_threads(threads)
                for m, pos in ((2, 1), (3, 0), (4, 3), (5, 2), (8, 7), (13, 6), (64, 33)):
                    batch = rand(m, width)
                    batch[pos] = row[0]
                    if not torch.equal(fn(batch)[pos], alone):
                        problems.append(f"{name}: a row alone and row {pos} of {m} differ")
                        break
            # Attention: sequence 0 (a decode query over 77 cached keys) alone, then among others.
            lens = [77, 5, 140, 33, 1]
            k, v = rand(len(lens), num_kv_heads, 160, head_dim), rand(len(lens), num_kv_heads, 160, head_dim)
            q = rand(len(lens), num_heads, 1, head_dim)
            start = torch.tensor([n - 1 for n in lens])
            torch.set_num_threads(1)
            alone = batched_attention(q[:1], k[:1, :, :77], v[:1, :, :77], start[:1])[0]
            torch.set_num_threads(threads)
            if not torch.equal(batched_attention(q, k, v, start)[0], alone):
                problems.append(f"attention ({num_heads} heads, {num_kv_heads} kv heads, head_dim {head_dim}): "
                                "a sequence alone and in a batch of 5 differ")
    finally:
        torch.set_num_threads(previous)
    return tuple(problems)


def verify_batch_invariance(args, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
    """Check, once per process and model shape, that batch-invariant mode holds on this machine.

    The CPU recipe above rests on measured kernel behaviour (MKL's sgemm kernels, torch's
    row reductions) of this project's machines; another CPU or library build may break it,
    and then runs would silently differ between batchings. So every part that runs in
    batch-invariant mode calls this at start: each op of a model of `args`' shapes, on a
    random row alone vs inside batches of 2..64 rows at varied positions and at the current
    thread count (under 0.1 s for a tiny model, 1.6 s for a 0.5B one). Raises
    `BatchInvarianceError` naming the op, the CPU and torch if a row differs.
    """
    if torch.device(device).type != "cpu":
        return  # the op layer refuses non-CPU tensors in this mode (`_check_cpu`)
    problems = _invariance_problems(args.hidden_size, args.intermediate_size, args.vocab_size,
                                    args.num_attention_heads, args.num_key_value_heads, args.head_dim,
                                    dtype, torch.get_num_threads())
    if problems:
        raise BatchInvarianceError(
            f"batch-invariant mode does not hold on this machine ({_cpu_name()}, torch {torch.__version__}): "
            f"{'; '.join(problems)}. reprorl's CPU recipe (reprorl/models/ops.py) does not fit this machine's "
            "kernels: run with full_determinism=false (results then differ in the last bits between batchings)"
        )
