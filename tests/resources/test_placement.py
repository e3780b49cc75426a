"""Placement (reprorl/resources/placement.py): `resources.device` resolved, each process's GPU and Ray share
on 1 to 8 GPUs (the planner, given the GPU count), and the cluster check."""

from pathlib import Path

import pytest
import torch

from reprorl.config import load_config
from reprorl.errors import ConfigError
from reprorl.resources.placement import (
    CPU_SLOT,
    RAY_GPU_RESOLUTION,
    check_cluster_gpus,
    plan_placement,
    plan_run,
    resolve_device,
)

PARTS = {"actor_workers": 1, "ref_workers": 1, "critic_workers": 1, "rollout_replicas": 3, "rollout_share": 0.3}


@pytest.fixture
def has_cuda(monkeypatch):
    """Pretend torch sees a GPU (placement only asks `torch.cuda.is_available`)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_the_default_config_resolves_to_the_cpu_here():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: auto resolves to cuda")
    cfg = load_config(None, [])
    assert cfg.resources.device == "auto"  # resolved at run start, so config files stay portable
    assert resolve_device(cfg.resources.device) == "cpu"
    plan = plan_placement("cpu", **PARTS)
    assert (plan.device, plan.num_gpus) == ("cpu", 0)
    assert plan.actor == plan.ref == plan.critic == (CPU_SLOT,) and plan.rollout == (CPU_SLOT,) * 3


def test_auto_is_cuda_when_torch_sees_a_gpu(has_cuda):
    assert resolve_device("auto") == "cuda"


def test_cuda_without_a_gpu_names_the_key(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"resources.device=cuda"):
        resolve_device("cuda")


def shares(slots):
    return {s.share for s in slots}


def gpu_load(plan):
    """Each GPU's summed Ray share."""
    load = [0.0] * plan.num_gpus
    for part in ("actor", "ref", "critic", "reward", "rollout"):
        for slot in getattr(plan, part):
            load[slot.gpu] += slot.share
    return load


def test_one_gpu_shares_add_up_to_at_most_one_gpu():
    plan = plan_placement("cuda", **PARTS)
    assert plan.num_gpus == 1
    assert shares(plan.rollout) == {0.1}
    assert shares(plan.actor) == shares(plan.ref) == shares(plan.critic) == {0.2333}
    assert gpu_load(plan)[0] <= 1.0
    for share in (0.1, 0.2333):  # whole multiples of Ray's resolution
        assert round(share / RAY_GPU_RESOLUTION, 6).is_integer()
    assert all(s.gpu == 0 for part in ("actor", "ref", "critic", "rollout") for s in getattr(plan, part))


def test_reward_replicas_take_a_trainer_side_share_each():
    plan = plan_placement("cuda", **PARTS, reward_replicas=2)
    assert shares(plan.rollout) == {0.1}  # the engines' share does not change
    assert shares(plan.actor) == shares(plan.reward) == {0.14}  # 0.7 over 3 workers + 2 reward replicas
    assert gpu_load(plan)[0] <= 1.0
    assert plan_placement("cuda", **PARTS).reward == ()  # no reward model: no share


def test_reward_shares_round_down():
    # 0.7 over 1 worker + 2 reward replicas = 0.2333...: floored, so the sum stays under one GPU.
    plan = plan_placement("cuda", **{**PARTS, "ref_workers": 0, "critic_workers": 0}, reward_replicas=2)
    assert shares(plan.actor) == shares(plan.reward) == {0.2333}
    assert gpu_load(plan)[0] <= 1.0


def test_on_the_cpu_a_reward_model_takes_no_gpu():
    plan = plan_placement("cpu", **PARTS, reward_replicas=2)
    assert plan.reward == (CPU_SLOT, CPU_SLOT) and plan.summary() == {"device": "cpu", "num_gpus": 0}


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
def test_colocated_one_rank_of_each_group_per_gpu(gpus):
    """Rank r of every group on GPU r; 2 replicas a GPU, dealt round-robin; every GPU's
    shares within one GPU and the same on each GPU."""
    plan = plan_placement("cuda", actor_workers=gpus, ref_workers=gpus, critic_workers=gpus,
                          rollout_replicas=2 * gpus, rollout_share=0.3, reward_replicas=gpus)
    assert plan.num_gpus == gpus
    for part in ("actor", "ref", "critic", "reward"):
        assert [s.gpu for s in getattr(plan, part)] == list(range(gpus))
    assert [s.gpu for s in plan.rollout] == [i % gpus for i in range(2 * gpus)]
    assert shares(plan.rollout) == {0.15} and shares(plan.actor) == shares(plan.reward) == {0.175}
    assert gpu_load(plan) == [pytest.approx(1.0)] * gpus and max(gpu_load(plan)) <= 1.0
    for gpu in range(gpus):
        assert plan.parts_on(gpu) == {"actor": 1, "ref": 1, "critic": 1, "reward": 1, "rollout": 2}


def test_uneven_replicas_take_the_busiest_gpus_share():
    """5 replicas on 4 GPUs: GPU 0 holds two, so every replica takes half the rollout share."""
    plan = plan_placement("cuda", actor_workers=4, ref_workers=0, critic_workers=0, rollout_replicas=5,
                          rollout_share=0.3)
    assert [s.gpu for s in plan.rollout] == [0, 1, 2, 3, 0]
    assert shares(plan.rollout) == {0.15} and shares(plan.actor) == {0.7}
    assert max(gpu_load(plan)) <= 1.0
    assert plan.parts_on(0) == {"actor": 1, "rollout": 2} and plan.parts_on(1) == {"actor": 1, "rollout": 1}


@pytest.mark.parametrize("trainer_gpus,rollout_gpus", [(1, 1), (2, 2), (4, 4), (4, 2), (2, 1)])
def test_rollout_on_gpus_of_its_own(trainer_gpus, rollout_gpus):
    """The trainer's ranks on GPUs 0..T-1 with the whole GPU, the replicas on T.. with theirs."""
    replicas = 2 * rollout_gpus
    plan = plan_placement("cuda", actor_workers=trainer_gpus, ref_workers=trainer_gpus, critic_workers=0,
                          rollout_replicas=replicas, rollout_share=0.3, rollout_gpus=rollout_gpus)
    assert plan.num_gpus == trainer_gpus + rollout_gpus
    assert [s.gpu for s in plan.rollout] == [trainer_gpus + i % rollout_gpus for i in range(replicas)]
    assert shares(plan.actor) == shares(plan.ref) == {0.5} and shares(plan.rollout) == {0.5}
    assert set(gpu_load(plan)) == {1.0}
    assert plan.parts_on(trainer_gpus) == {"rollout": 2} and plan.parts_on(0) == {"actor": 1, "ref": 1}


def test_a_rollout_gpu_without_a_replica_names_the_keys():
    with pytest.raises(ConfigError, match=r"resources.rollout_gpus=3 with rollout.num_replicas=2"):
        plan_placement("cuda", actor_workers=1, ref_workers=0, critic_workers=0, rollout_replicas=2,
                       rollout_share=0.3, rollout_gpus=3)


def test_more_gpus_than_the_cluster_has_names_the_keys():
    plan = plan_placement("cuda", actor_workers=4, ref_workers=0, critic_workers=0, rollout_replicas=2,
                          rollout_share=0.3, rollout_gpus=2)
    check_cluster_gpus(plan, 6)  # enough
    with pytest.raises(ConfigError, match=r"^trainer.num_workers=4 \+ resources.rollout_gpus=2: the run takes 6 GPUs"
                                          r".* the Ray cluster has 4;"):
        check_cluster_gpus(plan, 4)
    colocated = plan_placement("cuda", actor_workers=8, ref_workers=0, critic_workers=0, rollout_replicas=8,
                               rollout_share=0.3)
    with pytest.raises(ConfigError, match=r"^trainer.num_workers=8: the run takes 8 GPUs .* has 1;"):
        check_cluster_gpus(colocated, 1)


def test_plan_run_follows_the_config(tmp_path):
    """A KL term adds the reference group (not with LoRA), GAE the critic, a reward model its pool."""
    cfg = load_config(None, ["trainer.num_workers=2", "actor.use_kl_loss=true", "algorithm.adv_estimator=gae",
                             f"reward.model_path={tmp_path}", "reward.num_replicas=2", "rollout.num_replicas=4"])
    plan = plan_run(cfg, lora=False, device="cuda")
    assert (len(plan.actor), len(plan.ref), len(plan.critic), len(plan.reward), len(plan.rollout)) == (2, 2, 2, 2, 4)
    assert plan_run(cfg, lora=True, device="cuda").ref == ()
    assert plan_run(cfg, lora=False, device="cpu").num_gpus == 0


def test_gpu_example_resolves_and_asks_for_cuda_and_bf16():
    cfg = load_config(str(Path(__file__).parents[2] / "examples" / "gpu_arithmetic.yaml"), [])
    assert (cfg.resources.device, cfg.model.dtype, cfg.full_determinism) == ("cuda", "bfloat16", True)
