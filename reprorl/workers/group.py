"""A worker group: the actor, reference or critic as `num_workers` Ray actor processes.

The fit loop reaches a model only through this class: log-probs, values, update, the
weights for the rollout replicas (on the host, or shared on the GPU: worker.py) and their
digests, checkpoints and determinism info. One worker is the same code path as eight
(one rank, a process group of one).

    actor = WorkerGroup("actor", 2, "models/tiny-policy", optim=OptimArgs(lr=1e-5), seed=42,
                        full_determinism=True)
    batch["old_log_probs"] = actor.compute_log_probs(batch, temperature=1.0, micro_batch_size=4)
    metrics = actor.update(batch, ppo_epochs=1, mini_batch_size=8, micro_batch_size=4,
                           max_response_length=8, loss=PolicyLossArgs(), temperature=1.0)

The batch goes to Ray's object store once; each rank takes its contiguous block of the
micro-batches (cut in sample order, or by token budget: workers/micro_batches.py, never by
the worker count), and results come back with their rows and are put in sample order, and
metrics are joined in micro-batch order, so a tensor or metric never depends on how many
workers made it. How gradients are
summed: flat.py. Metrics are added up here from every micro-batch's own stats, in
micro-batch order.

`in_process=True` runs the group's one rank in the caller's process instead of a Ray
actor (the tests' way to the training path, without Ray): the same `ShardWorker`, called
directly, in a process group of this process alone. It runs in the caller's environment
(no determinism variables travel or are checked) and sets the process's torch threads to
the rank's `WORKER_THREADS`; a failure raises as it is, and there is no time limit.

Every rank gets the run's determinism variables and `WORKER_ENV` through its runtime_env
(NCCL's in-switch reduction off: it sums in the switch's order). A worker that dies or
fails stops the group: the call raises `WorkerError` naming it, and the group's other
processes are killed (they would wait for it in a collective). So does one that hangs: a
call has `time_limit(part_timeout_s, tokens of its batch)` seconds (reprorl/rollout/
actors/supervision.py); past it the ranks that have not answered are named (a rank that waits in a
collective for a hung peer cannot be told from it), and the run stops, its last checkpoint intact.

Start-up: the constructor asks Ray for the processes and waits until every rank is ready
(loaded, kernels checked, in the process group). With `wait=False` it returns at once and
`wait_ready()` does the waiting, so a trainer starts all its parts together
(reprorl/trainer/parts.py). A start-up that fails, or that Ray has not placed within the
replica pools' `READY_TIMEOUT_S` (a GPU share never free), raises `WorkerError` and leaves
no rank running.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray
import torch

from reprorl.determinism import determinism_env, ray_runtime_env
from reprorl.errors import CheckpointError, ReproRLError
from reprorl.models.lora import LoraSpec
from reprorl.protocol import Batch
from reprorl.actors.supervision import PART_TIMEOUT_S, time_limit
from reprorl.actors.weights import SharedWeights
from reprorl.workers.micro_batches import in_sample_order
from reprorl.workers.optim import OptimArgs
from reprorl.workers.worker import ShardWorker

WORKER_ENV = {"NCCL_NVLS_ENABLE": "0", "OMP_NUM_THREADS": "1"}
# After one rank fails, how long to wait for the others' answers: a rank killed by a
# signal shows up as dead here, while its peers fail in their collective with a vaguer error.
PEER_WAIT_S = 10.0


class WorkerError(ReproRLError, RuntimeError):
    """A worker of a group died or failed; the group is stopped, the run cannot go on."""


class WorkerGroup:
    """`num_workers` ranks of `role` ("actor", "ref" or "critic"); `optim=None`: frozen."""

    def __init__(self, role: str, num_workers: int, model_path: str, *, optim: OptimArgs | None, seed: int,
                 full_determinism: bool, dtype: str | None = None, batch_invariant: bool | None = None,
                 device: str = "cpu", num_gpus: float | None = None, gradient_checkpointing: bool = False,
                 gpu_gradient_vectors: int = 0, wait: bool = True, part_timeout_s: float = PART_TIMEOUT_S,
                 lora: LoraSpec | None = None, in_process: bool = False,
                 scheduling: Sequence[Any] | None = None, shard_params: bool = False,
                 push_merged_lora: bool = False, optimizer_offload: bool = False) -> None:
        """`num_gpus`: Ray's GPU share of each rank (a fraction when parts share one GPU:
        reprorl/resources/placement.py); None = 1 on cuda, 0 on cpu. `wait=False` returns once
        the processes are asked for, before they have started: `wait_ready()` waits.
        `part_timeout_s`: the limit of a call, scaled by its batch's tokens (`time_limit`).
        `lora`: the policy's LoRA adapters (models/lora.py); the group then trains them alone.
        `in_process`: its one rank in this process (module doc). `scheduling`: each rank's Ray
        scheduling strategy (on several GPUs, the bundle of rank r's GPU in the run's placement
        group: reprorl/resources/placement.py); None: Ray's choice. `shard_params`: the
        group's parameters sharded at rest (units.py); every rank then takes part in reading
        its weights. `push_merged_lora`: with `lora`, the replicas take the base weights with
        the adapters merged in (vLLM's replicas serve a plain model), not the adapters.
        `optimizer_offload`: a trainable group's master, moments and gradient sums in host
        memory (offload.py)."""
        if num_workers < 1 or num_workers & (num_workers - 1):
            # The rest of the rule (N divides the micro-batches of a mini-batch) is checked per update.
            raise ValueError(f"WorkerGroup: num_workers={num_workers}; expected a power of two (flat.py says why)")
        if in_process and num_workers != 1:
            raise ValueError(f"WorkerGroup: in_process with num_workers={num_workers}; in one thread, ranks would "
                             "wait for each other in their first collective")
        self.role, self.num_workers, self.in_process = role, num_workers, in_process
        self.part_timeout_s = part_timeout_s
        self.num_gpus = (1 if device == "cuda" else 0) if num_gpus is None else num_gpus
        env = {**determinism_env(seed, full_determinism), **WORKER_ENV}
        options = dict(optim=optim, dtype=dtype, seed=seed, device=device, lora=lora,
                       batch_invariant=full_determinism if batch_invariant is None else batch_invariant,
                       gradient_checkpointing=gradient_checkpointing, gpu_gradient_vectors=gpu_gradient_vectors,
                       shard_params=shard_params, push_merged_lora=push_merged_lora,
                       optimizer_offload=optimizer_offload)
        self.sharded = shard_params
        self.pids: dict[int, int] = {}
        self._starting: list[Any] | None = None  # the ranks' start-up answers, until `wait_ready`
        if in_process:
            self.workers = [ShardWorker(role, 0, 1, str(model_path), expected_env={}, **options)]
            self._join(None)
            return
        if scheduling is not None and len(scheduling) != num_workers:
            raise ValueError(f"WorkerGroup: {len(scheduling)} scheduling strategies for {num_workers} workers")
        remote = ray.remote(ShardWorker)
        ray_options = {"num_cpus": 0, "num_gpus": self.num_gpus, "runtime_env": ray_runtime_env(env)}
        pins = [{} if scheduling is None or scheduling[rank] is None else {"scheduling_strategy": scheduling[rank]}
                for rank in range(num_workers)]
        self.workers = [remote.options(**ray_options, **pins[rank]).remote(role, rank, num_workers, str(model_path),
                                                                          expected_env=env, **options)
                        for rank in range(num_workers)]
        self._starting = [w.ready.remote() for w in self.workers]  # answered once each rank has loaded
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Block until every rank has started and joined the group's process group; a rank that
        failed raises `WorkerError` naming it. Done by the constructor unless `wait=False`
        (then call this before any other method); a second call returns at once."""
        if self._starting is None:
            return
        try:
            self._wait_placed(self._starting)
            self._wait(self._starting, "start-up", ranks=list(range(self.num_workers)))
            self._starting = None
            self._join(self._call_one(0, "address"))
        except BaseException:  # a failure (or Ctrl-C) at start-up leaves no rank running
            self._kill()
            raise

    def _join(self, address: str | None) -> None:
        """Every rank into the process group at `address` (None: in process); then the pids and layout."""
        self._call("join", address, what="joining the process group")
        self.pids = {rank: info["pid"] for rank, info in enumerate(self._call("determinism_info"))}
        self.layout = self._call_one(0, "layout_json")

    def _wait_placed(self, starting: list[Any]) -> None:
        """Fail, instead of waiting forever, when Ray has not started every rank within the
        pools' `READY_TIMEOUT_S`: a rank whose GPU share is never free stays pending."""
        from reprorl.actors import pool  # read at each wait, so that a test can shorten it

        _, pending = ray.wait(starting, num_returns=len(starting), timeout=pool.READY_TIMEOUT_S)
        if pending:
            ranks = ", ".join(str(starting.index(ref)) for ref in pending)
            free = ray.available_resources().get("GPU", 0.0)
            raise WorkerError(
                f"{self.role} workers {ranks} of {self.num_workers} not started after {pool.READY_TIMEOUT_S:.0f} s "
                f"(not placed by Ray, or still loading); each asks Ray for {self.num_gpus:g} GPU and {free:g} are "
                "free (trainer.num_workers, or resources.gpu_share_rollout on a shared GPU)"
            )

    # ---------------------------------------------------------------- calls

    def _call_one(self, rank: int, method: str, *args: Any) -> Any:
        if self.in_process:
            return getattr(self.workers[rank], method)(*args)
        return self._wait([getattr(self.workers[rank], method).remote(*args)], method, ranks=[rank])[0]

    def _call(self, method: str, *args: Any, what: str | None = None, tokens: int = 0, **kwargs: Any) -> list[Any]:
        """`method(*args, **kwargs)` on every rank; the answers by rank. `tokens`: the work the
        call carries, which scales its time limit."""
        if self.in_process:
            return [getattr(w, method)(*args, **kwargs) for w in self.workers]
        refs = [getattr(w, method).remote(*args, **kwargs) for w in self.workers]
        return self._wait(refs, what or method, ranks=list(range(self.num_workers)), tokens=tokens)

    def _wait(self, refs: list[Any], what: str, ranks: Sequence[int], tokens: int = 0) -> list[Any]:
        limit = time_limit(self.part_timeout_s, tokens)
        deadline = time.monotonic() + limit
        results: dict[int, Any] = {}
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                self._hung([ranks[refs.index(ref)] for ref in pending], limit, what)
            try:
                results[refs.index(done[0])] = ray.get(done[0])
            except ray.exceptions.RayTaskError as err:
                if isinstance(err.cause, ReproRLError):
                    # The same on every rank (they agree before stepping): the run's error, not a worker's.
                    raise err.cause from None
                self._fail(refs, ranks, refs.index(done[0]), err, what)
            except ray.exceptions.RayActorError as err:
                self._fail(refs, ranks, refs.index(done[0]), err, what)
        return [results[i] for i in range(len(refs))]

    def _put(self, batch: Batch) -> Any:
        """`batch` as the ranks' calls take it: once into Ray's object store (every rank reads
        that copy), or as it is in process."""
        return batch if self.in_process else ray.put(batch)

    def _fail(self, refs: list[Any], ranks: Sequence[int], first: int, err: Exception, what: str) -> None:
        """Name the worker that failed (a dead one before one whose peer vanished), stop the group."""
        failures = {first: err}
        ray.wait(refs, num_returns=len(refs), timeout=PEER_WAIT_S)
        for i, ref in enumerate(refs):
            if i != first:
                try:
                    ray.get(ref, timeout=0)
                except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as other:
                    failures[i] = other
                except ray.exceptions.GetTimeoutError:
                    pass  # still waiting (in a collective, for the one that failed)
        dead = [i for i, e in failures.items() if isinstance(e, ray.exceptions.RayActorError)]
        index = dead[0] if dead else min(failures)
        rank = ranks[index]
        cause = "died" if dead else f"failed: {_first_line(failures[index])}"
        pid = f" (pid {self.pids[rank]})" if rank in self.pids else ""
        self._kill()
        raise WorkerError(f"{self.role} worker {rank}{pid} {cause} during {what}; the {self.role} group is "
                          "stopped") from err

    def _hung(self, ranks: list[int], limit: float, what: str) -> None:
        """Name the ranks that gave no answer within `limit`, stop the group."""
        names = ", ".join(f"{r}" + (f" (pid {self.pids[r]})" if r in self.pids else "") for r in sorted(ranks))
        self._kill()
        raise WorkerError(f"{self.role} worker{'s' if len(ranks) > 1 else ''} {names} gave no answer within "
                          f"{limit:g} s during {what} (hung; trainer.part_timeout_s); the {self.role} group is stopped")

    # ---------------------------------------------------------------- forward passes

    def compute_log_probs(self, batch: Batch, *, temperature: float, micro_batch_size: int,
                          max_token_len: int | None = None, with_entropy: bool = False,
                          base: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Log-prob of every response token (policy.py): `[B, R]` float32 in sample order, 0
        where `response_mask` is 0; with `with_entropy`, also each token's entropy `[B, R]`.
        Micro-batches of `micro_batch_size` samples or by token budget `max_token_len`
        (micro_batches.py), spread over the ranks. `base`: with the LoRA adapters off (the reference)."""
        parts = [p for p in self._call("compute_log_probs", self._put(batch), temperature=temperature,
                                       micro_batch_size=micro_batch_size, max_token_len=max_token_len,
                                       with_entropy=with_entropy, base=base, tokens=_tokens(batch))
                 if p is not None]
        rows = torch.cat([r for r, _ in parts])
        if with_entropy:
            return tuple(in_sample_order(torch.cat([out[i] for _, out in parts]), rows) for i in range(2))
        return in_sample_order(torch.cat([out for _, out in parts]), rows)

    def compute_values(self, batch: Batch, *, micro_batch_size: int, max_token_len: int | None = None) -> torch.Tensor:
        """The critic's values of the states before each response token (critic.py): `[B, R]`
        float32 in sample order, 0 where `response_mask` is 0; micro-batches as `compute_log_probs`."""
        parts = [p for p in self._call("compute_values", self._put(batch), micro_batch_size=micro_batch_size,
                                       max_token_len=max_token_len, tokens=_tokens(batch)) if p is not None]
        return in_sample_order(torch.cat([out for _, out in parts]), torch.cat([r for r, _ in parts]))

    # ---------------------------------------------------------------- training

    def update(self, batch: Batch, *, ppo_epochs: int, mini_batch_size: int, micro_batch_size: int,
               max_response_length: int | None = None, max_token_len: int | None = None,
               **loss: Any) -> dict[str, float]:
        """One training step on `batch`; returns its metrics.

        `ppo_epochs` passes over the batch, each cut into consecutive mini-batches of
        `mini_batch_size` SAMPLES (verl's ppo_mini_batch_size in prompts times rollout.n;
        sample order, no shuffling; the last may be smaller), one optimizer step per
        mini-batch; a mini-batch cut into micro-batches of `micro_batch_size` samples, or by
        token budget `max_token_len` (micro_batches.py). `max_response_length`: the divisor
        of "seq-mean-token-sum-norm" (None = the batch's R). The learning rate is stepped once
        per call (optim.py).

        `loss`: the role's `micro_batch_loss` arguments (actor: `loss=PolicyLossArgs`,
        `temperature`: policy.py; critic: `cliprange_value`, `loss_agg_mode`: critic.py).
        Metrics: the loss's stats named `<role>/<stat>` (actor: `pg_loss`, `entropy`, `kl` when
        the batch has `ref_log_probs`, `pg_clipfrac`, `ppo_kl`; critic: `vf_loss`,
        `vf_clipfrac`), each exact per mini-batch whatever the micro-batches, then the mean
        over the step's mini-batches in order; `<role>/grad_norm` (before clipping, mean over
        mini-batches); `<role>/lr`. A non-finite loss or gradient norm raises
        `NonFiniteError` naming the update (1-based: the trainer's step), epoch, mini-batch
        (and micro-batch); that mini-batch is not stepped (earlier ones of the update have
        been), nor the schedule advanced.
        """
        answers = self._call("update", self._put(batch), ppo_epochs=ppo_epochs, mini_batch_size=mini_batch_size,
                             micro_batch_size=micro_batch_size, max_response_length=max_response_length,
                             max_token_len=max_token_len, what="update", tokens=_tokens(batch) * ppo_epochs, **loss)
        records = []
        for i, first in enumerate(answers[0]["steps"]):
            per_micro = sorted(item for answer in answers for item in answer["steps"][i]["stats"])  # by index
            totals: dict[str, float] = {}
            for _, stats in per_micro:
                for key, value in stats.items():
                    totals[key] = totals.get(key, 0.0) + value
            totals[f"{self.role}/grad_norm"] = first["grad_norm"]
            records.append(totals)
        metrics = {key: sum(r[key] for r in records) / len(records) for key in records[0]}
        metrics[f"{self.role}/lr"] = answers[0]["lr"]
        return metrics

    # ---------------------------------------------------------------- weights and state

    def _rank0(self, method: str, *args: Any) -> Any:
        """Rank 0's answer to `method`; with parameters sharded at rest every rank is called
        (each takes part in the gathers of the whole model)."""
        if self.sharded:
            return self._call(method, *args)[0]
        return self._call_one(0, method, *args)

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """(HF name, tensor) of every weight the rollout replicas take (with LoRA the adapters
        alone): rank 0's, which every rank rebuilt from the shards by rank index after the
        last step (sharded at rest: which rank 0 gathers a unit at a time)."""
        return self._rank0("named_weights")

    def weight_digests(self) -> dict[str, str]:
        """`tensor_digests(named_weights())`, computed on rank 0 (sharded at rest: with every
        rank's part in the gathers): only the digests travel."""
        return self._rank0("weight_digests")

    def gpu_uuid(self) -> str | None:
        """The UUID of rank 0's GPU (None on the CPU)."""
        return self._call_one(0, "gpu_uuid")

    def share_weights(self, consumers: int) -> list[SharedWeights]:
        """Rank 0's weights in a buffer on its GPU, one CUDA IPC share per consumer (a
        replica on that GPU); the buffer lives until `release_shared_weights`."""
        return self._rank0("share_weights", consumers)

    def release_shared_weights(self) -> None:
        """Free the buffer of `share_weights`: after every consumer answered."""
        self._call_one(0, "release_shared_weights")

    def save(self, directory: Path) -> None:
        """Every rank writes its shard file into `directory` (fsynced)."""
        self._call("save_shard", str(directory), what="saving a checkpoint")

    def state_dict(self) -> dict[str, Any]:
        """What the driver keeps of the group in a checkpoint: how many shards it wrote, of which layout."""
        layout = {k: self.layout[k] for k in ("names", "shapes", "numel", "chunk")}  # not world_size: any count reads it
        return {"num_shards": self.num_workers, "layout": layout}

    def load(self, directory: Path, state: dict[str, Any]) -> None:
        """Every rank takes its range from the shard files in `directory` (written by any
        number of workers). A checkpoint of other parameters (names, shapes) is refused."""
        saved, ours = state["layout"], self.state_dict()["layout"]
        if saved != ours:
            diff = [k for k in ours if saved.get(k) != ours[k]]
            raise CheckpointError(f"{directory}: the {self.role} shards hold other parameters than this model "
                                  f"(they differ in {', '.join(diff)}): a checkpoint of another model or layout")
        self._call("load_shards", str(directory), int(state["num_shards"]), what="loading a checkpoint")

    def determinism_info(self) -> dict[str, dict[str, Any]]:
        """Each rank's mode, named `<role> worker <rank>`."""
        return {f"{self.role} worker {rank}": info for rank, info in enumerate(self._call("determinism_info"))}

    def shutdown(self) -> None:
        """Stop every rank's process (a dead one included)."""
        if not self.workers:
            return
        if self.in_process:
            self.workers.pop().shutdown()
            return
        ray.wait([w.shutdown.remote() for w in self.workers], num_returns=len(self.workers), timeout=10)
        self._kill()

    def _kill(self) -> None:
        for w in self.workers:
            ray.kill(w)
        self.workers = []


def _tokens(batch: Batch) -> int:
    """The tokens a call over `batch` carries (padding included): what scales its time limit."""
    return batch["input_ids"].numel() if "input_ids" in batch else 0


def _first_line(err: Exception) -> str:
    cause = getattr(err, "cause", None) or err
    text = f"{type(cause).__name__}: {cause}".strip()
    return text.splitlines()[0] if text else type(cause).__name__
