"""A start-up check that a batch-invariant backend keeps its promise on this machine.

Every part that runs batch-invariant (engine, actor, reference, critic, reward model) calls
`verify_batch_invariance` once per process and model shape: each op of the model's shapes
on a random row alone, then inside batches of other sizes at other positions (and on the
CPU at the run's thread count). A kernel is invariant by construction, but a machine, a
BLAS or a compiler can still surprise; then the run stops at start, naming the op, the
device and the shape, instead of silently losing bitwise reproducibility.
"""

from __future__ import annotations

import functools
import platform

import torch

# (rows in the batch, the checked row's place): small counts where libraries switch
# kernels, and counts past the row tiles of the CPU (32) and GPU (64, 128) kernels.
BATCHES = ((2, 1), (3, 0), (4, 3), (5, 2), (8, 7), (13, 6), (64, 33), (200, 161))


class BatchInvarianceError(RuntimeError):
    """This machine's kernels do not give the row invariance that batch-invariant mode promises."""


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.lru_cache(maxsize=None)
def _invariance_problems(kernels, hidden: int, intermediate: int, vocab: int, num_heads: int, num_kv_heads: int,
                         head_dim: int, dtype: torch.dtype, device: str, threads: int,
                         gated: str = "swiglu") -> tuple[str, ...]:
    """Each op of a model of these shapes on a random row: alone (with one thread on the
    CPU), then inside batches of other sizes, at other positions (with `threads` threads).
    Returns what differed."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    w_up, w_down = rand(intermediate, hidden) * 0.05, rand(hidden, intermediate) * 0.05
    # A vocabulary-sized matrix from 4096 random rows, repeated: drawing 150k x 1k normals
    # would cost seconds, and invariance needs no distinct values.
    w_head = (rand(min(vocab, 4096), hidden) * 0.05).repeat(-(-vocab // 4096), 1)[:vocab].contiguous()
    norm_w = 1 + 0.1 * rand(hidden)
    w_q, w_kv = rand(num_heads * head_dim, hidden) * 0.05, rand(num_kv_heads * head_dim, hidden) * 0.05
    b_q = rand(num_heads * head_dim)
    w_o = rand(hidden, num_heads * head_dim) * 0.05
    checks = {
        f"linear {hidden}->{num_heads * head_dim} with bias (q)": (hidden, lambda x: kernels.linear(x, w_q, b_q)),
        f"linear {hidden}->{num_kv_heads * head_dim} (k, v)": (hidden, lambda x: kernels.linear(x, w_kv)),
        f"linear {num_heads * head_dim}->{hidden} (o)": (num_heads * head_dim, lambda x: kernels.linear(x, w_o)),
        f"linear {hidden}->{intermediate} (gate, up)": (hidden, lambda x: kernels.linear(x, w_up)),
        f"linear {intermediate}->{hidden} (down)": (intermediate, lambda x: kernels.linear(x, w_down)),
        f"linear {hidden}->{vocab} (LM head)": (hidden, lambda x: kernels.linear(x, w_head)),
        f"rms_norm over {hidden}": (hidden, lambda x: kernels.rms_norm(x, norm_w, 1e-6)),
        f"{gated} over {intermediate}": (intermediate, lambda x: getattr(kernels, gated)(x, x.flip(-1))),
        f"log_softmax over {vocab}": (vocab, lambda x: kernels.log_softmax(x * 4)),
    }
    problems = []
    previous = torch.get_num_threads()
    try:
        with torch.inference_mode():
            for name, (width, fn) in checks.items():
                row = rand(1, width)
                torch.set_num_threads(1)
                alone = fn(row)[0]
                torch.set_num_threads(threads)
                # A backend whose tiles change with the row count: a batch past each change.
                for m, pos in BATCHES + tuple((b + 1, b) for b in getattr(kernels, "row_buckets", ())):
                    batch = rand(m, width)
                    batch[pos] = row[0]
                    if not torch.equal(fn(batch)[pos], alone):
                        problems.append(f"{name}: a row alone and row {pos} of {m} differ")
                        break
            # Attention: sequence 0 (a decode query over 77 cached keys) alone, then among
            # others; and the same query as the last row of a 77-token prefill.
            lens = [77, 5, 140, 33, 1]
            kk, vv = rand(len(lens), num_kv_heads, 160, head_dim), rand(len(lens), num_kv_heads, 160, head_dim)
            q = rand(len(lens), num_heads, 1, head_dim)
            start = torch.tensor([n - 1 for n in lens], device=device)
            torch.set_num_threads(1)
            alone = kernels.batched_attention(q[:1], kk[:1, :, :77], vv[:1, :, :77], start[:1])[0]
            torch.set_num_threads(threads)
            shape = f"attention ({num_heads} heads, {num_kv_heads} kv heads, head_dim {head_dim})"
            if not torch.equal(kernels.batched_attention(q, kk, vv, start)[0], alone):
                problems.append(f"{shape}: a sequence alone and in a batch of 5 differ")
            prefill_q = rand(1, num_heads, 77, head_dim)
            prefill_q[:, :, 76] = q[0, :, 0]
            prefill = kernels.batched_attention(prefill_q, kk[:1, :, :77], vv[:1, :, :77], start.new_zeros(1))
            if not torch.equal(prefill[0, :, 76:], alone):
                problems.append(f"{shape}: a decode step and the last row of a prefill differ")
    finally:
        torch.set_num_threads(previous)
    return tuple(problems)


def verify_batch_invariance(kernels, args, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
    """Check, once per process and model shape, that `kernels` keep row invariance here.

    `args`: a `ModelArgs` (its widths, heads, vocabulary, and `gated`, the MLP's kernel).
    Under 0.1 s for a tiny model, about 2 s at Qwen2.5-0.5B shapes on the CPU. Raises
    `BatchInvarianceError` naming the op, the device, torch and the shape if a row differs.
    Backends without the promise (stock torch) are not checked.
    """
    if not kernels.batch_invariant:
        return
    device = torch.device(device)
    problems = _invariance_problems(kernels, args.hidden_size, args.intermediate_size, args.vocab_size,
                                    args.num_attention_heads, args.num_key_value_heads, args.head_dim,
                                    dtype, str(device), torch.get_num_threads(), args.gated)
    if problems:
        raise BatchInvarianceError(
            f"batch-invariant mode does not hold on this machine ({device_name(device)}, torch "
            f"{torch.__version__}, {kernels.name} kernels, {dtype}): {'; '.join(problems)}. "
            "Run with full_determinism=false (results then differ in the last bits between batchings)"
        )
