"""The critic on a tiny model, through the fit loop's path: a worker group of one rank in
this process (conftest's `in_process_group`), its loader and its loss function
(`critic.load_critic`, `critic.micro_batch_loss`). Float32; tolerances as in test_policy.py."""

import pytest
import torch

from reprorl.algos import LOSS_AGG_MODES
from reprorl.records.checkpoint import load_checkpoint, save_checkpoint
from reprorl.workers.critic import load_critic, micro_batch_loss
from reprorl.workers.micro_batches import micro_batch_rows, take
from reprorl.workers.optim import OptimArgs
from reprorl.workers.policy import mini_batch_norms, read_stats

STEP = dict(ppo_epochs=1, mini_batch_size=8, micro_batch_size=4, cliprange_value=0.5, loss_agg_mode="token-mean")


@pytest.fixture
def critic_group(in_process_group):
    """`critic_group(path, seed=0, lr=1e-3, batch_invariant=False)`: the critic, one rank in this process."""

    def make(path, seed=0, lr=1e-3, batch_invariant=False):
        # Batch-invariant mode only where a test needs it: its backward is several times slower.
        return in_process_group("critic", path, optim=OptimArgs(lr=lr, weight_decay=0.0, total_steps=10), seed=seed,
                                batch_invariant=batch_invariant)

    return make


def _model(group):
    return group.workers[0].model


def _value_batch(critic, rollout_batch, seed=0):
    batch = rollout_batch(8, 6, 5, seed)
    # The update's micro-batch size: the same rows together give the same forward bits,
    # so the first mini-batch's new values equal these old values exactly.
    batch["values"] = critic.compute_values(batch, micro_batch_size=STEP["micro_batch_size"])
    g = torch.Generator().manual_seed(seed + 100)
    batch["returns"] = torch.randn(8, 5, generator=g) * batch["response_mask"]
    return batch


def test_values_are_those_of_the_state_before_each_token(tiny_policy_dir, rollout_batch, critic_group):
    critic = critic_group(tiny_policy_dir, batch_invariant=True)
    batch = rollout_batch(5, 6, 4, seed=1)
    values = critic.compute_values(batch, micro_batch_size=2)
    with torch.no_grad():
        full = _model(critic)(batch["input_ids"], batch["attention_mask"], batch["position_ids"])  # [B, P+R]
    P = batch["prompts"].shape[1]
    for b in range(5):
        for j in range(4):
            expected = full[b, P - 1 + j] if batch["response_mask"][b, j] else 0.0
            assert values[b, j].item() == pytest.approx(float(expected), abs=1e-6)
    # The value before response token 0 is the prompt's: other responses leave it unchanged.
    other = rollout_batch(5, 6, 4, seed=1)
    other["responses"][:] = torch.randint(3, 128, other["responses"].shape, generator=torch.Generator().manual_seed(9))
    other["input_ids"] = torch.cat([other["prompts"], other["responses"]], dim=1)
    assert torch.equal(critic.compute_values(other, micro_batch_size=2)[:, 0], values[:, 0])
    # Micro-batch size does not matter (batch-invariant mode), nor a token budget (length-sorted
    # micro-batches; the values come back in sample order).
    assert torch.equal(critic.compute_values(batch, micro_batch_size=5), values)
    for max_token_len in (10, 16, 100):  # 10: the widest sample (6 + 4)
        assert torch.equal(critic.compute_values(batch, micro_batch_size=2, max_token_len=max_token_len), values)


def test_value_head_init_is_seeded(tiny_policy_dir):
    a, b, c = (load_critic(tiny_policy_dir, seed=seed) for seed in (7, 7, 8))
    state_a, state_b, state_c = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    differ = [k for k in state_a if not torch.equal(state_a[k], state_c[k])]
    assert differ == ["score.weight"]  # the bias starts at 0 whatever the seed
    assert 0.015 < state_a["score.weight"].std() < 0.025  # normal(0, 0.02), as transformers' init
    assert torch.equal(state_a["score.bias"], torch.zeros(1))


def test_a_reward_model_checkpoint_keeps_its_head(tmp_path):
    from safetensors.torch import load_file

    from reprorl.models.tiny import make_tiny

    reward_dir = make_tiny(tmp_path / "rm", kind="reward", seed=3)
    critic = load_critic(reward_dir, seed=7)
    stored = load_file(reward_dir / "model.safetensors")["score.weight"]
    assert torch.equal(critic.score.weight, stored)
    assert torch.equal(critic.score.bias, torch.zeros(1))


def test_update_fits_the_returns(tiny_policy_dir, rollout_batch, critic_group):
    critic = critic_group(tiny_policy_dir)
    batch = _value_batch(critic, rollout_batch)
    before = [p.detach().clone() for p in _model(critic).parameters()]
    mask = batch["response_mask"].float()
    expected = 0.5 * ((batch["values"] - batch["returns"]) ** 2 * mask).sum() / mask.sum()
    first = critic.update(batch, **STEP)
    assert sorted(first) == ["critic/grad_norm", "critic/lr", "critic/vf_clipfrac", "critic/vf_loss"]
    # New values == old values on the first mini-batch: nothing clipped, the plain loss.
    assert first["critic/vf_clipfrac"] == 0.0
    assert first["critic/vf_loss"] == pytest.approx(expected.item(), rel=1e-6)
    for (name, p), b in zip(_model(critic).named_parameters(), before):
        assert not torch.equal(p, b), f"{name} did not change"
    losses = [first["critic/vf_loss"]]
    for _ in range(5):
        batch["values"] = critic.compute_values(batch, micro_batch_size=4)
        losses.append(critic.update(batch, **STEP)["critic/vf_loss"])
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_gradient_accumulation_equals_one_micro_batch(tiny_policy_dir, rollout_batch, assert_grads_close, mode,
                                                      critic_group):
    critic = critic_group(tiny_policy_dir)
    model = _model(critic)
    batch = _value_batch(critic, rollout_batch, seed=2)
    batch["values"] = batch["values"] + 0.3 * torch.sign(batch["returns"])  # some tokens clip
    norms = mini_batch_norms(batch, 7)

    def grads(micro, max_token_len=None):
        """The rank's loss on its model, micro-batch by micro-batch, accumulated by autograd."""
        stats = []
        for rows in micro_batch_rows(batch, micro, max_token_len):
            vf_loss, micro_stats = micro_batch_loss(model, take(batch, rows), norms, cliprange_value=0.2,
                                                    loss_agg_mode=mode)
            vf_loss.backward()
            stats.append(micro_stats)
        out = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        totals = {"critic/vf_loss": 0.0, "critic/vf_clipfrac": 0.0}
        for micro_stats in read_stats(stats):
            for key, value in micro_stats.items():
                totals[f"critic/{key}"] += value
        return out, totals

    full, full_stats = grads(8)
    assert 0 < full_stats["critic/vf_clipfrac"] < 1
    for micro, max_token_len in ((1, None), (3, None), (8, 11), (8, 24)):  # token budgets: length-sorted
        got, stats = grads(micro, max_token_len)
        for g, f in zip(got, full):
            assert_grads_close(g, f)
        for key in stats:
            assert stats[key] == pytest.approx(full_stats[key], rel=1e-5, abs=1e-7), key


def test_checkpoint_round_trip_gives_the_same_next_update(tiny_policy_dir, rollout_batch, tmp_path, critic_group):
    """The group's shards in a checkpoint, as the fit loop writes them, loaded by a new group."""
    critic = critic_group(tiny_policy_dir)
    critic.update(_value_batch(critic, rollout_batch, seed=3), **STEP)
    ckpt = save_checkpoint(tmp_path, 1, {"critic": critic.state_dict()}, write_dirs={"critic.shards": critic.save})
    metrics_a = critic.update(_value_batch(critic, rollout_batch, seed=4), **STEP)
    resumed = critic_group(tiny_policy_dir, seed=1)  # another head init: all of it must come from the checkpoint
    resumed.load(ckpt / "critic.shards", load_checkpoint(tmp_path)[1]["critic"])
    metrics_b = resumed.update(_value_batch(resumed, rollout_batch, seed=4), **STEP)
    assert metrics_a == metrics_b
    for (name, a), b in zip(_model(critic).named_parameters(), _model(resumed).parameters()):
        assert torch.equal(a, b), name
