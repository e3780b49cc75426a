"""Where each part of a run goes: `resources.device` resolved, each process's GPU and its Ray GPU share.

The trainer's groups (actor, reference, critic) have `trainer.num_workers` ranks, one rank
of each group on each of the run's first `num_workers` GPUs (rank r on GPU r). The
rollout replicas either share those GPUs (`resources.rollout_gpus=0`, colocated: an
engine sleeps while the trainer updates, as on one GPU) or have `resources.rollout_gpus`
GPUs of their own after them; either way replica i goes to the i-th of its GPUs modulo
their count. The reward-model replicas go with the trainer's ranks (like the reference,
a frozen model that runs between rollouts), replica j on GPU j modulo num_workers.

Shares, per GPU (Ray fractions place processes; they do not cap memory): colocated, the
rollout replicas of a GPU take `resources.gpu_share_rollout` of it together and the
trainer's processes on it (one rank of each group, its reward replicas) split the rest;
on a GPU of its own, a side takes the whole GPU. Each share is the busiest GPU's split,
rounded DOWN to Ray's resolution (1e-4), so no GPU is ever asked for more than it has.

    plan = plan_placement("cuda", actor_workers=1, ref_workers=1, critic_workers=0,
                          reward_replicas=1, rollout_replicas=2, rollout_share=0.3)
    plan.rollout         # (Slot(gpu=0, share=0.15), Slot(gpu=0, share=0.15))
    plan.actor           # (Slot(gpu=0, share=0.2333),): 0.7 over actor, reference, reward replica

`plan_run(cfg, lora=..., device=resolve_device(cfg.resources.device))` plans a run's
parts; on the CPU every slot is `CPU_SLOT` (no GPU, share 0).

A run on several GPUs reserves them in one Ray placement group, one bundle a GPU
(`reserve_gpus`), and pins each process to its GPU's bundle (`ray_options`); a cluster with
fewer GPUs than the plan is a one-line error naming the keys. One GPU takes no placement
group: its parts ask Ray for their fractions, as they always have.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from reprorl.algos.registry import estimator
from reprorl.errors import ConfigError

RAY_GPU_RESOLUTION = 1e-4
RESERVE_TIMEOUT_S = 60.0
"""How long Ray may take to reserve the GPUs of a placement group that the cluster has."""


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
class Slot:
    """Where one process goes."""

    gpu: int | None
    """Its GPU's index among the run's GPUs (its bundle in the run's placement group); None on the CPU."""
    share: float
    """Its Ray GPU fraction (0 on the CPU)."""


CPU_SLOT = Slot(None, 0.0)


@dataclass(frozen=True)
class Placement:
    """The resolved device, the number of GPUs the run takes, and each process's `Slot`:
    one per rank of each trainer group, one per replica of each pool (empty: no such part)."""

    device: str
    num_gpus: int
    actor: tuple[Slot, ...]
    ref: tuple[Slot, ...] = ()
    critic: tuple[Slot, ...] = ()
    reward: tuple[Slot, ...] = ()
    rollout: tuple[Slot, ...] = ()

    def parts_on(self, gpu: int) -> dict[str, int]:
        """How many processes of each part GPU `gpu` holds, e.g. {"actor": 1, "rollout": 2}."""
        counts = {part: sum(s.gpu == gpu for s in getattr(self, part))
                  for part in ("actor", "ref", "critic", "reward", "rollout")}
        return {part: n for part, n in counts.items() if n}

    def summary(self) -> dict[str, Any]:
        """The plan for the determinism report: the device, the GPU count and, on a GPU, each
        GPU's parts and each part's share."""
        out: dict[str, Any] = {"device": self.device, "num_gpus": self.num_gpus}
        if self.device == "cuda":
            out["gpus"] = {gpu: self.parts_on(gpu) for gpu in range(self.num_gpus)}
            out["shares"] = {part: getattr(self, part)[0].share for part in ("actor", "ref", "critic", "reward",
                                                                              "rollout") if getattr(self, part)}
        return out


def _floor_share(total: float, parts: int) -> float:
    """total / parts rounded down to Ray's resolution (the 1e-9 keeps 0.3 / 3 at 0.1, not 0.0999)."""
    if not parts:
        return 0.0
    return round(math.floor(total / parts / RAY_GPU_RESOLUTION + 1e-9) * RAY_GPU_RESOLUTION, 4)


def uses_kl(actor: Any, algorithm: Any) -> bool:
    """A KL term (in the loss or the reward) needs the reference policy's log-probs."""
    return actor.use_kl_loss or algorithm.use_kl_in_reward


def plan_run(cfg: Any, *, lora: bool, device: str) -> Placement:
    """The placement of run `cfg` on `device` ("cpu" or "cuda", resolved: `resolve_device`),
    for the groups and pools it has: a reference group only for a KL term and not with LoRA
    (`lora`: the actor then gives the reference log-probs, adapters off), a critic for GAE,
    a reward-model pool with `reward.model_path`."""
    workers = cfg.trainer.num_workers
    return plan_placement(
        device, actor_workers=workers, ref_workers=workers if uses_kl(cfg.actor, cfg.algorithm) and not lora else 0,
        critic_workers=workers if estimator(cfg.algorithm.adv_estimator).needs_critic else 0,
        rollout_replicas=cfg.rollout.num_replicas, rollout_share=cfg.resources.gpu_share_rollout,
        reward_replicas=cfg.reward.num_replicas if cfg.reward.model_path is not None else 0,
        rollout_gpus=cfg.resources.rollout_gpus,
    )


def plan_placement(device: str, *, actor_workers: int, ref_workers: int, critic_workers: int,
                   rollout_replicas: int, rollout_share: float, reward_replicas: int = 0,
                   rollout_gpus: int = 0) -> Placement:
    """Every part on `device` ("cpu" or "cuda", resolved: `resolve_device`); on CUDA, the
    GPUs and shares of the module doc. `ref_workers`, `critic_workers`: the group's ranks
    (0: no such group); `reward_replicas`: the reward-model pool's size (0: no reward
    model); `rollout_gpus`: GPUs of the rollout replicas' own (0: they share the trainer's)."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"plan_placement: device={device!r}; expected 'cpu' or 'cuda' (resolve_device)")
    if device == "cpu":
        return Placement("cpu", 0, (CPU_SLOT,) * actor_workers, (CPU_SLOT,) * ref_workers,
                         (CPU_SLOT,) * critic_workers, (CPU_SLOT,) * reward_replicas, (CPU_SLOT,) * rollout_replicas)
    for key, n in (("ref", ref_workers), ("critic", critic_workers)):
        if n not in (0, actor_workers):  # one rank of each group a GPU: the groups are the same size
            raise ValueError(f"plan_placement: {key}_workers={n}; expected 0 or actor_workers={actor_workers}")
    if rollout_gpus > rollout_replicas:
        raise ConfigError(f"resources.rollout_gpus={rollout_gpus} with rollout.num_replicas={rollout_replicas}: "
                          "a rollout GPU would hold no replica; expected num_replicas >= rollout_gpus")
    trainer_gpus = actor_workers
    if rollout_gpus:  # each side on GPUs of its own
        trainer_side, first_rollout_gpu, replica_gpus, rollout_side = 1.0, trainer_gpus, rollout_gpus, 1.0
    else:  # colocated: the replicas on the trainer's GPUs
        trainer_side, first_rollout_gpu, replica_gpus, rollout_side = 1.0 - rollout_share, 0, trainer_gpus, rollout_share
    groups = sum(n > 0 for n in (actor_workers, ref_workers, critic_workers))
    share = _floor_share(trainer_side, groups + math.ceil(reward_replicas / trainer_gpus))
    replica_share = _floor_share(rollout_side, math.ceil(rollout_replicas / replica_gpus))

    def ranks(n: int) -> tuple[Slot, ...]:
        return tuple(Slot(rank, share) for rank in range(n))

    return Placement(
        "cuda", trainer_gpus + rollout_gpus, ranks(actor_workers), ranks(ref_workers), ranks(critic_workers),
        reward=tuple(Slot(j % trainer_gpus, share) for j in range(reward_replicas)),
        rollout=tuple(Slot(first_rollout_gpu + i % replica_gpus, replica_share) for i in range(rollout_replicas)),
    )


# ------------------------------------------------------------------------------ on Ray


def check_cluster_gpus(placement: Placement, cluster_gpus: float) -> None:
    """A one-line error naming the keys when the plan takes more GPUs than the cluster has."""
    if placement.num_gpus > cluster_gpus:
        ranks = len(placement.actor)
        own = placement.num_gpus - ranks
        need = f"trainer.num_workers={ranks}" + (f" + resources.rollout_gpus={own}" if own else "")
        raise ConfigError(f"{need}: the run takes {placement.num_gpus} GPUs (one per trainer rank"
                          f"{', and the rollout GPUs' if own else ''}) and the Ray cluster has {cluster_gpus:g}; "
                          "set fewer workers or rollout GPUs")


def reserve_gpus(placement: Placement) -> Any:
    """The run's placement group (one {"GPU": 1} bundle per GPU of the plan, packed on as few
    nodes as Ray can), reserved; None for a run on the CPU or on one GPU. Ray must be up."""
    if placement.device != "cuda" or placement.num_gpus == 1:
        return None
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    check_cluster_gpus(placement, ray.cluster_resources().get("GPU", 0.0))
    group = placement_group([{"GPU": 1}] * placement.num_gpus, strategy="PACK")
    if not group.wait(timeout_seconds=RESERVE_TIMEOUT_S):
        remove_placement_group(group)
        raise ConfigError(f"Ray could not reserve {placement.num_gpus} whole GPUs within {RESERVE_TIMEOUT_S:g} s "
                          "(others in use?): trainer.num_workers, resources.rollout_gpus")
    return group


def ray_options(slot: Slot, group: Any) -> Mapping[str, Any]:
    """The Ray actor options that put a process in `slot`: its GPU share and, with a
    placement group (`reserve_gpus`), the bundle of its GPU."""
    options: dict[str, Any] = {"num_gpus": slot.share}
    if group is not None and slot.gpu is not None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=slot.gpu)
    return options
