"""The device weight path (reprorl/trainer/weight_sync.py) on one CUDA GPU: an actor worker and a
built-in replica sharing it through Ray GPU fractions, as the one-GPU placement puts them.

The actor loads another tiny policy than the replica (same shapes, other seed), so a push
changes every parameter but the norms' (1 at init in both). After a CUDA IPC push the replica serves the actor's bf16 weights
bit for bit (per-parameter digests: dtype, shape and bytes), at the pushed version, and
samples exactly what it samples after the same weights come through the host; a push
while awake keeps the captured CUDA graphs valid (the copy is in place: the sample under
the old graphs equals the one under graphs captured after); the fit loop's order works
(sleep keeping the weights but giving back the KV cache's memory, push, wake); the
actor's GPU memory is the same after the pushes as before (every share released, nothing
left in torch's IPC limbo); a replica replaced after a device push is brought up with the
actor's weights from the host.
Seconds of GPU time. Skipped without CUDA.
"""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPT = [1, 40, 41, 42, 2, 8, 1, 60, 8]


@pytest.fixture(scope="module")
def parts(tmp_path_factory, ray_local):
    from reprorl.models.tiny import make_tiny
    from reprorl.rollout.replica import ReplicaPool
    from reprorl.actors.supervision import Restarts
    from reprorl.workers.group import WorkerGroup
    from reprorl.workers.optim import OptimArgs

    root = tmp_path_factory.mktemp("weight_sync_gpu")
    replica_model = make_tiny(root / "replica", kind="policy", seed=0)
    actor_model = make_tiny(root / "actor", kind="policy", seed=1)
    actor = WorkerGroup("actor", 1, actor_model, optim=OptimArgs(lr=1e-3), seed=1, full_determinism=True,
                        dtype="bfloat16", device="cuda", num_gpus=0.4)
    pool = None
    try:
        pool = ReplicaPool(replica_model, 1, seed=5, full_determinism=True, max_num_seqs=8,
                           max_num_batched_tokens=256, max_model_len=128, device="cuda", dtype="bfloat16",
                           num_gpus=0.4, native_options={"gpu_memory_utilization": 0.05}, restarts=Restarts(1))
        yield actor, pool
    finally:
        if pool is not None:
            pool.shutdown()
        actor.shutdown()


def _generate(pool, request_id):
    import ray

    from reprorl.rollout.request import SamplingParams

    replica = pool.replicas[pool.replica_ids()[0]]
    params = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    return ray.get(replica.generate.remote(request_id, PROMPT, params, 1234, 0))


def _actor_gpu_bytes(actor) -> int:
    import ray

    # Ray's __ray_call__ runs the function on the actor's instance: torch's count in rank 0's process.
    return ray.get(actor.workers[0].__ray_call__.remote(lambda worker: torch.cuda.memory_allocated()))


def _replica_gpu_reserved(pool) -> int:
    import ray

    replica = pool.replicas[pool.replica_ids()[0]]
    return ray.get(replica.__ray_call__.remote(lambda r: torch.cuda.memory_reserved()))


def _assert_same_sample(a, b):
    assert a.token_ids == b.token_ids and len(a.token_ids) == 24
    assert torch.equal(torch.tensor(a.log_probs), torch.tensor(b.log_probs))


def test_device_push_serves_the_actors_bf16_weights_bit_for_bit(parts):
    from reprorl.trainer import weight_sync

    actor, pool = parts
    on_device = weight_sync.device_replicas(actor, pool)
    assert on_device == [0]  # the same physical GPU
    want = actor.weight_digests()
    assert all(t.dtype == torch.bfloat16 for _, t in actor.named_weights())
    before = pool.weight_digests()[0]
    # Every parameter but the norms' changes (both policies' norm weights start at 1).
    assert list(before) == list(want)
    assert {n for n in want if before[n] != want[n]} == {n for n in want if "norm" not in n}
    memory_before = _actor_gpu_bytes(actor)
    graph_steps = pool.stats()[0]["graph_steps"]

    # Awake (the resume path): in place, under the graphs captured at start.
    weight_sync.push_weights(actor, pool, 1, on_device)
    assert pool.weight_versions() == {0: 1}
    assert pool.weight_digests()[0] == want
    by_ipc = _generate(pool, "ipc")
    assert by_ipc.weight_version == 1
    assert pool.stats()[0]["graph_steps"] > graph_steps  # the decode steps replayed the old graphs

    # The fit loop's order: sleep keeping the weights, push, wake (graphs captured again).
    awake = _replica_gpu_reserved(pool)
    pool.sleep(keep_weights=True)
    assert _replica_gpu_reserved(pool) < awake  # the KV cache and the graphs' memory went back to the GPU
    weight_sync.push_weights(actor, pool, 2, on_device)
    pool.wake_up()
    assert pool.weight_versions() == {0: 2} and pool.weight_digests()[0] == want
    _assert_same_sample(_generate(pool, "ipc-after-sleep"), by_ipc)

    # The same weights through the host: the same sample, bit for bit.
    pool.update_weights(actor.named_weights(), version=3)
    _assert_same_sample(_generate(pool, "host"), by_ipc)
    assert _actor_gpu_bytes(actor) == memory_before  # every share's buffer freed


def test_a_replica_replaced_after_a_device_push_gets_the_actors_weights(parts):
    import ray

    from reprorl.trainer import weight_sync

    actor, pool = parts
    weight_sync.push_weights(actor, pool, pool.version + 1, weight_sync.device_replicas(actor, pool))
    by_ipc = _generate(pool, "before-death")
    ray.kill(pool.replicas[0])
    assert len(pool.replace_dead()) == 1  # brought up from the model path, then from actor.named_weights
    assert pool.weight_digests()[pool.replica_ids()[0]] == actor.weight_digests()
    _assert_same_sample(_generate(pool, "replacement"), by_ipc)
