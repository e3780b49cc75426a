"""bf16 worker groups (`model.dtype=bfloat16`, on the CPU here): float32 master weights and
AdamW state, model weights that are exactly their bf16 cast, the same bits for 1 and 2
workers, and gradient checkpointing that changes no bit."""

import pytest
import torch

from reprorl.workers.flat import FlatLayout, flatten
from reprorl.workers.group import WorkerGroup
from reprorl.workers.optim import OptimArgs
from reprorl.workers.policy import PolicyLossArgs

pytestmark = pytest.mark.slow

OPTIM = OptimArgs(lr=1e-3, weight_decay=0.01)
STEP = {"ppo_epochs": 1, "mini_batch_size": 8, "micro_batch_size": 2, "max_response_length": 5}


@pytest.fixture(scope="module")
def batch():
    from conftest import _rollout_batch

    return _rollout_batch(8, 6, 5, seed=0)


def train_bf16(policy_dir, batch, num_workers, shard_dir, **options):
    """(weights after 2 updates, the directory of the shards saved then)."""
    group = WorkerGroup("actor", num_workers, policy_dir, optim=OPTIM, seed=1, full_determinism=True,
                        dtype="bfloat16", **options)
    try:
        b = batch.slice(0, len(batch))
        b["old_log_probs"] = group.compute_log_probs(b, temperature=1.0, micro_batch_size=2)
        for _ in range(2):
            group.update(b, **STEP, loss=PolicyLossArgs(), temperature=1.0)
        group.save(shard_dir)
        return dict(group.named_weights())
    finally:
        group.shutdown()


@pytest.fixture(scope="module")
def runs(tiny_policy_dir, batch, ray_local, tmp_path_factory):
    out = {}
    for name, workers, options in (("one", 1, {}), ("two", 2, {}), ("ckpt", 1, {"gradient_checkpointing": True})):
        shard_dir = tmp_path_factory.mktemp(name)
        out[name] = (train_bf16(tiny_policy_dir, batch, workers, shard_dir, **options), shard_dir)
    return out


def test_master_and_adam_state_are_float32_and_the_weights_their_bf16_cast(runs):
    weights, shard_dir = runs["one"]
    shard = torch.load(shard_dir / "shard_0.pt", weights_only=True)
    assert shard["param"].dtype == torch.float32 and shard["adam"]["exp_avg"].dtype == torch.float32
    names = list(weights)
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    layout = FlatLayout.of(weights.items(), 1)
    flat = flatten([weights[n] for n in names], layout)[: layout.numel]
    assert torch.equal(flat, shard["param"].to(torch.bfloat16))
    # the master holds what bf16 rounds away: a bf16 master would equal its cast
    assert not torch.equal(shard["param"], shard["param"].to(torch.bfloat16).float())


def test_two_workers_give_one_workers_bits_in_bf16(runs):
    one, two = runs["one"][0], runs["two"][0]
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)


def test_gradient_checkpointing_changes_no_bit(runs):
    one, ckpt = runs["one"][0], runs["ckpt"][0]
    assert all(torch.equal(one[k], ckpt[k]) for k in one)
