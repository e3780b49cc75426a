"""The load balancer: routing logic without Ray, stability across processes, retries on Ray."""

import asyncio
import json
import os
import subprocess
import sys
import time

import pytest

from reprorl.determinism import stable_hash
from reprorl.rollout.load_balancer import BalancerError, LoadBalancer, NoReplicaError, generate_balanced

# --- the logic, no Ray -------------------------------------------------------------------


def test_least_loaded_picks_the_replica_with_fewest_in_flight():
    lb = LoadBalancer([0, 1, 2])
    first = lb.acquire("a")
    second = lb.acquire("b")
    third = lb.acquire("c")
    # Three requests on three idle replicas: one each.
    assert sorted([first, second, third]) == [0, 1, 2]
    assert lb.in_flight() == {0: 1, 1: 1, 2: 1}
    lb.release("b")
    # Now only `second` has nothing in flight: the next new request goes there.
    assert lb.acquire("d") == second
    assert lb.in_flight() == {0: 1, 1: 1, 2: 1}


def test_ties_are_broken_by_stable_hash_over_sorted_ids():
    # All idle: the choice is sorted(ids)[stable_hash(request_id) % 3], whatever the insertion order.
    for order in ([0, 1, 2], [2, 0, 1], [1, 2, 0]):
        lb = LoadBalancer(order)
        for rid in ["req-0", "req-1", "uid-7/3", "x"]:
            assert lb.acquire(rid) == [0, 1, 2][stable_hash(rid) % 3]
            lb.release(rid)
    # Among a subset of tied replicas: replica 0 busy, so {1, 2} tie.
    lb = LoadBalancer([0, 1, 2])
    lb._in_flight[0] = 5
    assert lb.acquire("y") == [1, 2][stable_hash("y") % 2]


def test_sticky_requests_return_to_their_replica_while_it_lives():
    lb = LoadBalancer([0, 1])
    r = lb.acquire("multi-turn")
    lb.release("multi-turn")
    # Load the sticky replica so least-loaded alone would pick the other one.
    lb._in_flight[r] += 3
    assert lb.acquire("multi-turn") == r
    lb.release("multi-turn")
    lb.remove_replica(r)
    other = 1 - r
    assert lb.acquire("multi-turn") == other
    assert lb._sticky["multi-turn"] == other


def test_sticky_table_is_bounded_lru():
    lb = LoadBalancer([0, 1, 2], max_sticky=2)
    for rid in ["a", "b", "c"]:
        lb.acquire(rid)
        lb.release(rid)
    assert list(lb._sticky) == ["b", "c"]


def test_hash_routing_ignores_load():
    lb = LoadBalancer([3, 1, 2], routing="hash")
    lb._in_flight[[1, 2, 3][stable_hash("r") % 3]] += 10
    assert lb.acquire("r") == [1, 2, 3][stable_hash("r") % 3]
    with pytest.raises(ValueError, match="routing='random'"):
        LoadBalancer([0], routing="random")


def test_release_on_failure_and_double_acquire():
    lb = LoadBalancer([0, 1])
    rid = lb.acquire("a")
    with pytest.raises(RuntimeError, match="'a' is already in flight"):
        lb.acquire("a")

    async def failing_call():
        class Boom(Exception):
            pass

        class FakeReplica:
            class generate:
                @staticmethod
                def remote(*args, **kwargs):
                    async def fail():
                        raise Boom("engine error")

                    return fail()

        with pytest.raises(Boom):
            await generate_balanced(lb, {0: FakeReplica, 1: FakeReplica}, "b", [1, 2])

    asyncio.run(failing_call())
    # "b" failed but its in-flight count was released; "a" is still counted.
    assert sum(lb.in_flight().values()) == 1
    assert lb.in_flight()[rid] == 1
    lb.release("a")
    lb.release("a")  # releasing twice is harmless
    assert lb.in_flight() == {0: 0, 1: 0}


def test_add_and_remove_replicas():
    lb = LoadBalancer([0])
    lb.add_replica(5)
    with pytest.raises(ValueError, match="replica 5 is already registered"):
        lb.add_replica(5)
    assert lb.replica_ids() == [0, 5]
    lb.acquire("a")  # in flight on some replica
    lb.remove_replica(0)
    lb.remove_replica(0)  # idempotent
    lb.release("a")  # no error even if its replica is gone
    assert lb.replica_ids() == [5]
    assert lb.acquire("z") == 5
    lb.remove_replica(5)
    with pytest.raises(NoReplicaError, match="no rollout replica left to serve request 'q'"):
        lb.acquire("q")


def test_set_replicas_routes_to_exactly_the_given_ids():
    lb = LoadBalancer([0, 1])
    lb.acquire("a")
    on = lb.acquire("b")
    lb.set_replicas([on, 2])  # the pool replaced the other one by 2
    assert lb.replica_ids() == sorted([on, 2])
    assert lb.in_flight() == {on: 1, 2: 0}  # counts of the kept replica stay
    lb.set_replicas([on, 2])  # idempotent
    assert lb.in_flight() == {on: 1, 2: 0}
    assert lb.acquire("c") == 2


def test_balancer_checks_the_run_environment_when_given_one():
    with pytest.raises(RuntimeError, match="load balancer: .*REPRORL_TEST_UNSET is missing"):
        LoadBalancer([0], expected_env={"REPRORL_TEST_UNSET": "1"})


_SCRIPT = """
import json
from reprorl.rollout.load_balancer import LoadBalancer
out = []
for routing in ("least_loaded", "hash"):
    lb = LoadBalancer(%s, routing=routing)
    for i in range(40):
        out.append(lb.acquire(f"req-{i}"))
        if i %% 3 == 0:
            lb.release(f"req-{i // 2}")
print(json.dumps(out))
"""


def test_routing_is_equal_across_interpreters_and_hash_seeds():
    def run(replica_order, hashseed):
        env = dict(os.environ, PYTHONHASHSEED=hashseed)
        out = subprocess.run([sys.executable, "-c", _SCRIPT % replica_order], env=env, check=True,
                             capture_output=True, text=True)
        return json.loads(out.stdout)

    a = run("['r0', 'r1', 'r2', 'r3']", "1")
    b = run("['r3', 'r1', 'r0', 'r2']", "12345")
    assert a == b
    assert len(set(a)) == 4  # every replica got work: the test exercises real choices
    # And the same in this process.
    local = []
    for routing in ("least_loaded", "hash"):
        lb = LoadBalancer(["r2", "r0", "r3", "r1"], routing=routing)
        for i in range(40):
            local.append(lb.acquire(f"req-{i}"))
            if i % 3 == 0:
                lb.release(f"req-{i // 2}")
    assert local == a


# --- retries on real Ray actors ---------------------------------------------------------------


class _EchoReplica:
    """Stands in for a replica: the 'sample' is a pure function of the request's arguments."""

    def __init__(self, replica_id):
        self.replica_id = replica_id

    async def generate(self, request_id, prompt_ids, seed):
        return {"tokens": [stable_hash(seed, t) % 100 for t in prompt_ids], "served_by": self.replica_id}


def _kill_and_wait(actor, timeout_s=60.0):
    """`ray.kill` returns before the actor is gone, so a call sent right after may still be
    served (seen in CI): wait until a call fails, so the test's next step meets a dead actor."""
    import ray

    ray.kill(actor)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.generate.remote("probe", [1], 0), timeout=10)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.05)
    raise AssertionError(f"actor {actor} still answers {timeout_s} s after ray.kill")


@pytest.mark.slow  # starting Ray and 3 actors: 10-20 s here
def test_retry_after_a_replica_dies(ray_local):
    import ray

    from reprorl.rollout.load_balancer import LoadBalancerActor

    actors = {rid: ray.remote(num_cpus=0)(_EchoReplica).remote(rid) for rid in (0, 1, 2)}
    balancer = LoadBalancerActor.remote(sorted(actors))

    async def call(request_id):
        return await generate_balanced(balancer, actors, request_id, [1, 2, 3], seed=42)

    before = asyncio.run(call("req-a"))
    victim = before["served_by"]
    _kill_and_wait(actors[victim])
    # Sticky routing sends "req-a" to the dead replica first: it must die, be dropped and retry.
    after = asyncio.run(call("req-a"))
    assert after["served_by"] != victim
    assert after["tokens"] == before["tokens"]
    assert ray.get(balancer.replica_ids.remote()) == sorted(set(actors) - {victim})
    assert sum(ray.get(balancer.in_flight.remote()).values()) == 0

    for rid in set(actors) - {victim}:
        _kill_and_wait(actors[rid])
    with pytest.raises(NoReplicaError, match="died"):
        asyncio.run(call("req-b"))
    assert ray.get(balancer.replica_ids.remote()) == []


class _HangingReplica(_EchoReplica):
    """A replica whose generate never returns (a hung engine)."""

    async def generate(self, request_id, prompt_ids, seed):
        await asyncio.sleep(3600)


class _HangingBalancer(LoadBalancer):
    """A balancer actor whose acquire never returns."""

    def acquire(self, request_id, affinity=None):
        time.sleep(3600)


@pytest.mark.slow  # Ray's start and 3 actors: 10-20 s here
def test_a_hung_replica_is_dropped_after_the_limit_and_the_request_retried_elsewhere(ray_local):
    """Without a limit the request would wait on the hung replica forever: the limit ends the
    wait, drops the replica, and the sample comes from another, the same."""
    import ray

    from reprorl.rollout.load_balancer import LoadBalancerActor

    echo = ray.remote(num_cpus=0)(_EchoReplica).remote(1)
    actors = {0: ray.remote(num_cpus=0)(_HangingReplica).remote(0), 1: echo}
    balancer = LoadBalancerActor.remote(sorted(actors), "hash")
    expected = ray.get(echo.generate.remote("x", [1, 2, 3], 42))["tokens"]
    request = next(f"req-{i}" for i in range(100) if sorted(actors)[stable_hash(f"req-{i}") % 2] == 0)

    async def call(request_id, replicas):
        return await generate_balanced(balancer, replicas, request_id, [1, 2, 3], seed=42, timeout_s=1.0,
                                       balancer_timeout_s=10.0)

    t0 = time.monotonic()
    out = asyncio.run(call(request, actors))
    assert out == {"tokens": expected, "served_by": 1} and time.monotonic() - t0 < 10
    assert ray.get(balancer.replica_ids.remote()) == [1]
    assert sum(ray.get(balancer.in_flight.remote()).values()) == 0
    ray.get(balancer.set_replicas.remote([0]))
    with pytest.raises(NoReplicaError, match=r"failed on 1 replicas, each of which died or hung: 0 \(no answer "
                                             r"within 1 s\)"):
        asyncio.run(call("req-b", {0: actors[0]}))

    hung = ray.remote(num_cpus=0)(_HangingBalancer).remote([1])
    with pytest.raises(BalancerError, match="the load balancer gave no answer to acquire within 1 s"):
        asyncio.run(generate_balanced(hung, {1: echo}, "req-c", [1], seed=1, balancer_timeout_s=1.0))
    for a in (*actors.values(), balancer, hung):
        ray.kill(a)


def test_affinity_keeps_the_copies_of_a_prompt_on_one_replica_while_any_is_in_flight():
    lb = LoadBalancer([0, 1, 2])
    first = lb.acquire("p0-0", affinity="prompt-0")
    copies = [lb.acquire(f"p0-{j}", affinity="prompt-0") for j in range(1, 8)]
    assert copies == [first] * 7 and lb.in_flight()[first] == 8
    other = lb.acquire("p1-0", affinity="prompt-1")  # another prompt: least loaded, elsewhere
    assert other != first
    for j in range(8):
        lb.release(f"p0-{j}")
    # None in flight: the key is forgotten, its next request is routed by load (a tie of the two idle ones).
    idle = sorted({0, 1, 2} - {other})
    assert lb.acquire("p0-8", affinity="prompt-0") == idle[stable_hash("p0-8") % 2]


def test_affinity_yields_to_stickiness_and_forgets_a_removed_replica():
    lb = LoadBalancer([0, 1, 2])
    a = lb.acquire("turn")
    h = lb.acquire("hold", affinity="k")  # least loaded: not a
    lb.release("turn")
    assert h != a and lb.acquire("turn", affinity="k") == a  # a request's later turn keeps its replica
    lb.release("turn")
    lb.remove_replica(h)  # k's replica died
    n = lb.acquire("hold2", affinity="k")  # routed by load again, and k now lives on n
    lb.release("hold")  # released after the removal: must not count down k's new group
    other = ({0, 1, 2} - {h, n}).pop()
    assert lb.in_flight()[n] == 1 and lb.in_flight()[other] == 0
    assert lb.acquire("hold3", affinity="k") == n  # by load it would have been `other`
