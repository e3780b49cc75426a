"""One rank of a worker group: a process (Ray actor) that holds a whole model for its
forward passes and, when trainable, its shard of the gradient, master weights and AdamW
moments (the layout and the reductions: flat.py). With `shard_params` a rank holds its
shard of the weights alone (a frozen group's: of every weight, in the flat layout of them
all) and gathers a decoder layer's when it runs (units.py; the same bits): every rank then
makes every pass's collectives, the rank with fewer micro-batches without computing, and
every rank takes part in reading the weights.

The master shard is float32 whatever the model's dtype (`MASTER_DTYPE`): with a bf16
model that is mixed precision, the model's weights being the bf16 cast of the master after
every step. `device="cuda"`: the model runs on the GPU Ray gave the process (the group's
collectives then use NCCL), and `gradient_checkpointing` recomputes each decoder layer in
the backward pass, and `gpu_gradient_vectors` = k >= 1 keeps the gradient tree's bigger
pending sums in pinned host memory (grad_tree.py: at most k whole float32 gradient vectors
on the device, whatever the micro-batch count; 0: all on the device).

With `optimizer_offload` the master shard, the AdamW moments and the gradient tree's sums
live in host memory and the step runs on the host's cores (offload.py: the same bits).

The rank loads its model and owns it and the optimizer: the one training loop of reprorl
(`update`). The math it runs on a micro-batch is policy.py's and critic.py's plain
functions (log-probs, values, losses). Every rank runs torch with WORKER_THREADS threads:
a gradient's bits can depend on the thread count, and the rank that computes a micro-batch
must not matter.

With LoRA (`lora`: models/lora.py) only the adapters are trainable: the flat layout, the
shard, the checkpoints and the weight pushes hold them alone, the base staying frozen in
the model's dtype; `compute_log_probs(base=True)` gives the reference policy's log-probs
with the adapters switched off.

Weights for the rollout replicas come from any rank's model (the group asks rank 0):
`named_weights` as CPU tensors (the host path), or `share_weights`, one buffer per dtype
on the GPU handed out through CUDA IPC to replicas on the same GPU and freed by
`release_shared_weights`; both carry every weight, or the adapters alone with LoRA (or,
with `push_merged_lora`, for vLLM's replicas, every base weight with the adapters merged).
`weight_digests` gives the fingerprint's digests of every weight (the frozen base too).

A rank's shard on disk (`save_shard`): `shard_<rank>.pt` with the real elements of its
range of the flat vector (`start`, `end`), the master weights and the AdamW state; any
number of ranks reads a set of them back (`load_shards`), each taking the elements of its
own range, so a run saved with N workers resumes with M.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import socket
from datetime import timedelta
from pathlib import Path
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from reprorl.determinism import ENV_SEED, check_worker_env, enable_full_determinism, is_full_determinism
from reprorl.determinism_report import model_part_info
from reprorl.fingerprint import tensor_digests
from reprorl.io import atomic_write
from reprorl.models.lora import LoraSpec, merged_parameters
from reprorl.protocol import Batch, tensor_to
from reprorl.actors.weights import PackedWeights, SharedWeights, gpu_uuid, share
from reprorl.workers import critic, policy
from reprorl.workers.flat import (
    EMPTY_GRADIENT,
    FlatLayout,
    all_gather_shards,
    bind_params,
    first_failure,
    fixed_order_reduce_scatter,
    global_grad_norm,
    rank_block,
    tree_leaves,
)
from reprorl.workers.grad_tree import GradTree, Parts
from reprorl.workers.offload import HostVectors, host_threads, publish_from_host
from reprorl.workers.units import Exchange, ShardedParams
from reprorl.workers.micro_batches import Rows, micro_batch_rows, rows_tensor, take
from reprorl.workers.optim import LRSchedule, NonFiniteError, OptimArgs, make_adamw, set_lr, step_in_chunks
from reprorl.workers.policy import mini_batch_norms, read_stats, trim_padding

WORKER_THREADS = 1
MASTER_DTYPE = torch.float32
"""Master weights, gradient sums and AdamW state of a trainable rank: float32 even when the
model computes in bfloat16 (`model.dtype`), so small updates are not rounded away."""
ROLES = ("actor", "ref", "critic")
# A collective that waits this long for a peer has lost it (the group's driver notices a
# dead worker sooner, from Ray).
COLLECTIVE_TIMEOUT = timedelta(minutes=30)


class ShardWorker:
    """Rank `rank` of `world_size` in the `role` group ("actor", "ref" or "critic").

    Create with `ray.remote(ShardWorker)` (as `WorkerGroup` does), then `join` the group's
    process group at the address rank 0 gives (`address`). `expected_env` is the run's
    determinism environment, checked first.
    """

    def __init__(self, role: str, rank: int, world_size: int, model_path: str, *, optim: OptimArgs | None,
                 dtype: str | None, batch_invariant: bool, seed: int, expected_env: dict[str, str],
                 device: str = "cpu", gradient_checkpointing: bool = False, gpu_gradient_vectors: int = 0,
                 lora: LoraSpec | None = None, shard_params: bool = False, push_merged_lora: bool = False,
                 optimizer_offload: bool = False) -> None:
        self.name = f"{role} worker {rank}"
        check_worker_env(expected_env, where=self.name)
        torch.set_num_threads(WORKER_THREADS)
        if is_full_determinism():
            enable_full_determinism(int(os.environ[ENV_SEED]))
        if role not in ROLES:
            raise ValueError(f"ShardWorker: role {role!r}; expected one of {', '.join(ROLES)}")
        self.role, self.rank, self.world_size = role, rank, world_size
        self.device = torch.device(device)
        self.batch_invariant = batch_invariant
        if role == "critic":
            self.model = critic.load_critic(model_path, seed=seed, dtype=dtype, batch_invariant=batch_invariant,
                                            device=self.device, weights_on_host=shard_params)
            self._loss = critic.micro_batch_loss
        else:
            self.model = policy.load_policy(model_path, trainable=optim is not None, dtype=dtype,
                                            batch_invariant=batch_invariant, device=self.device, lora=lora,
                                            weights_on_host=shard_params)  # `join` moves this rank's range
            self._loss = policy.micro_batch_loss
        self.model.model.gradient_checkpointing = gradient_checkpointing  # the backbone's layer loop
        self.optim_args = optim
        self.trainable = optim is not None
        self.lora = lora
        self.push_merged_lora = push_merged_lora and lora is not None
        if self.push_merged_lora and shard_params:
            raise ValueError(f"{self.name}: push_merged_lora with shard_params; merging needs every weight of a layer "
                             "on one rank")
        self._shared: PackedWeights | None = None  # the buffer behind the last share_weights
        self.gpu_gradient_vectors = gpu_gradient_vectors  # the gradient tree's sums on the device (grad_tree.py)
        self.offload = optimizer_offload and optim is not None  # master, moments and gradient sums on the host
        self.host = torch.device("cpu")
        self.host_vectors = HostVectors(self.device) if self.offload else None  # the gradient tree's, reused
        if self.offload and self.device.type == "cuda" and world_size > 1:
            raise ValueError(f"{self.name}: optimizer_offload on CUDA with {world_size} ranks; offload.py takes one")
        self._grad_sink: GradTree | Exchange | None = None  # what `_fold_grad` feeds, during an update's backward
        self.shard_params = shard_params
        self.at_rest: ShardedParams | None = None  # set by `join` with shard_params (units.py)
        self._grad_hooks: list = []  # the `_fold_grad` hooks' handles (made by `join`), removed by `shutdown`
        self.group: dist.ProcessGroup | None = None  # set by `join`

    def ready(self) -> int:
        return self.rank

    def address(self) -> str:
        """A `tcp://host:port` for the process group (called on rank 0)."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def join(self, address: str | None) -> None:
        """Join the group's process group at `address`, or with None (a group of one rank in
        the caller's process: `WorkerGroup(in_process=True)`) a group of this process alone.
        A trainable rank then lays out its shard."""
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if address is None:
            self.group = process_group_alone(backend)
        else:
            dist.init_process_group(backend, init_method=address, rank=self.rank, world_size=self.world_size,
                                    timeout=COLLECTIVE_TIMEOUT)
            self.group = dist.group.WORLD
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        self.layout = FlatLayout.of(named, self.world_size)
        if not self.trainable:
            if self.shard_params:  # a frozen group (the reference): every weight, no master
                every = list(self.model.named_parameters())
                self.at_rest = ShardedParams(self.model, [p for _, p in every], FlatLayout.of(every, self.world_size),
                                             self.rank, self.group, self.device)
            return
        if self.shard_params:  # each parameter a view of its unit's buffer, gathered when used (units.py)
            self.flat = None
            frozen = [(n, p) for n, p in self.model.named_parameters() if not p.requires_grad]  # LoRA's base
            self.at_rest = ShardedParams(self.model, self.params, self.layout, self.rank, self.group, self.device,
                                         frozen=frozen)
            initial = self.at_rest.local
        else:
            self.flat = bind_params(self.params, self.layout)  # [padded]: the model's parameters are views of it
            initial = self.flat[slice(*self.layout.shard_range(self.rank))]
        # Kept to be removed at shutdown: a hook on a parameter that holds this worker is a
        # cycle through autograd's hook table, which Python's collector cannot see, so the
        # worker (weights, master, AdamW moments) would outlive every reference to it.
        self._grad_hooks = [p.register_post_accumulate_grad_hook(functools.partial(self._fold_grad, index))
                            for index, p in enumerate(self.params)]
        # Master weights of this rank's range, float32 whatever the model computes in (mixed
        # precision with bf16); the model's weights are their cast (`_publish_master`).
        # With `optimizer_offload` they live on the host (offload.py).
        self.shard = torch.nn.Parameter(initial.to(self.host if self.offload else initial.device, MASTER_DTYPE,
                                                   copy=True))
        if self.at_rest is not None:
            self.at_rest.set_local(self.shard)  # with a float32 model, the master itself: no second copy
        self.optimizer = make_adamw([self.shard], self.optim_args)
        args = self.optim_args
        self.schedule = LRSchedule(args.lr, args.warmup_steps, args.total_steps, args.lr_schedule)

    # ---------------------------------------------------------------- forward passes

    def _my_micro_batches(self, batch: Batch, micro_batch_size: int,
                          max_token_len: int | None) -> tuple[list[Rows], int]:
        """This rank's contiguous block of the batch's micro-batches (`micro_batch_rows`: cut
        without regard to the worker count), and the most any rank's block holds."""
        micros = micro_batch_rows(batch, micro_batch_size, max_token_len)
        start, end = rank_block(len(micros), self.rank, self.world_size)
        return micros[start:end], rank_block(len(micros), 0, self.world_size)[1]

    @contextlib.contextmanager
    def _forward_passes(self, made: int, most: int) -> Iterator[None]:
        """Around a call's forward passes (this rank makes `made`, the busiest `most`): with
        parameters sharded at rest, the root unit gathered, and afterwards the collectives of
        the passes this rank lacks (units.py: every rank makes every gather)."""
        if self.at_rest is None:
            yield
            return
        with self.at_rest.root_gathered(), _reset_on_error(self.at_rest):
            yield
            for _ in range(most - made):
                self.at_rest.replay_forward()

    def _micro_on_device(self, batch: Batch, rows: Rows) -> Batch:
        """The micro-batch `rows` of `batch` (on the host), trimmed there (`trim_padding`) and
        then copied to this worker's device without waiting for its queue: on a GPU, reading
        the mask there, or a plain copy from pageable memory, would stop the host from
        queueing kernels ahead of the GPU (8 to 14 waits a micro-batch before: H200 profile)."""
        return trim_padding(take(batch, rows)).to(self.device, non_blocking=True)

    def compute_log_probs(self, batch: Batch, *, temperature: float, micro_batch_size: int,
                          max_token_len: int | None = None, with_entropy: bool = False, base: bool = False) -> Any:
        """(rows, `policy.micro_batch_log_probs` of this rank's micro-batches, joined):
        the outputs' row k is sample rows[k]'s. None: it has none. `base`: with the LoRA
        adapters off (the reference policy)."""
        mine, most = self._my_micro_batches(batch, micro_batch_size, max_token_len)
        with self._forward_passes(len(mine), most):
            parts = policy.micro_batch_log_probs(
                self.model, (self._micro_on_device(batch, rows) for rows in mine), temperature=temperature,
                with_entropy=with_entropy, base=base)
        if not mine:
            return None
        if with_entropy:
            return rows_tensor(mine), (torch.cat([p[0] for p in parts]).cpu(), torch.cat([p[1] for p in parts]).cpu())
        return rows_tensor(mine), torch.cat(parts).cpu()

    def compute_values(self, batch: Batch, *, micro_batch_size: int,
                       max_token_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows, `critic.micro_batch_values` of this rank's micro-batches, joined), as
        `compute_log_probs`. None: it has none."""
        mine, most = self._my_micro_batches(batch, micro_batch_size, max_token_len)
        with self._forward_passes(len(mine), most):
            parts = critic.micro_batch_values(self.model, (self._micro_on_device(batch, rows) for rows in mine))
        if not mine:
            return None
        return rows_tensor(mine), torch.cat(parts).cpu()

    # ---------------------------------------------------------------- training

    def update(self, batch: Batch, *, ppo_epochs: int, mini_batch_size: int, micro_batch_size: int,
               max_response_length: int | None = None, max_token_len: int | None = None,
               **loss: Any) -> dict[str, Any]:
        """One training step: per mini-batch (sample order), this rank's micro-batches'
        stats by micro-batch index and the (global) gradient norm; and the step's lr.
        `max_token_len`: micro-batches by token budget (workers/micro_batches.py), else of
        `micro_batch_size` samples. `loss` goes to the role's `micro_batch_loss` (actor:
        `loss=PolicyLossArgs`, `temperature`: policy.py; critic: `cliprange_value`,
        `loss_agg_mode`: critic.py); its stats come back named `<role>/<stat>`."""
        if not self.trainable:
            raise RuntimeError(f"update: the {self.role} group is frozen (built without optim)")
        lr = self.schedule.lr()
        set_lr(self.optimizer, lr)
        steps = []
        for epoch in range(ppo_epochs):
            for m, mini in enumerate(batch.split(mini_batch_size)):
                # Updates count from 1, as the trainer's steps.
                where = f"{self.role} update {self.schedule.step + 1} (epoch {epoch}, mini-batch {m})"
                micros = micro_batch_rows(mini, micro_batch_size, max_token_len)
                leaves = tree_leaves(len(micros), self.world_size)  # laid out to fit any N (flat.py)
                steps.append(self._step(mini, micros, leaves, max_response_length, loss, where))
        self.schedule.step += 1
        return {"lr": lr, "steps": steps}

    def _step(self, mini: Batch, micros: list[Rows], leaves: list[int | None], max_response_length: int | None,
              loss: dict[str, Any], where: str) -> dict[str, Any]:
        """One optimizer step on one mini-batch: `micros` its micro-batches' rows, `leaves`
        the gradient tree's leaves (micro-batch index, None: empty). flat.py says why the
        bits do not depend on N."""
        per_rank = len(leaves) // self.world_size
        if self.host_vectors is not None:
            self.host_vectors.reset()  # the last step's sums are spent
        norms = {k: tensor_to(v, self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                 for k, v in mini_batch_norms(mini, max_response_length).items()}
        stats: dict[int, dict[str, torch.Tensor]] = {}
        losses: dict[int, torch.Tensor] = {}
        if self.at_rest is None:
            block_sum = self._block_gradient(mini, micros, leaves[self.rank * per_rank : (self.rank + 1) * per_rank],
                                             self.rank * per_rank, norms, loss, stats, losses)
        else:
            grad = self._round_gradient(mini, micros, leaves, norms, loss, stats, losses)
        order = sorted(stats)
        read = read_stats([{"loss": losses[k], **stats[k]} for k in order])  # one read of the device
        bad = [(k, r["loss"]) for k, r in zip(order, read) if not math.isfinite(r["loss"])]
        failure = first_failure(bad[0] if bad else None, self.group, self.device)
        if failure is not None:
            raise NonFiniteError(f"{where}, micro-batch {failure[0]}: loss is {failure[1]}; optimizer not stepped")

        if self.at_rest is None:
            if block_sum is None:  # every leaf of this rank's block is empty
                block_sum = torch.full((self.layout.padded,), EMPTY_GRADIENT, dtype=MASTER_DTYPE,
                                       device=self.shard.device)
            grad = fixed_order_reduce_scatter(block_sum, self.layout, self.group)  # [shard_size]
            del block_sum
        with host_threads(self.offload):  # the host's kernels on all its cores (offload.py)
            grad_norm = global_grad_norm(grad, self.layout, self.group, self.device)
            if not math.isfinite(grad_norm):
                raise NonFiniteError(f"{where}: gradient norm is {grad_norm}; optimizer not stepped")
            clip = self.optim_args.grad_clip
            scale = clip / (grad_norm + 1e-6) if grad_norm > clip else 1.0  # as torch's clip_grad_norm_
            self.shard.grad = grad
            step_in_chunks(self.optimizer, self.shard, grad_scale=scale)  # AdamW a chunk at a time (optim.py)
            self.shard.grad = None
            del grad
            self._publish_master()
        return {"stats": [(k, {f"{self.role}/{key}": v for key, v in r.items() if key != "loss"})
                          for k, r in zip(order, read)],
                "grad_norm": grad_norm}

    def _block_gradient(self, mini: Batch, micros: list[Rows], block: list[int | None], first: int,
                        norms: dict[str, Any], loss: dict[str, Any], stats: dict[int, dict[str, torch.Tensor]],
                        losses: dict[int, torch.Tensor]) -> torch.Tensor | None:
        """The sum of this rank's `block` of leaves (leaf indices from `first`) in flat.py's
        tree, `[padded]` float32 (None: every leaf empty). Each parameter's gradient goes into
        a `GradTree` as the backward pass finishes it (`_fold_grad`): grad_tree.py says why the
        bits are `tree_reduce`'s, and how few whole gradient vectors it keeps. Fills `stats`
        and `losses` (the loss tensors, read later) by micro-batch index."""
        tree = GradTree(first, first + len(block), Parts.of(self.layout), self.device,
                        gpu_vectors=self.gpu_gradient_vectors, host_sums=self.offload,
                        host_vectors=self.host_vectors)
        for k in block:
            tree.start_leaf(empty=k is None)
            if k is not None:
                self._backward(mini, micros[k], k, tree, norms, loss, stats, losses)
            tree.finish_leaf()
        return tree.result()

    def _round_gradient(self, mini: Batch, micros: list[Rows], leaves: list[int | None], norms: dict[str, Any],
                        loss: dict[str, Any], stats: dict[int, dict[str, torch.Tensor]],
                        losses: dict[int, torch.Tensor]) -> torch.Tensor:
        """With parameters sharded at rest: this rank's shard of the mini-batch's gradient,
        `[shard_size]` float32, the leaves dealt by stride, a round of N at a time, each
        unit's gradient sent to its owners as the backward pass finishes it (units.py says
        why the bits are `_block_gradient`'s and the reduction's). Fills `stats` and `losses`."""
        at_rest, n = self.at_rest, self.world_size
        tree = GradTree(0, len(leaves) // n, at_rest.parts, self.device, gpu_vectors=self.gpu_gradient_vectors,
                        host_sums=self.offload, host_vectors=self.host_vectors)
        with at_rest.root_gathered(), _reset_on_error(at_rest):
            for j in range(len(leaves) // n):
                round_leaves = leaves[j * n : (j + 1) * n]
                empty = all(k is None for k in round_leaves)
                tree.start_leaf(empty)
                if not empty:
                    k = round_leaves[self.rank]
                    at_rest.exchange = Exchange(at_rest, tree, computing=k is not None)
                    if k is None:
                        at_rest.replay_forward()
                        at_rest.replay_backward()
                    else:
                        self._backward(mini, micros[k], k, at_rest.exchange, norms, loss, stats, losses)
                    at_rest.end_backward()
                    at_rest.exchange = None
                tree.finish_leaf()
        return tree.result()

    def _backward(self, mini: Batch, rows: Rows, k: int, sink: GradTree | Exchange, norms: dict[str, Any],
                  loss: dict[str, Any], stats: dict[int, dict[str, torch.Tensor]],
                  losses: dict[int, torch.Tensor]) -> None:
        """Micro-batch `k`'s (`rows` of `mini`) loss and backward pass, each parameter's
        gradient going to `sink` as it is finished (`_fold_grad`)."""
        for p in self.params:  # a .grad left by anything else would be added to this leaf's
            p.grad = None
        total, stats[k] = self._loss(self.model, self._micro_on_device(mini, rows), norms, **loss)
        losses[k] = total.detach()  # checked once the gradient is summed: no read of the device per micro-batch
        self._grad_sink = sink
        try:
            total.backward()
        finally:
            self._grad_sink = None

    def _fold_grad(self, index: int, param: torch.nn.Parameter) -> None:
        """Parameter `index`'s gradient, final once the backward pass has accumulated it, into
        the update's gradient sum, then freed (outside an update, `.grad` stays as usual)."""
        if self._grad_sink is not None:
            self._grad_sink.add(index, param.grad)
            param.grad = None

    # ---------------------------------------------------------------- weights and state

    def layout_json(self) -> dict[str, Any]:
        return self.layout.to_json()

    def pushed_weights(self) -> list[tuple[str, torch.Tensor]]:
        """The weights the replicas take after an update: every one, or with LoRA the
        adapters alone (the built-in replicas made the same frozen base), or with
        `push_merged_lora` every base weight with the adapters merged in (vLLM serves the
        plain model)."""
        if self.push_merged_lora:
            return merged_parameters(self.model)
        named = self.model.named_parameters()
        return [(n, p) for n, p in named if p.requires_grad] if self.lora is not None else list(named)

    def named_weights(self) -> list[tuple[str, torch.Tensor]] | None:
        """(HF name, CPU tensor) of every weight the replicas take (`pushed_weights`): the same
        on every rank, so the group asks rank 0. With parameters sharded at rest every rank
        must call it (the units are gathered one after another) and rank 0 alone answers (the
        others: None)."""
        taken = self._by_unit(self.pushed_weights(), lambda named: {n: p.detach().cpu().clone() for n, p in named})
        return None if taken is None else list(taken.items())

    def weight_digests(self) -> dict[str, str] | None:
        """`tensor_digest` of every weight, by HF name, in `named_weights` order: the step's
        fingerprint "params" without shipping the model (the same bits as hashing
        `named_weights`). Called as `named_weights`."""
        named = list(self.model.named_parameters())
        if self.at_rest is None:
            return tensor_digests(named)
        # A copy of each gathered unit: numpy's view of a storage (the digest's) makes it unresizable.
        return self._by_unit(named, lambda unit: tensor_digests((n, p.detach().clone()) for n, p in unit))

    def _by_unit(self, named: list[tuple[str, torch.Tensor]],
                 take: Callable[[list[tuple[str, torch.Tensor]]], dict[str, Any]]) -> dict[str, Any] | None:
        """`take` (named tensors -> {name: value}) of `named`, joined in its order. With
        parameters sharded at rest `take` sees a unit's weights of `named` while they are
        gathered, a unit at a time (with LoRA the adapters without their base when `named`
        has no base weight); ranks other than 0 only take part in the gathers (None)."""
        if self.at_rest is None:
            return take(named)
        by_place: dict[tuple[int, int], list[tuple[str, torch.Tensor]]] = {}
        for name, p in named:  # the same names on every rank, so the same gathers
            by_place.setdefault(self.at_rest.place_of(name), []).append((name, p))
        taken: dict[str, Any] = {}
        for unit in range(len(self.at_rest.plan.members)):
            sets = [s for s in range(len(self.at_rest.sets)) if (s, unit) in by_place]
            if not sets:
                continue
            with self.at_rest.reading(unit, sets):
                if self.rank == 0:
                    taken.update(take([item for s in sets for item in by_place[(s, unit)]]))
        return {name: taken[name] for name, _ in named} if self.rank == 0 else None

    def gpu_uuid(self) -> str | None:
        """The UUID of this rank's GPU (None on the CPU): replicas on it can take `share_weights`."""
        return gpu_uuid(self.device) if self.device.type == "cuda" else None

    def share_weights(self, consumers: int) -> list[SharedWeights]:
        """Every weight (the model's dtype: the bf16 cast of the master with mixed precision,
        as `_publish_master` wrote it) packed into one buffer per dtype on this GPU, and one
        CUDA IPC share of it per consumer (reprorl/actors/weights.py says why one each).
        The buffer is kept until `release_shared_weights`: call that once every consumer is done."""
        if self.device.type != "cuda":
            raise RuntimeError(f"share_weights: {self.name} runs on {self.device}; CUDA IPC needs a GPU")
        self.release_shared_weights()  # an earlier push that was never released
        pushed = self.pushed_weights()
        packed = PackedWeights.empty(pushed, device=self.device) if self.rank == 0 else None

        def write(named: list[tuple[str, torch.Tensor]]) -> dict[str, None]:
            packed.write(named)
            return dict.fromkeys(name for name, _ in named)

        # Sharded at rest: every rank takes part in the gathers, a unit at a time (`named_weights`).
        self._by_unit(pushed, write)
        if packed is None:
            return []
        self._shared = packed
        return share(self._shared, consumers)

    def release_shared_weights(self) -> None:
        """Free the buffer of `share_weights` (its consumers have dropped their shares) and
        give the memory back to the GPU: the engines size their KV cache from what is free."""
        if self._shared is None:
            return
        self._shared = None
        torch.cuda.ipc_collect()  # blocks whose consumers let go after we did (limbo) are freed now
        torch.cuda.empty_cache()

    def save_shard(self, directory: str) -> None:
        """Write this rank's `shard_<rank>.pt` into `directory` (durably: `atomic_write`)."""
        start, end = self.layout.shard_range(self.rank)
        real_end = max(start, min(end, self.layout.numel))
        keep = real_end - start
        state = self.optimizer.state.get(self.shard, {})
        shard = {"start": start, "end": real_end, "param": self.shard.detach()[:keep].cpu().clone(),
                 "schedule": self.schedule.state_dict()}
        if state:
            shard["adam"] = {"step": state["step"].cpu().clone(), "exp_avg": state["exp_avg"][:keep].cpu().clone(),
                             "exp_avg_sq": state["exp_avg_sq"][:keep].cpu().clone()}
        with atomic_write(Path(directory) / f"shard_{self.rank}.pt") as tmp:
            torch.save(shard, tmp)

    def load_shards(self, directory: str, num_shards: int) -> None:
        """Take this rank's range from the `num_shards` shard files in `directory` (any
        count), reading only the files that overlap it (and file 0: the schedule, the step)."""
        start, end = self.layout.shard_range(self.rank)
        saved_layout = dataclasses.replace(self.layout, world_size=num_shards)
        param = torch.zeros_like(self.shard.detach())
        moments = {"exp_avg": torch.zeros_like(param), "exp_avg_sq": torch.zeros_like(param)}
        step, schedule = None, None
        for i in range(num_shards):
            saved_start, saved_end = saved_layout.shard_range(i)
            if i > 0 and (saved_end <= start or saved_start >= end):
                continue
            saved = torch.load(Path(directory) / f"shard_{i}.pt", map_location="cpu", weights_only=True)
            schedule = saved["schedule"]
            lo, hi = max(start, saved["start"]), min(end, saved["end"])
            if "adam" in saved:
                step = saved["adam"]["step"]
            if lo >= hi:
                continue
            src = slice(lo - saved["start"], hi - saved["start"])
            param[lo - start : hi - start] = saved["param"][src]
            for key, t in moments.items():
                if "adam" in saved:
                    t[lo - start : hi - start] = saved["adam"][key][src]
        with torch.no_grad():
            self.shard.copy_(param)
        self.optimizer.state.clear()
        if step is not None:
            self.optimizer.state[self.shard] = {"step": step.clone(), **{k: t.to(self.shard.device)
                                                                          for k, t in moments.items()}}
        self.schedule.load_state_dict(schedule)
        self._publish_master()

    def _publish_master(self) -> None:
        """Every rank's master shard, cast to the model's dtype, into the whole model (`flat`);
        with parameters sharded at rest, into this rank's range alone (gathered when used)."""
        if self.at_rest is not None:
            self.at_rest.set_local(self.shard)
            return
        if self.offload:
            publish_from_host(self.shard.detach(), self.flat, self.layout, self.rank, self.group)
            return
        all_gather_shards(self.shard.detach().to(self.flat.dtype), self.flat, self.layout, self.group)

    def determinism_info(self) -> dict[str, Any]:
        """This rank's mode for the determinism report: the model part's keys plus its place."""
        model = self.model
        info = model_part_info(backend="torch", batch_invariant=self.batch_invariant,
                               dtype=next(model.parameters()).dtype, kernels=model.kernels.name, device=self.device)
        info.update(rank=self.rank, world_size=self.world_size, device=str(self.device),
                    dist_backend=dist.get_backend(self.group) if dist.is_initialized() else None)
        return info

    def shutdown(self) -> None:
        """Leave the process group (a Ray rank's is its process's default group: all of it),
        and drop the gradient hooks, so that a rank in the caller's process is freed with it."""
        for handle in self._grad_hooks:
            handle.remove()
        self._grad_hooks = []
        if self.host_vectors is not None:
            self.host_vectors.release()
        if self.at_rest is not None:
            self.at_rest.remove_hooks()
        if self.group is not None and dist.is_initialized():
            dist.destroy_process_group(self.group)
        self.group = None


@contextlib.contextmanager
def _reset_on_error(at_rest: ShardedParams) -> Iterator[None]:
    """On an error inside the block, `at_rest.reset()` (its units freed, no pass under way)."""
    try:
        yield
    except BaseException:
        at_rest.reset()
        raise


def process_group_alone(backend: str) -> dist.ProcessGroup:
    """A new process group of this process alone, for a rank in the caller's process. Each
    such rank gets its own (an actor and its reference in one test), under one default group
    of world size 1 made here the first time (on a `HashStore`: no port, no peer)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    elif dist.get_world_size() != 1:
        raise RuntimeError("a rank in the caller's process needs a process of its own: this one is in a "
                           f"process group of {dist.get_world_size()}")
    return dist.new_group([0], backend=backend)
