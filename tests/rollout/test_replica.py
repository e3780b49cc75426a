"""Rollout replicas on a local Ray: the environment check, versioned weights, death and retry.

The tests on a replica pool are slow: starting 3 replica actors takes 20-40 s on 2 cores.
"""

import asyncio

import pytest
import torch

from reprorl.determinism import determinism_env
from reprorl.rollout.request import SamplingParams

PARAMS = SamplingParams(temperature=1.0, max_tokens=12)
PROMPT = [1, 40, 41, 42, 2, 8, 1, 60, 8]


@pytest.fixture(scope="module")
def model_dir(tiny_policy_dir):
    return str(tiny_policy_dir)


@pytest.fixture(scope="module")
def pool(model_dir, ray_local):
    from reprorl.rollout.replica import ReplicaPool

    p = ReplicaPool(model_dir, 3, seed=5, full_determinism=True, max_num_seqs=8, max_num_batched_tokens=256)
    yield p
    p.shutdown()


def _gen(replica, request_id, seed, prompt=PROMPT, params=PARAMS):
    import ray

    return ray.get(replica.generate.remote(request_id, prompt, params, seed, 0))


def test_replica_without_the_env_fails_naming_the_variable(model_dir, ray_local):
    from reprorl.rollout.replica import RolloutReplica

    expected = {"REPRORL_TEST_NOT_SET": "1"}
    with pytest.raises(RuntimeError, match="rollout replica 4: .*REPRORL_TEST_NOT_SET is missing"):
        RolloutReplica(4, model_dir, {"batch_invariant": True}, expected)


@pytest.mark.slow
def test_replica_actor_without_runtime_env_fails_naming_the_variable(model_dir, pool):
    import ray

    from reprorl.rollout.replica import RolloutReplica

    env = determinism_env(5, full_determinism=True)
    bare = ray.remote(RolloutReplica).options(num_cpus=0).remote(7, model_dir, {"batch_invariant": True}, env)
    with pytest.raises(Exception) as info:  # Ray wraps the constructor's error in ActorDiedError
        ray.get(bare.ready.remote())
    message = str(info.value)
    assert "rollout replica 7" in message
    assert "REPRORL_FULL_DETERMINISM is missing (expected '1')" in message


@pytest.mark.slow
def test_every_replica_gives_the_same_sample(pool):
    outs = [_gen(pool.replicas[i], f"same-{i}", seed=123) for i in pool.replica_ids()]
    assert len(outs[0].token_ids) > 0
    for o in outs[1:]:
        assert o.token_ids == outs[0].token_ids
        assert torch.equal(torch.tensor(o.log_probs), torch.tensor(outs[0].log_probs))
    other = _gen(pool.replicas[0], "other-seed", seed=124)
    assert other.token_ids != outs[0].token_ids


@pytest.mark.slow
def test_weight_versions(pool, model_dir):
    import ray

    from reprorl.models.hf_io import load_model
    from reprorl.rollout.replica import WeightVersionError

    model, _ = load_model(model_dir)
    original = {name: p.detach().clone() for name, p in model.named_parameters()}
    before = _gen(pool.replicas[1], "w0", seed=9)

    g = torch.Generator().manual_seed(0)
    perturbed = [(n, t + 0.5 * torch.randn(t.shape, generator=g)) for n, t in original.items()]
    pool.update_weights(perturbed, version=1)
    assert pool.weight_versions() == {0: 1, 1: 1, 2: 1}
    changed = [_gen(pool.replicas[i], f"w1-{i}", seed=9) for i in pool.replica_ids()]
    assert changed[0].token_ids != before.token_ids
    assert changed[0].weight_version == 1
    assert all(c.token_ids == changed[0].token_ids for c in changed)

    # Back to the original weights as version 2: the samples are the original ones, bit for bit.
    pool.update_weights(original.items(), version=2)
    after = _gen(pool.replicas[2], "w2", seed=9)
    assert after.token_ids == before.token_ids
    assert torch.equal(torch.tensor(after.log_probs), torch.tensor(before.log_probs))

    # One replica ahead of the others: the check names the ones left behind.
    ray.get(pool.replicas[1].update_weights.remote(list(original.items()), 3))
    with pytest.raises(WeightVersionError, match="expected 3.*replica 0 serves 2, replica 2 serves 2"):
        pool.check_weight_version(3)
    pool.update_weights([], version=4)  # version only: every replica on 4 again
    with pytest.raises(Exception, match="version 4 must be greater than the current 4"):
        pool.update_weights([], version=4)


@pytest.mark.slow
def test_sleep_wake_stats_abort(pool):
    import ray

    pool.sleep()
    with pytest.raises(Exception, match="asleep"):
        _gen(pool.replicas[0], "asleep", seed=1)
    pool.wake_up()
    assert len(_gen(pool.replicas[0], "awake", seed=1).token_ids) > 0
    stats = pool.stats()
    assert [s["replica_id"] for s in stats] == [0, 1, 2]
    assert stats[0]["tokens_generated"] > 0 and stats[0]["running"] == 0
    assert ray.get(pool.replicas[0].abort.remote("not-in-flight")) is False


@pytest.mark.slow
def test_shared_push_without_shares_is_the_host_push(pool, model_dir):
    """No replica on the trainer's GPU (here: none has a GPU): `update_weights_shared` gives
    every replica `host_weights()`, fetched once, and each serves exactly those bits, also
    after a sleep that kept the weights in place."""
    from reprorl.fingerprint import tensor_digests
    from reprorl.models.hf_io import load_model

    assert pool.gpu_uuids() == {0: None, 1: None, 2: None}
    model, _ = load_model(model_dir)
    original = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    g = torch.Generator().manual_seed(1)
    perturbed = [(n, t + 0.25 * torch.randn(t.shape, generator=g)) for n, t in original]
    calls = []

    def host_weights():
        calls.append("host_weights")
        return perturbed

    version = pool.version + 1
    pool.update_weights_shared({}, version, host_weights=host_weights)
    assert calls == ["host_weights"] and pool.weight_versions() == {0: version, 1: version, 2: version}
    want = tensor_digests(perturbed)
    assert want != tensor_digests(original)
    assert pool.weight_digests() == {0: want, 1: want, 2: want}
    pool.sleep(keep_weights=True)
    pool.wake_up()
    assert pool.weight_digests() == {0: want, 1: want, 2: want}
    pool.update_weights(original, version=version + 1)  # back to the checkpoint for the tests after


@pytest.mark.slow
def test_retry_after_a_replica_dies(pool):
    """Kill the replica a request is sticky to: the retry on another gives the same sample."""
    import ray

    from reprorl.rollout.load_balancer import LoadBalancer, generate_balanced

    balancer = LoadBalancer(pool.replica_ids())

    async def call():
        return await generate_balanced(balancer, pool.replicas, "req-kill", PROMPT, PARAMS, 77, 0)

    before = asyncio.run(call())
    victim = balancer._sticky["req-kill"]
    ray.kill(pool.replicas[victim])
    after = asyncio.run(call())
    assert balancer.replica_ids() == sorted(set(pool.replica_ids()) - {victim})
    assert balancer._sticky["req-kill"] != victim
    assert after.token_ids == before.token_ids
    assert torch.equal(torch.tensor(after.log_probs), torch.tensor(before.log_probs))
