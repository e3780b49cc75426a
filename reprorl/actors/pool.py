"""What the rollout pool and the reward-model pool share: their Ray replicas' start, wait and replacement.

`reprorl.rollout.replica.ReplicaPool` and `reprorl.reward.reward_model.RewardModelPool`
are both `ReplicaPoolBase`s:

- The constructor connects to Ray (`init_ray`), merges the run's determinism variables
  into the user's `runtime_env`, and starts every replica actor at once with the same
  arguments but its id. With `wait=False` it returns then, so a trainer starts its pools
  and worker groups together (reprorl/trainer/parts.py); `wait_ready()` waits.
- `wait_ready()` waits with a timeout (`wait_for_actors`): Ray keeps an actor pending
  forever when its CPUs are never free, so it fails naming the pool and the CPUs asked
  for and free instead of hanging; a replica whose constructor failed raises its own
  error. It keeps the first replica's `determinism_info()`: what a replacement must equal.
- A start that fails (asking Ray for the replicas, or `wait_ready()`) kills every replica
  the pool started, the healthy ones too, then raises its error unchanged: the caller
  has no pool to shut down, and a live replica would keep its CPUs and GPU memory.
- A replica found dead is replaced within the run's `Restarts` budget
  (`reprorl.actors.supervision.replace_dead`), by a new actor with the next unused id,
  brought up by the pool's `_bring_up` (the rollout pool: the current weights). A replica
  that does not answer a pool call within `part_timeout_s` is hung: killed and replaced alike.

Which CPUs a replica asks for by default: `replica_cpus`.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any

import ray

from reprorl.actors.vllm_engine import replica_gpus, warn_if_serialized
from reprorl.determinism import determinism_env, ray_runtime_env
from reprorl.actors.supervision import (
    PART_TIMEOUT_S,
    Restarts,
    gather,
    get_within,
    kill_switch_env,
    replace_dead,
)


def init_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Connect to Ray unless this process already did.

    `address` (or `RAY_ADDRESS`) joins a running cluster, as `ray.init(address=...)`;
    without one, a local instance of this process's own is started (`num_cpus` caps it;
    None = all cores), even where another Ray runs on the machine: `ray.init()` alone
    would join that one, a run's CPUs and actors then mixed with a stranger's.
    Each actor gets the run's variables through its own `runtime_env`, so a Ray started
    by someone else (tests, a notebook) works too.
    """
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address)
    else:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False)


def replica_cpus(num_replicas: int, free: float | None = None) -> float:
    """Ray CPUs to ask for each of `num_replicas` new replicas: half of what is free, at most 1 each.

    A scheduling hint only (engine threads are set apart from it); counting FREE CPUs means a
    second pool (reward model, another run's) is still schedulable next to the first.
    `free`: the CPUs to count as free (None: what Ray says is free now). Ray counts an
    actor's CPUs only once it is placed, so pools started together pass what the pools
    before them left (reprorl/trainer/parts.py).
    """
    if free is None:
        free = ray.available_resources().get("CPU", 0.0)
    return min(1.0, free / (2 * num_replicas))


READY_TIMEOUT_S = 600.0  # read at each wait (not bound as a default), so that a test can shorten it


def wait_for_actors(actors: list[Any], what: str, num_cpus_each: float, timeout_s: float | None = None,
                    method: str = "ready") -> None:
    """Wait until every actor answers `method` (within `timeout_s`, default READY_TIMEOUT_S);
    fail with the reason instead of hanging.

    Ray keeps an actor pending forever when its resources are never free; this names the
    pool, how many replicas are missing and the CPUs asked for and free.
    """
    timeout_s = READY_TIMEOUT_S if timeout_s is None else timeout_s
    refs = [getattr(a, method).remote() for a in actors]
    done, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    if pending:
        free = ray.available_resources().get("CPU", 0.0)
        raise RuntimeError(
            f"{what}: {len(pending)} of {len(refs)} replicas not ready after {timeout_s:.0f} s; each asks for "
            f"{num_cpus_each:g} CPU and Ray has {free:g} free (another pool may hold them)"
        )
    ray.get(done)  # raises the replica's own error if its start failed


class ReplicaPoolBase:
    """Replica actors of one class on Ray, started together with the run's determinism environment.

    A subclass names its parts (`KIND`: a replica, in errors, logs, the kill switch and
    `supervision.RESTART_METRICS`; `NAME`: the pool, in start-up errors and warnings); its
    constructor calls this one (Ray, the environment, the budget, the CPUs: before any
    choice that asks Ray, such as vLLM's GPUs), then `_start_replicas`. Each actor is made as
    `replica_cls(replica_id, model_path, options, expected_env)` and answers `ready()` and
    `determinism_info()`. `shutdown()` kills them (the rollout pool stops their engines first).
    """

    KIND: str  # e.g. "rollout replica"
    NAME: str  # e.g. "rollout"

    def __init__(self, num_replicas: int, *, backend: str, seed: int, full_determinism: bool,
                 runtime_env: Mapping[str, Any] | None, ray_address: str | None, restarts: Restarts | None,
                 num_cpus_per_replica: float | None, part_timeout_s: float = PART_TIMEOUT_S) -> None:
        """Check the counts and `backend` ("native" or "vllm"); connect to Ray; set `env` (the
        run's determinism variables, each replica checks them), `runtime_env`, `restarts`
        (None: `Restarts(0)`, no replacement), `num_cpus_per_replica` (None:
        `replica_cpus(num_replicas)`) and `part_timeout_s` (`supervision.time_limit`: past it
        a replica that does not answer a pool call is hung, and replaced as a dead one)."""
        pool = type(self).__name__
        if num_replicas < 1:
            raise ValueError(f"{pool}: num_replicas={num_replicas}; expected >= 1")
        if backend not in ("native", "vllm"):
            raise ValueError(f"{pool}: backend={backend!r}; expected 'native' or 'vllm'")
        self.backend = backend
        self.env = determinism_env(seed, full_determinism)
        self.runtime_env = ray_runtime_env({**self.env, **kill_switch_env()}, runtime_env)
        self.restarts = restarts if restarts is not None else Restarts(0)
        self.part_timeout_s = part_timeout_s
        self.restarts.watch(self.KIND)
        init_ray(ray_address)
        if num_cpus_per_replica is None:
            num_cpus_per_replica = replica_cpus(num_replicas)
        self.num_cpus_per_replica = num_cpus_per_replica

    def _gpus_per_replica(self, device: str, num_gpus: float | None) -> float:
        """Ray GPUs each replica asks for: `num_gpus` (a fraction when the run shares one GPU:
        reprorl/resources/placement.py; None: 1 on cuda, 0 on cpu); a vLLM replica's as
        `vllm_engine.replica_gpus` turns it."""
        if num_gpus is None:
            num_gpus = 1 if device == "cuda" else 0
        if self.backend == "vllm":
            return replica_gpus(num_gpus if device == "cuda" else None)
        return num_gpus

    def _start_replicas(self, replica_cls: type, num_replicas: int, model_path: str, options: Mapping[str, Any], *,
                        num_gpus: float, max_num_seqs: int, wait: bool, scheduling: Sequence[Any] | None = None) -> None:
        """Ask Ray for replicas 0..num_replicas-1 of `replica_cls` (`num_gpus` each) at once;
        wait for them unless `wait` is False (`wait_ready`). `max_num_seqs`: what the pool
        asked of each, for the vLLM backend's warning when it serves one at a time.
        `scheduling`: each replica's Ray scheduling strategy (the bundle of its GPU, on
        several GPUs: reprorl/resources/placement.py), which its replacements keep; None: Ray's choice."""
        if scheduling is not None and len(scheduling) != num_replicas:
            raise ValueError(f"{type(self).__name__}: {len(scheduling)} scheduling strategies for {num_replicas} replicas")
        self.model_path = str(model_path)
        self._actor = ray.remote(replica_cls)
        self._actor_options = {"num_cpus": self.num_cpus_per_replica, "num_gpus": num_gpus,
                               "runtime_env": self.runtime_env}
        self._scheduling = list(scheduling) if scheduling is not None else [None] * num_replicas
        self._slot_of = {i: i for i in range(num_replicas)}  # replica id -> its place (a replacement takes its dead one's)
        self._options = options
        self.max_num_seqs = max_num_seqs
        self.replicas: dict[int, Any] = {}
        self._new_ids = itertools.count(num_replicas)  # a replacement's id: never one used before
        self.first_info: dict[str, Any] | None = None  # what a replacement must equal; set by wait_ready
        with self._killed_on_failure():
            for i in range(num_replicas):
                self.replicas[i] = self._start(i)
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Block until every replica has started (its error if one failed; a RuntimeError naming
        the CPUs when Ray cannot place them; either way every replica is killed first). Done by
        the constructor unless `wait=False` (then call this before any other method); a second
        call returns at once."""
        if self.first_info is not None:
            return
        if not self.replicas:  # a failed start killed them
            raise RuntimeError(f"the {self.NAME} replicas were stopped when their start failed; make a new pool")
        with self._killed_on_failure():
            wait_for_actors(list(self.replicas.values()), f"{self.NAME} replicas", self.num_cpus_per_replica)
            self.first_info = self._get(self.replicas[0].determinism_info.remote(), f"{self.KIND} 0's determinism_info")
        if self.backend == "vllm":
            warn_if_serialized(self.first_info, self.max_num_seqs, self.NAME)

    @contextlib.contextmanager
    def _killed_on_failure(self) -> Iterator[None]:
        """Kill every replica if the block raises (an interrupt too), then let its error go on unchanged.

        Not `shutdown`: the rollout pool's would wait up to 30 s on engines that never started."""
        try:
            yield
        except BaseException:
            self._kill_replicas()
            raise

    def _kill_replicas(self) -> None:
        for r in self.replicas.values():
            ray.kill(r)
        self.replicas = {}

    def shutdown(self) -> None:
        """Kill every replica actor (Ray itself stays up: others may use it)."""
        self._kill_replicas()

    def _start(self, replica_id: int) -> Any:
        strategy = self._scheduling[self._slot_of[replica_id]]
        pinned = {"scheduling_strategy": strategy} if strategy is not None else {}
        return self._actor.options(**self._actor_options, **pinned).remote(replica_id, self.model_path, self._options,
                                                                          self.env)

    def _start_ready(self, replica_id: int) -> Any:
        """A replacement, started and ready (`replace_dead` kills it if this raises)."""
        actor = self._start(replica_id)
        wait_for_actors([actor], f"{self.KIND} {replica_id}", self.num_cpus_per_replica)
        return actor

    def determinism_info(self) -> dict[int, dict[str, Any]]:
        """Each replica's `determinism_info()`, by replica id; a dead one is replaced and answers instead."""
        return self._on_all("determinism_info")

    def _on_all(self, method: str, *args: Any) -> dict[int, Any]:
        """`method(*args)` on every replica, by sorted id; a dead one is replaced and answers instead."""
        results, dead = gather({i: getattr(r, method).remote(*args) for i, r in self.replicas.items()},
                               timeout_s=self.part_timeout_s)
        for new_id in self._replace_dead(dead, method).values():
            results[new_id] = self._get(getattr(self.replicas[new_id], method).remote(*args),
                                        f"{self.KIND} {new_id}'s {method}")
        return dict(sorted(results.items()))

    def _get(self, ref: Any, what: str) -> Any:
        """`ray.get(ref)` within `part_timeout_s` (`get_within`)."""
        return get_within(ref, self.part_timeout_s, what)

    def _replace_dead(self, dead: Collection[int] | Mapping[int, BaseException], noticed_in: str) -> dict[int, int]:
        """Replace each dead (or hung) replica, in id order, by one in its place (the same GPU);
        returns {dead id: replacement id}."""
        replaced = {}
        for dead_id in sorted(dead):
            def start(new_id: int, slot: int = self._slot_of[dead_id]) -> Any:
                self._slot_of[new_id] = slot
                return self._start_ready(new_id)

            one = {dead_id: dead[dead_id]} if isinstance(dead, Mapping) else [dead_id]
            replaced.update(replace_dead(self.replicas, one, self.KIND, self._new_ids, start=start,
                                         reference_info=self.first_info, restarts=self.restarts,
                                         noticed_in=noticed_in, bring_up=self._bring_up,
                                         timeout_s=self.part_timeout_s))
        return replaced

    def _bring_up(self, actor: Any) -> str:
        """Make a started replacement ready to serve before it joins `replicas`; a note for the
        log. Nothing here: a reward replica needs no state; the rollout pool loads the weights."""
        return ""
