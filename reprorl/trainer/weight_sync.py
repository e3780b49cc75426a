"""Trainer -> rollout replicas: the actor's weights after an update, pushed as a version.

Two paths, chosen per replica by where it runs:
- device (CUDA IPC): a built-in replica on the same physical GPU as the actor's rank 0
  (the one-GPU placement, reprorl/resources/placement.py). Rank 0 packs its weights (the
  model's dtype: the bf16 cast of the float32 master with mixed precision) into one
  buffer per dtype on the GPU and hands each such replica its own IPC share (a small
  object through Ray); the replica copies device to device into its parameters in place
  (its CUDA graphs stay valid) and drops the share; once every replica answered, rank 0
  frees the buffer. No tensor crosses the host.
- host: every other replica (the CPU, another GPU, vLLM): the weights as CPU tensors
  through the driver, one packed buffer per dtype in Ray's object store (`ReplicaPool.update_weights`).

Order with the engines' sleep: a device copy needs the engine's weights on the GPU. When
any replica takes the device path, the engines keep their weights there while the trainer
updates (`ReplicaPool.sleep(keep_weights=True)` frees only the KV cache) rather than
sending them to the host and back. That leaves the update 2 bytes a parameter per replica
less GPU memory (the engine's bf16 weights), against the trainer's own ~20 (bf16 weights
and gradients 2 + 2, float32 master 4, float32 gradient sum 4, AdamW moments 8) plus
activations; and it saves, per replica and step, a device-to-host and a host-to-device
copy of the whole model, the second of weights about to be overwritten anyway.

Versions and checks are the pool's (`check_weight_version`), the same for both paths.
"""

from __future__ import annotations

from reprorl.rollout.replica import ReplicaPool
from reprorl.workers.group import WorkerGroup


def device_replicas(actor: WorkerGroup, pool: ReplicaPool) -> list[int]:
    """Ids of the pool's replicas that can take the actor's weights on the device: the
    built-in ones on the GPU of the actor's rank 0 (none when the actor is on the CPU)."""
    uuid = actor.gpu_uuid()
    if uuid is None:
        return []
    return [i for i, replica_uuid in pool.gpu_uuids().items() if replica_uuid == uuid]


def push_weights(actor: WorkerGroup, pool: ReplicaPool, version: int, on_device: list[int]) -> None:
    """The actor's weights to every replica as `version`: device to device to the replicas
    of `on_device` (`device_replicas`; one that has been replaced since gets the host
    path), through the host to the others. Raises as the pool's pushes do."""
    ids = [i for i in on_device if i in pool.replicas]
    if not ids:
        pool.update_weights(actor.named_weights(), version=version)
        return
    shares = actor.share_weights(len(ids))
    try:
        pool.update_weights_shared(dict(zip(ids, shares)), version, host_weights=actor.named_weights)
    finally:
        actor.release_shared_weights()
