"""Routing of generate requests to rollout replicas.

A sample depends only on (weights, prompt ids, sampling params, request seed), so routing
only affects speed: the balancer is free to be load-aware, and a request whose replica
died can be retried on another with the same result. What it must not be is
process-dependent: ties and hash routing go through `stable_hash(request_id)` over the
SORTED replica ids, never Python's `hash()` or dict order, so a run routes the same way
in every process (useful for replaying load, required by nothing in the contract).

- `LoadBalancer`: the plain logic (sticky by request id, then by affinity key, else least
  in-flight). The affinity key keeps the n samples of one prompt on one replica while any
  is in flight, so its engine prefills the prompt once (prefix sharing, engine.py).
- `LoadBalancerActor`: the same class as a Ray actor, so several agent-loop workers
  share one view of the load.
- `generate_balanced`: the client path: acquire, call the replica, release in a
  `finally`, and on a dead or hung replica remove it and retry elsewhere.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

import ray
from ray.exceptions import RayActorError

from reprorl.determinism import check_worker_env, stable_hash

ROUTING_MODES = ("least_loaded", "hash")


class NoReplicaError(RuntimeError):
    """Every rollout replica the balancer knew about has been removed (they died or hung)."""


class BalancerError(RuntimeError):
    """The load-balancer actor died or did not answer in time; its owner replaces it."""


class LoadBalancer:
    """Chooses a replica for each request; replica ids are ints (or strs), compared sorted.

    `acquire(request_id, affinity)` returns the replica the request's last turn used while
    that replica lives (sticky: a multi-turn loop keeps one replica), else, when `affinity`
    is given and another request of that key is in flight, that request's replica (the
    copies of one prompt meet there, and the engine prefills it once), otherwise
    - `routing="least_loaded"`: the replica with the fewest requests in flight; ties
      broken by `stable_hash(request_id)` over the sorted tied ids;
    - `routing="hash"`: `sorted(ids)[stable_hash(request_id) % len(ids)]`.
    Every `acquire` must be followed by one `release(request_id)`, also when the call
    failed (`generate_balanced` does it in a `finally`).

    `expected_env`: the run's `determinism_env(...)`, checked when given (Ray actors).
    The sticky table is an LRU of `max_sticky` request ids: forgetting one only costs
    its next turn a possibly different replica, i.e. speed, never a different sample.
    """

    def __init__(self, replica_ids: Iterable[int | str], routing: str = "least_loaded", max_sticky: int = 10_000,
                 expected_env: Mapping[str, str] | None = None):
        if expected_env is not None:  # as a Ray actor: the run's environment, checked first
            check_worker_env(expected_env, where="load balancer")
        if routing not in ROUTING_MODES:
            raise ValueError(f"LoadBalancer: routing={routing!r}; expected one of {ROUTING_MODES}")
        self.routing = routing
        self.max_sticky = max_sticky
        self._in_flight: dict[int | str, int] = {}  # replica id -> requests in flight
        self._active: dict[str, int | str] = {}  # request id -> replica, between acquire and release
        self._sticky: OrderedDict[str, int | str] = OrderedDict()  # request id -> last replica
        self._affinity: dict[str, str] = {}  # request id -> its affinity key, between acquire and release
        self._groups: dict[str, list] = {}  # affinity key -> [replica, requests in flight]
        for rid in replica_ids:
            self.add_replica(rid)

    def replica_ids(self) -> list[int | str]:
        return sorted(self._in_flight)

    def in_flight(self) -> dict[int | str, int]:
        """Requests in flight per replica, by sorted replica id."""
        return {rid: self._in_flight[rid] for rid in sorted(self._in_flight)}

    def acquire(self, request_id: str, affinity: str | None = None) -> int | str:
        """The replica to send `request_id` to; counts it in flight there until `release`."""
        if request_id in self._active:
            raise RuntimeError(
                f"LoadBalancer: request {request_id!r} is already in flight on replica "
                f"{self._active[request_id]!r}; release it before acquiring again"
            )
        if not self._in_flight:
            raise NoReplicaError(f"LoadBalancer: no rollout replica left to serve request {request_id!r}")
        rid = self._sticky.get(request_id)
        if rid is None and affinity in self._groups:
            rid = self._groups[affinity][0]
        if rid is None:
            rid = self._choose(request_id)
        if affinity is not None:
            group = self._groups.setdefault(affinity, [rid, 0])
            if group[0] == rid:  # (a sticky request elsewhere leaves its key's replica as it is)
                group[1] += 1
                self._affinity[request_id] = affinity
        self._sticky[request_id] = rid
        self._sticky.move_to_end(request_id)
        while len(self._sticky) > self.max_sticky:
            self._sticky.popitem(last=False)
        self._active[request_id] = rid
        self._in_flight[rid] += 1
        return rid

    def release(self, request_id: str) -> None:
        """End `request_id`'s call; a no-op if its replica was removed meanwhile."""
        rid = self._active.pop(request_id, None)
        if rid is not None and rid in self._in_flight:
            self._in_flight[rid] -= 1
        key = self._affinity.pop(request_id, None)
        if key is not None and key in self._groups:
            self._groups[key][1] -= 1
            if self._groups[key][1] == 0:
                del self._groups[key]

    def add_replica(self, replica_id: int | str) -> None:
        if replica_id in self._in_flight:
            raise ValueError(f"LoadBalancer: replica {replica_id!r} is already registered")
        self._in_flight[replica_id] = 0

    def set_replicas(self, replica_ids: Iterable[int | str]) -> None:
        """Route to exactly `replica_ids` from now on (the pool replaced some): replicas not
        in it are removed as by `remove_replica`, new ones added with nothing in flight."""
        ids = set(replica_ids)
        for rid in [r for r in self._in_flight if r not in ids]:
            self.remove_replica(rid)
        for rid in sorted(ids - set(self._in_flight)):
            self.add_replica(rid)

    def remove_replica(self, replica_id: int | str) -> None:
        """Stop routing to `replica_id` (e.g. it died); idempotent.

        Sticky entries to it are dropped, so later turns of its requests go elsewhere.
        Requests still marked in flight there stay in `_active` until released.
        """
        self._in_flight.pop(replica_id, None)
        for request_id in [r for r, rid in self._sticky.items() if rid == replica_id]:
            del self._sticky[request_id]
        for key in [k for k, (rid, _) in self._groups.items() if rid == replica_id]:
            del self._groups[key]
        for request_id in [r for r, rid in self._active.items() if rid == replica_id]:
            self._affinity.pop(request_id, None)  # its release must not count down a later group of its key

    def _choose(self, request_id: str) -> int | str:
        ids = sorted(self._in_flight)
        if self.routing == "least_loaded":
            least = min(self._in_flight.values())
            ids = [rid for rid in ids if self._in_flight[rid] == least]
        return ids[stable_hash(request_id) % len(ids)]


# Sync methods on an actor run one at a time, so the logic needs no lock. num_cpus=0:
# it is bookkeeping, and it must never wait for a CPU the replicas hold.
LoadBalancerActor = ray.remote(num_cpus=0)(LoadBalancer)


async def _ask(balancer: Any, method: str, *args: Any, timeout_s: float | None = None) -> Any:
    """Call `method` on a local `LoadBalancer` or on a `LoadBalancerActor` handle; an actor
    that died or gives no answer within `timeout_s` raises `BalancerError`."""
    if isinstance(balancer, LoadBalancer):
        return getattr(balancer, method)(*args)
    try:
        return await asyncio.wait_for(_awaited(getattr(balancer, method).remote(*args)), timeout_s)
    except RayActorError as err:
        raise BalancerError(f"the load balancer died during {method} ({type(err).__name__})") from None
    except asyncio.TimeoutError:
        raise BalancerError(f"the load balancer gave no answer to {method} within {timeout_s:g} s") from None


async def _awaited(ref: Any) -> Any:
    return await ref


async def generate_balanced(
    balancer: LoadBalancer | Any,
    replicas: Mapping[int | str, Any],
    request_id: str,
    *args: Any,
    max_attempts: int | None = None,
    affinity: str | None = None,
    timeout_s: float | None = None,
    balancer_timeout_s: float | None = None,
    **kwargs: Any,
) -> Any:
    """`replicas[rid].generate.remote(request_id, *args, **kwargs)` on the balancer's choice
    (`affinity`: see `LoadBalancer.acquire`).

    The in-flight count is released whatever happens. When the replica's actor is dead
    (`RayActorError`, including `ActorDiedError`), or gives no answer within `timeout_s`
    (None: no limit; it is hung), it is removed from the balancer and the request is
    retried on another, at most `max_attempts` times in all (default: the number of
    replicas). Retrying is safe because the sample depends only on the request's identity
    (its seed travels in the arguments), not on the replica; the pool replaces a hung
    replica at its next call. `ActorUnavailableError` (also a `RayActorError`) counts as
    dead too: the replica is dropped from this balancer, which costs speed, never a
    different result. A balancer actor that dies or gives no answer within
    `balancer_timeout_s` raises `BalancerError`. Other errors propagate unchanged.
    Returns what the replica's `generate` returns.
    """
    attempts = max_attempts if max_attempts is not None else max(1, len(replicas))
    died: list[str] = []
    for _ in range(attempts):
        try:
            rid = await _ask(balancer, "acquire", request_id, affinity, timeout_s=balancer_timeout_s)
        except NoReplicaError as err:
            raise NoReplicaError(f"{err}; replicas that died or hung under it: {died or 'none'}") from None
        try:
            return await asyncio.wait_for(_awaited(replicas[rid].generate.remote(request_id, *args, **kwargs)),
                                          timeout_s)
        except (RayActorError, asyncio.TimeoutError) as err:
            what = f"no answer within {timeout_s:g} s" if isinstance(err, asyncio.TimeoutError) else type(err).__name__
            died.append(f"{rid!r} ({what})")
            await _ask(balancer, "remove_replica", rid, timeout_s=balancer_timeout_s)
        finally:
            await _ask(balancer, "release", request_id, timeout_s=balancer_timeout_s)
    raise NoReplicaError(
        f"request {request_id!r} failed on {attempts} replicas, each of which died or hung: {', '.join(died)}"
    )
