"""Placement (reprorl/trainer/placement.py): `resources.device` resolved, the Ray GPU shares."""

from pathlib import Path

import pytest
import torch

from reprorl.config import load_config
from reprorl.errors import ConfigError
from reprorl.trainer import placement
from reprorl.trainer.placement import RAY_GPU_RESOLUTION, plan_placement

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
    assert plan_placement(cfg.resources.device, **PARTS) == placement.Placement("cpu", 0.0, 0.0, 0.0)


def test_auto_is_cuda_when_torch_sees_a_gpu(has_cuda):
    assert plan_placement("auto", **PARTS).device == "cuda"


def test_cuda_without_a_gpu_names_the_key(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"resources.device=cuda"):
        plan_placement("cuda", **PARTS)


def test_gpu_shares_add_up_to_at_most_one_gpu(has_cuda):
    plan = plan_placement("cuda", **PARTS)
    assert plan.rollout_gpus == 0.1
    assert plan.worker_gpus == 0.2333
    assert 3 * plan.worker_gpus + 3 * plan.rollout_gpus <= 1.0
    for share in (plan.worker_gpus, plan.rollout_gpus):  # whole multiples of Ray's resolution
        assert round(share / RAY_GPU_RESOLUTION, 6).is_integer()


def test_reward_replicas_take_a_trainer_side_share_each(has_cuda):
    plan = plan_placement("cuda", **PARTS, reward_replicas=2)
    assert plan.rollout_gpus == 0.1  # the engines' share does not change
    assert plan.worker_gpus == plan.reward_gpus == 0.14  # 0.7 over 3 workers + 2 reward replicas
    assert 3 * plan.worker_gpus + 2 * plan.reward_gpus + 3 * plan.rollout_gpus <= 1.0
    assert plan_placement("cuda", **PARTS).reward_gpus == 0.0  # no reward model: no share


def test_reward_shares_round_down(has_cuda):
    # 0.7 over 1 worker + 2 reward replicas = 0.2333...: floored, so the sum stays under one GPU.
    plan = plan_placement("cuda", **{**PARTS, "ref_workers": 0, "critic_workers": 0}, reward_replicas=2)
    assert plan.worker_gpus == plan.reward_gpus == 0.2333
    assert plan.worker_gpus + 2 * plan.reward_gpus + 3 * plan.rollout_gpus <= 1.0


def test_on_the_cpu_a_reward_model_takes_no_gpu():
    plan = plan_placement("cpu", **PARTS, reward_replicas=2)
    assert (plan.worker_gpus, plan.rollout_gpus, plan.reward_gpus) == (0.0, 0.0, 0.0)


def test_two_workers_of_a_group_on_one_gpu_are_refused(has_cuda):
    with pytest.raises(ConfigError, match=r"trainer.num_workers=2"):
        plan_placement("cuda", **{**PARTS, "actor_workers": 2})


def test_gpu_example_resolves_and_asks_for_cuda_and_bf16():
    cfg = load_config(str(Path(__file__).parents[2] / "examples" / "gpu_arithmetic.yaml"), [])
    assert (cfg.resources.device, cfg.model.dtype, cfg.full_determinism) == ("cuda", "bfloat16", True)
