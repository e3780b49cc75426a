"""Rollout replicas: the built-in engine as Ray actors, and the pool that owns them.

- `RolloutReplica`: one `Engine` in one Ray actor (an async actor: concurrent
  `generate` calls share the engine's continuous batching). Its constructor checks the
  run's determinism environment before anything else, so a replica started without it
  fails at once, naming the variable.
- `ReplicaPool`: starts `num_replicas` of them with the run's `runtime_env` and waits for
  them (as the reward-model pool does: `reprorl.actors.pool`), pushes versioned weights
  to all of them and checks every one serves the version, replaces a replica that died
  (`reprorl.actors.supervision`) with the current weights, shuts down.

Which replica serves a request only affects speed (docs/design.md): a sample is a function of
(weights, prompt ids, sampling params, request seed), and all of those travel with the
request or are checked equal across replicas (the weight version).

Every replica, whatever its backend, answers `determinism_info() -> dict` for the run's
determinism report (`reprorl.determinism_report`), with at least these keys:
    backend                   str: "reprorl" (the built-in engine), "vllm", ...
    batch_invariant           bool: each row's result is independent of its batch
    num_threads               int: CPU threads of the forward pass
    dtype                     str: the weights' dtype, e.g. "float32"
    deterministic_algorithms  bool: `torch.are_deterministic_algorithms_enabled()`
    env                       dict[str, str]: the determinism variables the process sees
    kernels, device           str | None: the `reprorl.kernels` backend and where it runs
`determinism_report.model_part_info(backend=..., batch_invariant=..., dtype=...,
num_threads=..., kernels=..., device=...)` builds such a dict (adding pid, host and torch's flags); a backend may
add keys of its own. `ReplicaPool.determinism_info()` returns them by replica id.

Placement: `device="cuda"` builds each built-in engine on the GPU Ray gives the replica
(`num_gpus`, a fraction when the trainer shares the GPU: reprorl/resources/placement.py);
`scheduling` pins replica i to a GPU of the run's placement group on several GPUs, and
a replacement to its dead replica's.

Weight pushes (reprorl/actors/weights.py): `update_weights` packs the tensors into one
host buffer per dtype in Ray's object store (every backend, any device);
`update_weights_shared` lets each built-in replica on the trainer's GPU copy device to
device from the trainer's own buffer (CUDA IPC), the others still from the host.

This module imports torch and the engine only inside the functions that use them: Ray
imports an actor class's module wherever one of its handles is unpickled, and the
agent-loop workers, which hold replica handles, run no model (reprorl/agent_loop/worker.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import ray

from reprorl.determinism import ENV_SEED, check_worker_env, enable_full_determinism, is_full_determinism
from reprorl.determinism_report import model_part_info
from reprorl.actors.pool import ReplicaPoolBase
from reprorl.rollout.request import GenerateOutput, SamplingParams
from reprorl.actors.supervision import PART_TIMEOUT_S, KillSwitch, Restarts, gather

if TYPE_CHECKING:
    import torch

    from reprorl.models.lora import LoraSpec
    from reprorl.rollout.engine import Engine
    from reprorl.actors.weights import PackedWeights, SharedWeights


def build_engine(model_path: str, *, device: str = "cpu", dtype: str | None = None, lora: LoraSpec | None = None,
                 **options: Any) -> Engine:
    """The built-in engine for `model_path` on `device` ("cpu" or "cuda"), weights in `dtype`
    (None: the checkpoint's), with the policy's LoRA adapters if `lora` (drawn as the
    trainer draws them: the same bits before any push). The engine runs where its model's
    parameters are."""
    from reprorl.models.hf_io import dtype_from_name, eos_ids_from_dir, load_model
    from reprorl.rollout.engine import Engine

    model, _ = load_model(model_path, kind="causal_lm", dtype=dtype_from_name(dtype), lora=lora)
    return Engine(model.to(device), eos_token_id=eos_ids_from_dir(str(model_path)), **options)


class RolloutReplica:
    """One inference engine; create with `ray.remote(RolloutReplica)` (as `ReplicaPool` does).

    `engine_options` go to `build_engine`: device, dtype, max_num_seqs,
    max_num_batched_tokens, max_model_len, batch_invariant, and the GPU engine's options. `expected_env` is the run's
    `determinism_env(...)`.
    """

    def __init__(self, replica_id: int, model_path: str, engine_options: Mapping[str, Any],
                 expected_env: Mapping[str, str]):
        check_worker_env(expected_env, where=f"rollout replica {replica_id}")
        if is_full_determinism():
            enable_full_determinism(int(os.environ[ENV_SEED]))
        self.replica_id = replica_id
        self.engine = build_engine(model_path, **engine_options)
        self.kill_switch = KillSwitch.from_env(f"rollout replica {replica_id}")  # fault tests only

    async def ready(self) -> int:
        """Returns the replica id once the constructor ran (surfaces start-up errors)."""
        return self.replica_id

    async def generate(self, request_id: str, prompt_ids: list[int], sampling_params: SamplingParams,
                       seed: int, priority: int = 0) -> GenerateOutput:
        if self.kill_switch is not None:
            self.kill_switch.see(request_id)
        return await self.engine.generate(request_id, prompt_ids, sampling_params, seed, priority)

    async def update_weights(self, named_tensors: SharedWeights | PackedWeights | Iterable[tuple[str, torch.Tensor]],
                             version: int) -> int:
        """Copy the weights in as `version`: a `SharedWeights` device to device from the
        trainer's buffer on this GPU (CUDA IPC), a `PackedWeights` in one copy per dtype."""
        from reprorl.actors.weights import PackedWeights, SharedWeights

        if isinstance(named_tensors, SharedWeights):
            await self._update_from_ipc(named_tensors, version)
        else:
            if isinstance(named_tensors, PackedWeights):  # one copy to where the weights live now
                named_tensors = named_tensors.unpack(self._weights_device())
            await self.engine.update_weights(named_tensors, version)
        return self.engine.weight_version

    async def _update_from_ipc(self, shared: SharedWeights, version: int) -> None:
        """Open the share, copy in place (the parameters keep their addresses, so the CUDA
        graphs stay valid), wait for the copies, drop the share: the trainer may then free it."""
        import torch

        packed = shared.open(self.engine.device)
        try:
            await self.engine.update_weights(packed.unpack(self.engine.device), version)
        finally:
            torch.cuda.synchronize(self.engine.device)  # the copies read the trainer's memory
            del packed  # the last reference to the mapped buffers: the trainer's count drops

    def _weights_device(self) -> torch.device:
        """Where the engine's parameters are now (the host while asleep, unless it kept them)."""
        return next(self.engine.model.parameters()).device

    async def gpu_uuid(self) -> str | None:
        """The UUID of this replica's GPU (None on the CPU): who can take weights over CUDA IPC."""
        from reprorl.actors.weights import gpu_uuid

        return gpu_uuid(self.engine.device) if self.engine.device.type == "cuda" else None

    async def weight_digests(self) -> dict[str, str]:
        """`tensor_digest` of every parameter the engine serves (the fingerprint's per-parameter digests)."""
        from reprorl.fingerprint import tensor_digests

        return tensor_digests(self.engine.model.named_parameters())

    async def sleep(self, keep_weights: bool = False) -> None:
        await self.engine.sleep(keep_weights=keep_weights)

    async def wake_up(self) -> None:
        await self.engine.wake_up()

    async def abort(self, request_id: str) -> bool:
        """Abort a request in flight here (its generate returns finish "abort"); False if unknown."""
        return self.engine.abort(request_id)

    async def stats(self) -> dict[str, Any]:
        return {"replica_id": self.replica_id, **self.engine.stats()}

    async def determinism_info(self) -> dict[str, Any]:
        """This replica's determinism mode (keys: see the module doc)."""
        return model_part_info(backend="reprorl", batch_invariant=self.engine.options.batch_invariant,
                               dtype=self.engine.dtype, num_threads=self.engine.num_threads,
                               kernels=self.engine.kernels.name, device=self.engine.device)

    async def weight_version(self) -> int:
        return self.engine.weight_version

    async def shutdown(self) -> None:
        """Stop the engine's step loop (before the actor is killed)."""
        self.engine.shutdown()


class WeightVersionError(RuntimeError):
    """A replica serves a different weight version from the one the trainer pushed."""


class ReplicaPool(ReplicaPoolBase):
    """`num_replicas` rollout replicas on Ray, started with the run's determinism environment.

    `num_cpus_per_replica` is a scheduling hint (the engine's threads come from Ray's
    `OMP_NUM_THREADS`, 1 for a fractional share): by default the replicas together take
    at most half of the CPUs still free in Ray, at most one each, leaving the rest to the
    trainer and reward workers (on an idle 2-core machine: 1 replica -> 1 CPU, 3 -> 1/3
    each). Counting free CPUs, not all of them, means a second pool (reward model, tests)
    still gets scheduled instead of waiting forever.
    `runtime_env` is the user's, merged with the determinism variables. `max_model_len`:
    the longest prompt plus response a replica serves (None: the engine's default).
    `native_options`: more `Engine` keywords for the built-in backend (gpu_memory_utilization,
    cuda_graphs, prefix_sharing).

    A replica found dead by any pool call, or hung (no answer within `part_timeout_s`),
    is replaced, within `restarts` (the run's budget; None: no replacement, the call
    raises `FaultError`): a new actor with the next unused id, loaded with the current
    weight version and checked to serve it and to run in the first replica's determinism
    mode before it joins `replicas`. The agent-loop manager routes to whatever `replicas`
    holds at each rollout.

    The constructor starts every replica at once and waits until all are ready;
    `wait=False` returns as soon as they are asked for, and `wait_ready()` waits (so a
    trainer starts its pools and worker groups together): reprorl/actors/pool.py.
    """

    KIND = "rollout replica"
    NAME = "rollout"

    def __init__(
        self,
        model_path: str,
        num_replicas: int,
        *,
        seed: int,
        full_determinism: bool,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 4096,
        max_model_len: int | None = None,
        batch_invariant: bool | None = None,
        num_cpus_per_replica: float | None = None,
        runtime_env: Mapping[str, Any] | None = None,
        ray_address: str | None = None,
        backend: str = "native",
        vllm_options: Mapping[str, Any] | None = None,
        restarts: Restarts | None = None,
        device: str = "cpu",
        dtype: str | None = None,
        num_gpus: float | None = None,
        native_options: Mapping[str, Any] | None = None,
        scheduling: Sequence[Any] | None = None,
        wait: bool = True,
        part_timeout_s: float = PART_TIMEOUT_S,
    ):
        super().__init__(num_replicas, backend=backend, seed=seed, full_determinism=full_determinism,
                         runtime_env=runtime_env, ray_address=ray_address, restarts=restarts,
                         num_cpus_per_replica=num_cpus_per_replica, part_timeout_s=part_timeout_s)
        self.seed = seed
        engine_options = {
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens,
            "max_model_len": max_model_len,
            # Batch invariance is what makes a sample independent of its batch: on with determinism.
            "batch_invariant": full_determinism if batch_invariant is None else batch_invariant,
            "device": device, "dtype": dtype, **(native_options or {}),
        }
        replica_cls = RolloutReplica
        if backend == "vllm":  # options: reprorl/rollout/vllm_replica.py
            from reprorl.rollout.vllm_replica import VllmReplica

            replica_cls = VllmReplica
            engine_options = {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
                              "max_model_len": max_model_len, "dtype": dtype, **(vllm_options or {})}
        self.version = 0  # the engine's initial weight_version
        self.asleep = False
        self._pushes: list[tuple[Any, frozenset[str], int]] = []  # (object ref, names, version), oldest first
        self._start_replicas(replica_cls, num_replicas, model_path, engine_options,
                             num_gpus=self._gpus_per_replica(device, num_gpus), max_num_seqs=max_num_seqs, wait=wait,
                             scheduling=scheduling)

    def replica_ids(self) -> list[int]:
        return sorted(self.replicas)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Push the same weights to every replica as `version`, then check they all serve it.

        The tensors are packed into one flat buffer per dtype (`PackedWeights`) and put in
        Ray's object store once, shared by all replicas; each replica copies it to its
        device in one transfer. The pool keeps that copy until a later push covers the
        same names, so that a replica that dies can be replaced at the current version:
        between pushes, the object store holds one copy of the weights (during a push, two).
        """
        from reprorl.actors.weights import PackedWeights

        packed = named_tensors if isinstance(named_tensors, PackedWeights) else PackedWeights.pack(
            (name, t.detach().cpu()) for name, t in named_tensors)
        ref = ray.put(packed)
        refs = {i: r.update_weights.remote(ref, version) for i, r in self.replicas.items()}
        self._finish_push(refs, packed.names, ref, version)

    def update_weights_shared(self, shares: Mapping[int, SharedWeights], version: int,
                              host_weights: Callable[[], Iterable[tuple[str, torch.Tensor]]]) -> None:
        """Push `version` to every replica: replica i of `shares` copies device to device from
        the trainer's buffer on its GPU (CUDA IPC, `shares[i]` its own share), any other one
        takes `host_weights()` packed as in `update_weights`. Returns once every replica
        answered (the trainer may then free the buffer), after the version check.

        No copy of the weights is kept: a replica replaced later is brought up from
        `host_weights()`, which must give this version's weights until the next push (the
        trainer changes them only between `sleep` and the next push, when the pool is idle).
        """
        from reprorl.actors.weights import PackedWeights

        names = next(iter(shares.values())).names if shares else frozenset()
        refs = {i: self.replicas[i].update_weights.remote(share, version)
                for i, share in shares.items() if i in self.replicas}
        host_ids = [i for i in self.replicas if i not in shares]
        source: Any = host_weights
        if host_ids:
            packed = PackedWeights.pack((name, t.detach().cpu()) for name, t in host_weights())
            source, names = ray.put(packed), packed.names
            refs.update({i: self.replicas[i].update_weights.remote(source, version) for i in host_ids})
        self._finish_push(refs, names, source, version)

    def _finish_push(self, refs: dict[int, Any], names: frozenset[str], source: Any, version: int) -> None:
        """Wait for a push's answers; keep its source for replacements (`_bring_up`: an object
        ref of `PackedWeights`, or a device push's `host_weights`); check the version."""
        _, dead = gather(refs, timeout_s=self.part_timeout_s)
        self._pushes = [p for p in self._pushes if not p[1] <= names] + [(source, names, version)]
        self.version = version
        self._replace_dead(dead, f"update_weights to version {version}")  # a replacement replays the pushes
        self.check_weight_version(version)

    def gpu_uuids(self) -> dict[int, str | None]:
        """Each replica's GPU UUID, by id (None: on the CPU, or a backend that takes weights
        only from the host: vLLM); a replica whose UUID is the trainer's can take `SharedWeights`."""
        if self.first_info.get("backend") != "reprorl":
            return {i: None for i in self.replica_ids()}
        return self._on_all("gpu_uuid")

    def weight_digests(self) -> dict[int, dict[str, str]]:
        """Each built-in replica's per-parameter digests, by id (what it serves, bit for bit)."""
        return self._on_all("weight_digests")

    def weight_versions(self) -> dict[int, int]:
        return self._on_all("weight_version")

    def check_weight_version(self, version: int) -> None:
        """Raise `WeightVersionError` naming every replica that does not serve `version`."""
        stale = {i: v for i, v in self.weight_versions().items() if v != version}
        if stale:
            raise WeightVersionError(
                "rollout replicas on the wrong weight version (expected "
                f"{version}): " + ", ".join(f"replica {i} serves {v}" for i, v in stale.items())
            )

    def sleep(self, keep_weights: bool = False) -> None:
        """Free each engine's KV cache; `keep_weights` (built-in engines): the weights stay
        on the GPU for a device-to-device push (`update_weights_shared`), else they go to the host."""
        if keep_weights and self.first_info.get("backend") != "reprorl":
            raise ValueError(f"sleep(keep_weights=True): the {self.first_info.get('backend')} backend has no such mode")
        # First, so that a replacement made during the call sleeps the same way:
        self.asleep, self._sleep_keeps_weights = True, keep_weights
        self._on_all("sleep", *([True] if keep_weights else []))

    def wake_up(self) -> None:
        self.asleep = False
        self._on_all("wake_up")

    def stats(self) -> list[dict[str, Any]]:
        return list(self._on_all("stats").values())

    def replace_dead(self, noticed_in: str = "a probe") -> list[int]:
        """Probe every replica (`ready`); replace those that died or hung. Returns the new ids."""
        _, dead = gather({i: r.ready.remote() for i, r in self.replicas.items()}, timeout_s=self.part_timeout_s)
        return list(self._replace_dead(dead, noticed_in).values())

    def _bring_up(self, actor: Any) -> str:
        """Replay the kept pushes into a new replica, check it serves `self.version`, match `asleep`."""
        from reprorl.actors.weights import PackedWeights

        for k, (source, names, version) in enumerate(self._pushes):
            if callable(source):  # a device push: the trainer's weights from the host, packed once
                source = ray.put(PackedWeights.pack((n, t.detach().cpu()) for n, t in source()))
                self._pushes[k] = (source, names, version)
            self._get(actor.update_weights.remote(source, version), f"update_weights to version {version}")
        served = self._get(actor.weight_version.remote(), "weight_version")
        if served != self.version:
            raise WeightVersionError(f"the replacement serves weight version {served}, expected {self.version}")
        if self.asleep:
            self._get(actor.sleep.remote(*([True] if self._sleep_keeps_weights else [])), "sleep")
        return f"serving weight version {served}"

    def shutdown(self) -> None:
        """Stop and kill every replica actor (Ray itself stays up: others may use it)."""
        # A replica that already died answers with an error: it is being removed anyway.
        ray.wait([r.shutdown.remote() for r in self.replicas.values()], num_returns=len(self.replicas), timeout=30)
        self._kill_replicas()
        self._pushes = []
