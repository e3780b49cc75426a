"""What an `Engine` is made with: `EngineOptions`, its keywords, checked when made; and
`gpu_cache_shape`, the KV cache those options give on a GPU's free memory (the trainer's
memory estimate sizes a replica's cache the same way)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from reprorl.kernels import KEY_BLOCK


@dataclass(frozen=True)
class EngineOptions:
    """How an `Engine` batches, caches and runs: its keywords, checked when made. What they
    leave to the model and the machine (`max_model_len`'s default, `num_threads`'s) the
    engine derives once, in its constructor."""

    batch_invariant: bool
    """Run the model on its device's batch-invariant kernels (the determinism contract;
    `reprorl.kernels.select_kernels`), else on the fastest ones."""
    eos_token_id: int | Iterable[int] | None
    """The end-of-sequence token: one id, several, or None."""
    max_num_seqs: int = 64
    """Most sequences running at once."""
    max_num_batched_tokens: int = 2048
    """Most tokens in one step; at least `max_num_seqs`, so every running sequence decodes each step."""
    max_model_len: int | None = None
    """Prompt plus generation, at most the model's rope table (None: min(that, 4096))."""
    starvation_steps: int = 256
    """Steps a request waits before it goes ahead of every priority (`scheduler.py`)."""
    num_threads: int | None = None
    """Torch threads of a step (None: the constructing thread's count)."""
    gpu_memory_utilization: float = 0.5
    """GPU: the share of the free device memory the KV cache takes, when the engine is made
    and again on wake_up (`gpu_cache_shape`)."""
    cuda_graphs: bool = True
    """GPU: replay decode steps from CUDA graphs (`cuda_graphs.py`); False: eager."""
    prefix_sharing: bool = True
    """Prefill a prompt once for the requests that bring it together (the n samples of a
    GRPO prompt) and copy its keys/values into the others' slots (`scheduler.py`)."""
    lookahead: bool = True
    """GPU, with graphs: while every running sequence decodes and none waits, launch step
    t+1 from step t's tokens on the device before copying them to the host (`lookahead.py`)."""

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs}: expected >= 1")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens}: expected >= max_num_seqs "
                f"({self.max_num_seqs}), so every running sequence can decode each step"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization}: expected a share in (0, 1]")

    @property
    def eos_token_ids(self) -> frozenset[int]:
        e = self.eos_token_id
        return frozenset() if e is None else frozenset([e]) if isinstance(e, int) else frozenset(e)


def gpu_cache_shape(args, dtype: torch.dtype, device: torch.device, max_num_seqs: int, max_model_len: int,
                    gpu_memory_utilization: float) -> tuple[int, int]:
    """(slots, tokens per slot) of a GPU KV cache within `gpu_memory_utilization` of the
    device's free memory: max_num_seqs slots of max_model_len tokens if they fit, else as
    many whole slots as fit (admission then waits for a free one), else one shorter slot.
    Raises ValueError when not even one KEY_BLOCK fits."""
    per_token = 2 * args.num_hidden_layers * args.num_key_value_heads * args.head_dim * dtype.itemsize
    free, _ = torch.cuda.mem_get_info(device)
    budget = int(gpu_memory_utilization * free)
    capacity = -(-max_model_len // KEY_BLOCK) * KEY_BLOCK
    slots = min(max_num_seqs, budget // (capacity * per_token) - 1)  # - 1: the spare slot
    if slots >= 1:
        return slots, capacity
    capacity = budget // (2 * per_token) // KEY_BLOCK * KEY_BLOCK
    if capacity < KEY_BLOCK:
        raise ValueError(
            f"gpu_memory_utilization={gpu_memory_utilization}: {budget / 2**20:.0f} MiB of the GPU's "
            f"{free / 2**20:.0f} MiB free hold no KV cache slot of {KEY_BLOCK} tokens ({per_token} bytes a token); "
            "raise gpu_memory_utilization or free GPU memory"
        )
    return 1, capacity
