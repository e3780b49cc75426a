"""The tiny policy's path (conftest.py's, as a string) and rollout replica pools (per module) for the
agent-loop tests."""

import pytest


@pytest.fixture(scope="session")
def tiny_policy(tiny_policy_dir):
    return str(tiny_policy_dir)


@pytest.fixture(scope="module")
def pools(tiny_policy, ray_local):
    """{1: a one-replica pool, 3: a three-replica pool}, full determinism on, run seed 1234."""
    from reprorl.rollout.replica import ReplicaPool

    made = {n: ReplicaPool(tiny_policy, n, seed=1234, full_determinism=True, max_num_seqs=16,
                           max_num_batched_tokens=512, wait=False) for n in (1, 3)}
    for pool in made.values():  # started together, their replicas' start-ups overlap
        pool.wait_ready()
    yield made
    for p in made.values():
        p.shutdown()
