"""Host memory of optimizer offload (`actor.optimizer_offload`, `critic.optimizer_offload`:
workers/offload.py), estimated before a run starts beside its GPU memory (memory.py).

An offloading group's rank keeps on the host, for the whole run: its float32 master shard,
the two AdamW moments, and the gradient tree's float32 vectors, `max_pending` of its
leaves (workers/grad_tree.py), kept from step to step. Its GPU then holds, for the update,
one parameter's gradient in float32 and in the compute dtype and a pending sum's piece of
it, and, for the optimizer step, a slice of the new weights on their way (offload.py's
`PUBLISH_SLICE`), each a phase of its own. One GPU per offloading group (config/checks.py), so the host holds one
rank of each.

The check compares the total with the host's available memory (MemAvailable: what the
kernel can give without swapping, page cache included), read when the run starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from reprorl.errors import ConfigError
from reprorl.models.arch import ModelArgs
from reprorl.workers.grad_tree import max_pending
from reprorl.workers.offload import PUBLISH_SLICE

GIB = 2**30
FP32 = 4


def largest_parameter(args: ModelArgs) -> int:
    """Elements of the model's largest parameter: the embedding or a layer's widest projection."""
    widest = max(args.intermediate_size, args.num_attention_heads * args.head_dim) * args.hidden_size
    return max(args.vocab_size * args.hidden_size, widest)


def offloaded_parts(host: dict[str, int], phases: dict[str, dict[str, int]], *, name: str, shard_bytes: int,
                    vector_bytes: int, leaves: int, largest: int, dsize: int) -> None:
    """An offloading group's parts: on the host (`host`: master, moments, the tree's
    vectors), and the GPU's phases of its own (`phases`): a parameter's gradient on its way
    to the host, and the optimizer step's slice of new weights. `leaves`: the gradient
    tree's leaves on this rank; `vector_bytes`: one of its vectors.

    The gradient is a phase of its own, not a part of the update beside the activations: a
    parameter's gradient is final, and copied, once the backward pass is past the layer that
    made it, whose activations are then freed (measured at 0.5B and 7B on an H100: counted
    beside the activations, the estimate was 7.9% and 12.9% above the peaks)."""
    sums = max_pending(leaves)
    host[f"{name} master weights (float32, host)"] = shard_bytes
    host[f"{name} AdamW moments (float32, host)"] = 2 * shard_bytes
    host[f"{name} gradient sums ({sums} x float32, host)"] = sums * vector_bytes
    phases[f"{name} gradients to the host"] = {
        f"a parameter's gradient (float32 and its {dsize}-byte cast, and a pending sum's piece)":
            largest * (2 * FP32 + dsize)}
    phases[f"{name} optimizer step"] = {"new weights on their way from the host (a slice)": PUBLISH_SLICE * dsize}


def host_available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo in bytes; None where there is none (not Linux)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_host_memory(host: dict[str, int], available: int | None, cfg: Any) -> None:
    """Stop a run whose offloaded state will not fit the host: a one-line ConfigError."""
    needed = sum(host.values())
    if not needed or available is None or needed <= available:
        return
    raise ConfigError(
        f"host memory: optimizer offload keeps about {needed / GIB:.1f} GiB on the host and {available / GIB:.1f} "
        f"GiB are available; would fit: fewer micro-batches per optimizer step (a larger actor.ppo_micro_batch_size="
        f"{cfg.actor.ppo_micro_batch_size} or a smaller actor.ppo_mini_batch_size={cfg.actor.ppo_mini_batch_size}: "
        "the gradient tree keeps log2 of their count in float32 vectors), or LoRA (`reprorl config ... --memory` "
        "shows each part)")
