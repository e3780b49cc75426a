"""What both replica pools share (reprorl/rollout/pool.py): their argument checks, and the
start-up wait that names the pool instead of hanging when Ray cannot place a replica."""

import pytest


@pytest.mark.parametrize("module, name", [("reprorl.rollout.replica", "ReplicaPool"),
                                          ("reprorl.reward.reward_model", "RewardModelPool")])
def test_both_pools_refuse_bad_counts_and_backends_naming_themselves(module, name, monkeypatch):
    import importlib

    from reprorl.rollout import pool as pool_module

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
def test_wait_ready_names_the_pool_and_the_cpus_when_ray_cannot_place_a_replica(ray_local):
    from reprorl.rollout.pool import wait_ready

    ray = ray_local
    placed = ray.remote(_Replica).options(num_cpus=0).remote()
    never = ray.remote(_Replica).options(num_cpus=64).remote()  # more than the 2 CPUs of ray_local
    try:
        wait_ready([placed], "test replicas", 0.0, timeout_s=60)  # answers: returns
        with pytest.raises(RuntimeError, match=r"^test replicas: 1 of 2 replicas not ready after 1 s; each asks "
                                               r"for 64 CPU and Ray has [0-9.]+ free \(another pool may hold them\)$"):
            wait_ready([placed, never], "test replicas", 64, timeout_s=1)
    finally:
        ray.kill(placed)
        ray.kill(never)
