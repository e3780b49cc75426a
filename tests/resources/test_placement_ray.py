"""The placement of a run on several GPUs, on Ray (reprorl/resources/placement.py): the run's
placement group reserves one bundle a GPU, and each process lands on its slot's GPU, a
pool's replacement on its dead replica's GPU.

No GPU is needed: a local Ray told it has 4 GPUs places actors on them as on real ones
(it assigns their ids and sets CUDA_VISIBLE_DEVICES), which is all placement decides.
"""

import pytest

from reprorl.errors import ConfigError
from reprorl.resources.placement import plan_placement, ray_options, reserve_gpus

pytestmark = pytest.mark.slow  # a Ray of its own: 5-15 s to start on 2 cores

GPUS = 4


@pytest.fixture(scope="module")
def ray_with_gpus():
    """A local Ray with 4 (pretend) GPUs, for this module alone: a Ray left up by an earlier
    module is stopped first, and this one after the module (the next starts its own)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=2, num_gpus=GPUS, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


class _Probe:
    """A process that says which GPUs Ray gave it; also a pool's replica
    (`replica_cls(replica_id, model_path, options, expected_env)`)."""

    def __init__(self, *args) -> None:
        pass

    def ready(self) -> int:
        return 0

    def determinism_info(self) -> dict:
        return {}

    def gpu_ids(self) -> list:
        import ray

        return ray.get_gpu_ids()


def test_each_process_lands_on_its_slots_gpu(ray_with_gpus):
    """2 trainer GPUs (actor and reference ranks) and 2 rollout GPUs of 3 replicas: processes
    of one slot GPU share a physical GPU, those of different ones never do."""
    ray = ray_with_gpus
    plan = plan_placement("cuda", actor_workers=2, ref_workers=2, critic_workers=0, rollout_replicas=3,
                          rollout_share=0.3, rollout_gpus=2)
    group = reserve_gpus(plan)
    try:
        slots = [*plan.actor, *plan.ref, *plan.rollout]
        probes = [ray.remote(_Probe).options(num_cpus=0, **ray_options(slot, group)).remote() for slot in slots]
        ids = ray.get([p.gpu_ids.remote() for p in probes], timeout=120)
        assert all(len(i) == 1 for i in ids), ids  # a fraction of one GPU each
        physical = {}
        for slot, (gpu,) in zip(slots, ids):
            assert physical.setdefault(slot.gpu, gpu) == gpu  # one slot GPU, one physical GPU
        assert len(set(physical.values())) == plan.num_gpus == 4
        assert sorted(physical) == [0, 1, 2, 3]
        for probe in probes:
            ray.kill(probe)
    finally:
        ray.util.remove_placement_group(group)


def test_a_replacement_keeps_its_dead_replicas_gpu(ray_with_gpus, monkeypatch):
    """A reward-model pool of 3 replicas over 3 GPUs: replica 1 is killed and replaced; the
    new one is on replica 1's GPU, and the others stay where they were."""
    import ray

    from reprorl.reward import reward_model
    from reprorl.actors import pool as pool_module
    from reprorl.actors.supervision import Restarts

    monkeypatch.setattr(reward_model, "RewardReplica", _Probe)
    # A replacement on another GPU would wait for a GPU share that is never free: fail soon.
    monkeypatch.setattr(pool_module, "READY_TIMEOUT_S", 30.0)
    plan = plan_placement("cuda", actor_workers=1, ref_workers=0, critic_workers=0, rollout_replicas=3,
                          rollout_share=0.3, rollout_gpus=3)
    group = reserve_gpus(plan)
    try:
        scheduling = [ray_options(slot, group)["scheduling_strategy"] for slot in plan.rollout]
        pool = reward_model.RewardModelPool("no-model", 3, seed=0, full_determinism=True, num_cpus_per_replica=0,
                                            num_gpus=plan.rollout[0].share, scheduling=scheduling,
                                            restarts=Restarts(1))
        before = {i: ray.get(r.gpu_ids.remote(), timeout=60) for i, r in pool.replicas.items()}
        assert len({tuple(v) for v in before.values()}) == 3
        ray.kill(pool.replicas[1])
        replaced = pool._replace_dead([1], "a test")
        assert replaced == {1: 3}
        after = {i: ray.get(r.gpu_ids.remote(), timeout=60) for i, r in pool.replicas.items()}
        assert after == {0: before[0], 2: before[2], 3: before[1]}
        pool.shutdown()
    finally:
        ray.util.remove_placement_group(group)


def test_reserving_more_gpus_than_the_cluster_has_names_the_keys(ray_with_gpus):
    plan = plan_placement("cuda", actor_workers=4, ref_workers=0, critic_workers=0, rollout_replicas=2,
                          rollout_share=0.3, rollout_gpus=2)
    with pytest.raises(ConfigError, match=r"^trainer.num_workers=4 \+ resources.rollout_gpus=2: the run takes 6 "
                                          r"GPUs .* the Ray cluster has 4;"):
        reserve_gpus(plan)
    one = plan_placement("cuda", actor_workers=1, ref_workers=0, critic_workers=0, rollout_replicas=2,
                         rollout_share=0.3)
    assert reserve_gpus(one) is None  # one GPU: plain fractions, as always
