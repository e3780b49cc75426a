"""What both replica pools share (reprorl/actors/pool.py): their argument checks, the
start-up wait that names the pool instead of hanging when Ray cannot place a replica, and
a failed start that leaves none of the pool's actors alive."""

import pytest

POOLS = [("reprorl.rollout.replica", "ReplicaPool", "RolloutReplica"),
         ("reprorl.reward.reward_model", "RewardModelPool", "RewardReplica")]


@pytest.mark.parametrize("module, name, _", POOLS)
def test_both_pools_refuse_bad_counts_and_backends_naming_themselves(module, name, _, monkeypatch):
    import importlib

    from reprorl.actors import pool as pool_module

    cls = getattr(importlib.import_module(module), name)
    monkeypatch.setattr(pool_module, "init_ray", lambda *a: pytest.fail("Ray started before the checks"))
    with pytest.raises(ValueError, match=rf"^{name}: num_replicas=0; expected >= 1$"):
        cls("unused", 0, seed=0, full_determinism=True)
    with pytest.raises(ValueError, match=rf"^{name}: backend='sglang'; expected 'native' or 'vllm'$"):
        cls("unused", 1, seed=0, full_determinism=True, backend="sglang")


class _Replica:
    def ready(self) -> int:
        return 0


@pytest.mark.slow  # Ray's start: 5-15 s here
def test_wait_for_actors_names_the_pool_and_the_cpus_when_ray_cannot_place_a_replica(ray_local):
    from reprorl.actors.pool import wait_for_actors

    ray = ray_local
    placed = ray.remote(_Replica).options(num_cpus=0).remote()
    never = ray.remote(_Replica).options(num_cpus=64).remote()  # more than the 2 CPUs of ray_local
    try:
        wait_for_actors([placed], "test replicas", 0.0, timeout_s=60)  # answers: returns
        with pytest.raises(RuntimeError, match=r"^test replicas: 1 of 2 replicas not ready after 1 s; each asks "
                                               r"for 64 CPU and Ray has [0-9.]+ free \(another pool may hold them\)$"):
            wait_for_actors([placed, never], "test replicas", 64, timeout_s=1)
    finally:
        ray.kill(placed)
        ray.kill(never)


class _FailingReplica:
    """A pool's replica (`replica_cls(replica_id, model_path, options, expected_env)`) whose
    constructor fails for replica 1 only."""

    def __init__(self, replica_id: int, model_path: str, options: dict, expected_env: dict) -> None:
        if replica_id == 1:
            raise ValueError(f"replica {replica_id} cannot load {model_path}")

    def ready(self) -> int:
        return 0


class _HealthyReplica(_FailingReplica):
    def __init__(self, replica_id: int, model_path: str, options: dict, expected_env: dict) -> None:
        pass


def _started_actors(monkeypatch) -> list:
    """The handles of every actor a pool starts from now on (the pool is never returned when it fails)."""
    from reprorl.actors.pool import ReplicaPoolBase

    started, start = [], ReplicaPoolBase._start

    def record(self, replica_id):
        started.append(start(self, replica_id))
        return started[-1]

    monkeypatch.setattr(ReplicaPoolBase, "_start", record)
    return started


@pytest.mark.slow  # Ray's start and two replica processes: 10-20 s here
@pytest.mark.parametrize("module, name, replica", POOLS)
def test_a_pool_whose_replica_fails_to_start_raises_its_error_and_kills_every_replica(module, name, replica,
                                                                                      ray_local, actor_dead,
                                                                                      monkeypatch):
    """Replica 1's constructor fails: the pool's constructor raises that error, and replica 0,
    which started fine, is killed with it (nobody holds the pool to shut it down)."""
    import importlib

    ray = ray_local
    monkeypatch.setattr(importlib.import_module(module), replica, _FailingReplica)
    started = _started_actors(monkeypatch)
    pool_cls = getattr(importlib.import_module(module), name)
    with pytest.raises(ray.exceptions.ActorDiedError, match=r"(?s)creation task.*ValueError: replica 1 cannot "
                                                            r"load no-model"):
        pool_cls("no-model", 2, seed=0, full_determinism=True, num_cpus_per_replica=0)
    assert len(started) == 2
    assert [actor_dead(a) for a in started] == [True, True]


@pytest.mark.slow  # Ray's start: 5-15 s here
def test_a_pool_that_ray_cannot_place_in_time_kills_its_replicas_placed_or_not(ray_local, actor_dead, monkeypatch):
    """Each of 2 replicas asks for 1.5 of Ray's 2 CPUs: one may start, the other stays pending.
    After `wait_ready`'s timeout, neither is left: the pending one would take the CPUs the
    moment they are free, the placed one holds them."""
    from reprorl.actors import pool as pool_module
    from reprorl.rollout.replica import ReplicaPool

    monkeypatch.setattr("reprorl.rollout.replica.RolloutReplica", _HealthyReplica)
    monkeypatch.setattr(pool_module, "READY_TIMEOUT_S", 1.0)
    started = _started_actors(monkeypatch)
    pool = ReplicaPool("no-model", 2, seed=0, full_determinism=True, num_cpus_per_replica=1.5, wait=False)
    with pytest.raises(RuntimeError, match=r"^rollout replicas: [12] of 2 replicas not ready after 1 s; each asks "
                                           r"for 1.5 CPU"):
        pool.wait_ready()
    assert [actor_dead(a) for a in started] == [True, True]
    assert pool.replicas == {}
    with pytest.raises(RuntimeError, match="the rollout replicas were stopped when their start failed"):
        pool.wait_ready()  # a second wait names what happened
    pool.shutdown()  # what the trainer's `Parts.stop` then does: nothing left to stop
