"""Where each part of a run goes: `resources.device` resolved, and the Ray GPU share of each part.

On one GPU every part shares it through Ray GPU fractions (Ray places an actor that asks
for 0.25 GPU on a GPU with 0.25 free and sets its `CUDA_VISIBLE_DEVICES`; it does not cap
its memory). The rollout replicas take `resources.gpu_share_rollout` together, split
evenly; every other process that holds a model splits the rest evenly: the trainer's
workers (actor, reference, critic) and the reward-model replicas, each one share (the
reward model counts with the trainer's side: like the reference, it is a frozen model
that runs between rollouts, not an engine). Every share is rounded DOWN to Ray's
resolution (1e-4), so the shares never add up to more than one GPU and every part fits.

    plan = plan_placement("auto", actor_workers=1, ref_workers=1, critic_workers=0,
                          reward_replicas=1, rollout_replicas=2, rollout_share=0.3)
    plan.device          # "cuda" on a machine with a GPU, else "cpu" (all shares 0)
    plan.rollout_gpus    # 0.15 each on a GPU
    plan.worker_gpus     # 0.2333 each (0.7 over actor, reference, reward replica)
    plan.reward_gpus     # the same as worker_gpus
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from reprorl.errors import ConfigError

RAY_GPU_RESOLUTION = 1e-4


def resolve_device(device: str) -> str:
    """"auto" -> "cuda" when torch sees a GPU, else "cpu"; "cpu" stays, "cuda" must exist."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("resources.device=cuda: torch sees no CUDA GPU here; use auto or cpu")
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"resources.device={device!r}: expected auto, cpu or cuda")
    return device


@dataclass(frozen=True)
class Placement:
    """The resolved device and each part's Ray GPU share (0 on the CPU)."""

    device: str
    worker_gpus: float
    """Each process of the actor, reference and critic groups."""
    rollout_gpus: float
    """Each rollout replica."""
    reward_gpus: float = 0.0
    """Each reward-model replica (built-in backend or vLLM)."""


def _floor_share(total: float, parts: int) -> float:
    """total / parts rounded down to Ray's resolution (the 1e-9 keeps 0.3 / 3 at 0.1, not 0.0999)."""
    if not parts:
        return 0.0
    return round(math.floor(total / parts / RAY_GPU_RESOLUTION + 1e-9) * RAY_GPU_RESOLUTION, 4)


def plan_placement(device: str, *, actor_workers: int, ref_workers: int, critic_workers: int,
                   rollout_replicas: int, rollout_share: float, reward_replicas: int = 0) -> Placement:
    """Every part on `device` (resolved); on CUDA, the GPU shares of the module doc.
    `reward_replicas`: the reward-model pool's size (0: no reward model)."""
    device = resolve_device(device)
    if device == "cpu":
        return Placement("cpu", 0.0, 0.0, 0.0)
    if actor_workers > 1:
        # Two NCCL ranks of one group cannot share one GPU; the data-parallel issue spreads them.
        raise ConfigError(f"trainer.num_workers={actor_workers} with resources.device=cuda: one GPU holds one "
                          "worker of each group here; set trainer.num_workers=1")
    trainer_side = _floor_share(1.0 - rollout_share, actor_workers + ref_workers + critic_workers + reward_replicas)
    return Placement("cuda", worker_gpus=trainer_side, rollout_gpus=_floor_share(rollout_share, rollout_replicas),
                     reward_gpus=trainer_side if reward_replicas else 0.0)
