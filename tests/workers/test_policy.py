"""The policy (actor and reference) on a tiny model, through the fit loop's path: a worker
group of one rank in this process (conftest's `in_process_group`), and the loss function
it runs (`policy.micro_batch_loss`).

Tolerances: the model runs in float32. Values computed by the same ops in a different
grouping (a micro-batch loop vs one pass) differ by float rounding only: gradients within
1e-5 of each tensor's largest entry (conftest's `assert_grads_close`), scalar stats within
rel 1e-5.
"""

import pytest
import torch

from reprorl.algos import LOSS_AGG_MODES
from reprorl.protocol import Batch
from reprorl.records.checkpoint import capture_rng_state, load_checkpoint, restore_rng_state, save_checkpoint
from reprorl.workers.micro_batches import micro_batch_rows, take
from reprorl.workers.optim import NonFiniteError, OptimArgs, lr_multiplier
from reprorl.workers.policy import (
    PolicyLossArgs,
    load_policy,
    mask_truncated,
    micro_batch_log_probs,
    micro_batch_loss,
    mini_batch_norms,
    read_stats,
    trim_padding,
)

LOSS = PolicyLossArgs(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, loss_agg_mode="token-mean",
                      entropy_coeff=0.01, use_kl_loss=True, kl_loss_type="k3", kl_loss_coef=0.1)
STEP = dict(loss=LOSS, temperature=0.7, ppo_epochs=1, mini_batch_size=8, micro_batch_size=4)


@pytest.fixture
def actor_group(in_process_group):
    """`actor_group(path, lr=..., ...)`: the actor, one rank in this process."""

    def make(path, *, lr=1e-3, weight_decay=0.0, grad_clip=1.0, warmup_steps=0, schedule="constant",
             batch_invariant=False):
        # Batch-invariant mode only where a test needs it: its backward is several times slower.
        optim = OptimArgs(lr=lr, weight_decay=weight_decay, grad_clip=grad_clip, warmup_steps=warmup_steps,
                          lr_schedule=schedule, total_steps=10)
        return in_process_group("actor", path, optim=optim, batch_invariant=batch_invariant)

    return make


def _rank(group):
    """The group's one rank (`ShardWorker`): its model, optimizer and schedule."""
    return group.workers[0]


def _train_batch(worker, ref, rollout_batch, seed=0, batch_size=8):
    batch = rollout_batch(batch_size, 6, 5, seed)
    batch["old_log_probs"] = worker.compute_log_probs(batch, temperature=0.7, micro_batch_size=3)
    batch["ref_log_probs"] = ref.compute_log_probs(batch, temperature=0.7, micro_batch_size=3)
    return batch


def _params(worker):
    return [p.detach().clone() for p in _rank(worker).model.parameters()]


def test_log_probs_equal_a_hand_computation(tiny_policy_dir, rollout_batch, in_process_group):
    worker = in_process_group("ref", tiny_policy_dir)
    batch = rollout_batch(5, 6, 4, seed=1)
    log_probs, entropy = worker.compute_log_probs(batch, temperature=0.7, micro_batch_size=2, with_entropy=True)
    with torch.no_grad():
        logits = _rank(worker).model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
    P = batch["prompts"].shape[1]
    for b in range(5):
        for j in range(4):
            if batch["response_mask"][b, j] == 0:
                assert log_probs[b, j] == 0 and entropy[b, j] == 0
                continue
            dist = torch.log_softmax(logits[b, P - 1 + j] / 0.7, dim=-1)  # position P-1+j predicts token j
            expected = dist[batch["responses"][b, j]]
            assert log_probs[b, j].item() == pytest.approx(expected.item(), abs=1e-6)
            assert entropy[b, j].item() == pytest.approx(-(dist.exp() * dist).sum().item(), abs=1e-5)
    # Greedy (temperature 0) scores with T = 1, as the engine.
    greedy = worker.compute_log_probs(batch, temperature=0.0, micro_batch_size=5)
    assert torch.equal(greedy, worker.compute_log_probs(batch, temperature=1.0, micro_batch_size=5))


def test_log_probs_do_not_depend_on_the_micro_batch_or_threads(tiny_policy_dir, rollout_batch, in_process_group):
    worker = in_process_group("ref", tiny_policy_dir, batch_invariant=True)
    batch = rollout_batch(8, 7, 5, seed=2)
    ref = worker.compute_log_probs(batch, temperature=1.0, micro_batch_size=1)
    for micro in (3, 4, 8):
        assert torch.equal(worker.compute_log_probs(batch, temperature=1.0, micro_batch_size=micro), ref)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        assert torch.equal(worker.compute_log_probs(batch, temperature=1.0, micro_batch_size=4), ref)
    finally:
        torch.set_num_threads(threads)


def test_log_probs_by_token_budget_are_the_bits_of_those_by_sample_count(tiny_policy_dir, rollout_batch,
                                                                         in_process_group):
    """Batch-invariant kernels compute each row alone, so reordering the samples and cutting
    them by a token budget changes no bit, and the outputs come back in sample order."""
    worker = in_process_group("ref", tiny_policy_dir, batch_invariant=True)
    batch = rollout_batch(11, 7, 5, seed=5)
    log_probs, entropy = worker.compute_log_probs(batch, temperature=0.7, micro_batch_size=4, with_entropy=True)
    for max_token_len in (12, 20, 45, 1000):  # 12: the widest sample (7 + 5); 1000: one micro-batch
        got = worker.compute_log_probs(batch, temperature=0.7, micro_batch_size=4, max_token_len=max_token_len,
                                       with_entropy=True)
        assert torch.equal(got[0], log_probs) and torch.equal(got[1], entropy), max_token_len
        assert torch.equal(worker.compute_log_probs(batch, temperature=0.7, micro_batch_size=4,
                                                    max_token_len=max_token_len), log_probs)


def test_update_changes_every_parameter_and_not_the_reference(tiny_policy_dir, rollout_batch, actor_group,
                                                               in_process_group):
    actor = actor_group(tiny_policy_dir, batch_invariant=True)
    ref = in_process_group("ref", tiny_policy_dir, batch_invariant=True)
    weights_file = sorted(tiny_policy_dir.glob("*.safetensors"))[0]
    file_bytes = weights_file.read_bytes()
    batch = _train_batch(actor, ref, rollout_batch)
    ref_before, actor_before = _params(ref), _params(actor)
    metrics = actor.update(batch, **STEP)
    for (name, p), before in zip(_rank(actor).model.named_parameters(), actor_before):
        assert not torch.equal(p, before), f"{name} did not change"
    assert all(torch.equal(p, b) for p, b in zip(_rank(ref).model.parameters(), ref_before))
    assert all(not p.requires_grad for p in _rank(ref).model.parameters())
    assert weights_file.read_bytes() == file_bytes
    assert torch.equal(ref.compute_log_probs(batch, temperature=0.7, micro_batch_size=8), batch["ref_log_probs"])
    assert sorted(metrics) == sorted(f"actor/{k}" for k in
                                     ("pg_loss", "entropy", "kl", "pg_clipfrac", "ppo_kl", "grad_norm", "lr"))
    assert metrics["actor/lr"] == 1e-3
    # One mini-batch: the update's first forward equals the old log-probs bit for bit
    # (batch-invariant mode, another micro-batch size), so the ratio is exactly 1.
    assert metrics["actor/ppo_kl"] == 0.0 and metrics["actor/pg_clipfrac"] == 0.0
    assert metrics["actor/kl"] == 0.0  # actor == reference before the step
    with pytest.raises(RuntimeError, match="frozen"):
        ref.update(batch, **STEP)


def _grads(worker, mini, loss, micro_batch_size, max_token_len=None, max_response_length=None):
    """The gradient of `mini`'s loss accumulated micro-batch by micro-batch the plain way
    (autograd into `.grad`), with the rank's cut, model and loss function; and the
    micro-batches' stats added up, named as the update's metrics."""
    model = _rank(worker).model
    norms = mini_batch_norms(mini, max_response_length)
    model.zero_grad(set_to_none=True)
    stats = []
    for rows in micro_batch_rows(mini, micro_batch_size, max_token_len):
        total, micro_stats = micro_batch_loss(model, take(mini, rows), norms, loss=loss, temperature=0.7)
        total.backward()
        stats.append(micro_stats)
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    totals: dict[str, float] = {}
    for micro_stats in read_stats(stats):
        for key, value in micro_stats.items():
            totals[f"actor/{key}"] = totals.get(f"actor/{key}", 0.0) + value
    return grads, totals


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_gradient_accumulation_equals_one_micro_batch(tiny_policy_dir, rollout_batch, assert_grads_close, mode,
                                                      actor_group):
    actor = actor_group(tiny_policy_dir)
    batch = _train_batch(actor, actor, rollout_batch, seed=3)
    # Move the old and reference policies off the current one so that the ratio, clipping
    # and KL terms are not trivial.
    noise = torch.randn(batch["old_log_probs"].shape, generator=torch.Generator().manual_seed(0))
    batch["old_log_probs"] = batch["old_log_probs"] + 0.3 * noise * batch["response_mask"]
    batch["ref_log_probs"] = batch["ref_log_probs"] - 0.2 * noise.abs() * batch["response_mask"]
    loss = PolicyLossArgs(**{**LOSS.__dict__, "loss_agg_mode": mode})
    full_grads, full_stats = _grads(actor, batch, loss, micro_batch_size=8, max_response_length=7)
    assert 0 < full_stats["actor/pg_clipfrac"] < 1 and full_stats["actor/kl"] > 0
    # 3: uneven micro-batches (3, 3, 2); token budgets 11 (the widest sample: 6 + 5) and 24:
    # micro-batches of length-sorted samples, the mini-batch's normalisers all the same.
    for micro, max_token_len in ((1, None), (3, None), (8, 11), (8, 24)):
        grads, stats = _grads(actor, batch, loss, micro_batch_size=micro, max_token_len=max_token_len,
                              max_response_length=7)
        for g, f in zip(grads, full_grads):
            assert_grads_close(g, f)
        assert stats.keys() == full_stats.keys()
        for key in stats:
            assert stats[key] == pytest.approx(full_stats[key], rel=1e-5, abs=1e-7), key


def test_mask_truncated_zeroes_the_rows_cut_at_the_length_limit():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]])
    out = mask_truncated(mask, ["stop", "length", "stop", "length"])
    assert torch.equal(out, torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0], [0, 0, 0]]))
    assert out.dtype == mask.dtype
    assert torch.equal(mask_truncated(mask, ["stop"] * 4), mask)
    with pytest.raises(ValueError, match="3 finish reasons for 4 responses"):
        mask_truncated(mask, ["stop"] * 3)


def test_masked_truncated_rows_add_nothing_to_the_gradient(tiny_policy_dir, rollout_batch, assert_grads_close,
                                                           actor_group):
    """token-mean: the gradient with the truncated rows masked out is the gradient of the
    other rows alone (their tokens are not counted either)."""
    actor = actor_group(tiny_policy_dir)
    batch = _train_batch(actor, actor, rollout_batch, seed=5)
    reasons = ["stop", "length", "stop", "stop", "length", "stop", "length", "stop"]
    batch["advantages"] = batch["advantages"] + batch["response_mask"]  # every row pulls: a leak would show
    masked = batch.slice(0, len(batch))
    masked["response_mask"] = mask_truncated(batch["response_mask"], reasons)
    kept = batch.index([i for i, reason in enumerate(reasons) if reason != "length"])
    masked_grads, masked_stats = _grads(actor, masked, LOSS, micro_batch_size=8)
    kept_grads, kept_stats = _grads(actor, kept, LOSS, micro_batch_size=5)
    for g, k in zip(masked_grads, kept_grads):
        assert_grads_close(g, k)
    assert masked_stats["actor/pg_loss"] == pytest.approx(kept_stats["actor/pg_loss"], rel=1e-6)


def test_non_finite_loss_raises_and_keeps_optimizer_state(tiny_policy_dir, rollout_batch, actor_group):
    actor = actor_group(tiny_policy_dir)
    rank = _rank(actor)
    batch = _train_batch(actor, actor, rollout_batch)
    actor.update(batch, **STEP)
    params = _params(actor)
    adam = {k: v.clone() for k, v in rank.optimizer.state[rank.shard].items()}
    bad = batch.index(list(range(len(batch))))  # a copy
    bad["advantages"][5, 0] = float("nan")  # micro-batch 1 of mini-batch 0 (micro size 4)
    with pytest.raises(NonFiniteError, match=r"actor update 2 \(epoch 0, mini-batch 0\), micro-batch 1: loss is nan"):
        actor.update(bad, **STEP)
    assert all(torch.equal(p, b) for p, b in zip(rank.model.parameters(), params))
    assert all(torch.equal(rank.optimizer.state[rank.shard][k], v) for k, v in adam.items())
    assert all(p.grad is None for p in rank.params)
    assert rank.schedule.step == 1  # the failed step is not counted


def test_grad_norm_is_reported_before_clipping(tiny_policy_dir, rollout_batch, actor_group):
    actor = actor_group(tiny_policy_dir, grad_clip=1e-4)
    batch = _train_batch(actor, actor, rollout_batch)
    grads, _ = _grads(actor, batch, LOSS, micro_batch_size=4)
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()
    assert expected > 1e-4  # so the clip is active
    metrics = actor.update(batch, **STEP)
    assert metrics["actor/grad_norm"] == pytest.approx(expected, rel=1e-6)


def test_lr_steps_once_per_update(tiny_policy_dir, rollout_batch, actor_group):
    actor = actor_group(tiny_policy_dir, warmup_steps=2, schedule="cosine")
    batch = _train_batch(actor, actor, rollout_batch)
    lrs = [actor.update(batch, **{**STEP, "mini_batch_size": 4})["actor/lr"] for _ in range(3)]
    assert lrs == [1e-3 * lr_multiplier(s, warmup_steps=2, total_steps=10, schedule="cosine") for s in range(3)]


def test_checkpoint_round_trip_gives_the_same_next_update(tiny_policy_dir, rollout_batch, tmp_path, actor_group,
                                                          in_process_group):
    """As the fit loop checkpoints: the group's shards and state in the run's checkpoint
    with the RNG states; a new group loads them and makes the next update's bits."""
    ref = in_process_group("ref", tiny_policy_dir)
    actor = actor_group(tiny_policy_dir, weight_decay=0.01, warmup_steps=3)
    batch1 = _train_batch(actor, ref, rollout_batch, seed=4)
    actor.update(batch1, **{**STEP, "ppo_epochs": 2, "mini_batch_size": 4})
    torch.manual_seed(123)
    ckpt = save_checkpoint(tmp_path, 1, {"actor": actor.state_dict(), "rng": capture_rng_state()},
                           write_dirs={"actor.shards": actor.save})

    def next_step(worker):
        noise = torch.rand(())  # stands in for anything that draws from the global RNG
        batch2 = _train_batch(worker, ref, rollout_batch, seed=5)
        metrics = worker.update(batch2, **{**STEP, "ppo_epochs": 2, "mini_batch_size": 4})
        return noise, metrics

    noise_a, metrics_a = next_step(actor)
    resumed = actor_group(tiny_policy_dir, weight_decay=0.01, warmup_steps=3)
    torch.manual_seed(999)
    step, state = load_checkpoint(tmp_path)
    resumed.load(ckpt / "actor.shards", state["actor"])
    restore_rng_state(state["rng"])
    noise_b, metrics_b = next_step(resumed)
    assert step == 1 and torch.equal(noise_a, noise_b)
    assert metrics_a == metrics_b
    for (name, a), b in zip(_rank(actor).model.named_parameters(), _rank(resumed).model.parameters()):
        assert torch.equal(a, b), name
    a, b = _rank(actor), _rank(resumed)
    for key, value in a.optimizer.state[a.shard].items():
        assert torch.equal(value, b.optimizer.state[b.shard][key])


def test_named_weights_are_every_weight_under_its_hf_name(tiny_policy_dir, rollout_batch, actor_group):
    """What the replicas take after an update: every weight, by HF name, the model's own bits.
    (The HF export of a trained run: tests/trainer/test_lora.py, `reprorl export`.)"""
    actor = actor_group(tiny_policy_dir)
    actor.update(_train_batch(actor, actor, rollout_batch), **STEP)
    names = [name for name, _ in actor.named_weights()]
    assert "model.embed_tokens.weight" in names and "model.layers.0.self_attn.q_proj.weight" in names
    model = dict(_rank(actor).model.named_parameters())
    assert names == list(model)
    for name, tensor in actor.named_weights():
        assert torch.equal(model[name], tensor), name


def _widen(batch, lead: int, tail: int):
    """`batch` with `lead` more all-padding prompt columns and `tail` more response columns."""
    out = {}
    for key, t in batch.tensors.items():
        if key in ("input_ids", "attention_mask", "position_ids"):
            out[key] = torch.nn.functional.pad(t, (lead, tail))
        elif key == "prompts":
            out[key] = torch.nn.functional.pad(t, (lead, 0))
        else:  # [b, R]
            out[key] = torch.nn.functional.pad(t, (0, tail))
    return Batch(out)


def test_trim_padding_cuts_the_columns_padded_in_every_row(rollout_batch):
    batch = rollout_batch(4, 6, 5, seed=3)
    wide = _widen(batch, 3, 2)
    trimmed = trim_padding(wide)
    real = batch["attention_mask"].bool().any(0)
    lead, last = int(real.nonzero()[0]), int(real.nonzero()[-1])
    assert trimmed["input_ids"].shape[1] == last - lead + 1
    assert trimmed["responses"].shape[1] == last - 6 + 1 and trimmed["advantages"].shape == trimmed["responses"].shape
    assert torch.equal(trimmed["input_ids"], batch["input_ids"][:, lead : last + 1])
    assert trim_padding(trimmed) is trimmed  # nothing left to cut


def test_log_probs_keep_their_bits_when_padding_is_cut(tiny_policy_dir, rollout_batch, in_process_group):
    """The micro-batches are cut to their own rows' width: the same log-probs as one pass on a
    wider batch, and as micro-batches of one row (each cut to itself)."""
    worker = in_process_group("ref", tiny_policy_dir, batch_invariant=True)
    batch = rollout_batch(8, 6, 5, seed=4)
    whole = worker.compute_log_probs(batch, temperature=1.0, micro_batch_size=8)
    wide = worker.compute_log_probs(_widen(batch, 4, 3), temperature=1.0, micro_batch_size=8)
    rows = worker.compute_log_probs(batch, temperature=1.0, micro_batch_size=1)
    assert wide.shape == (8, 8) and torch.equal(wide[:, 5:], torch.zeros(8, 3))
    assert torch.equal(wide[:, :5], whole) and torch.equal(rows, whole)


def test_the_triton_kernels_give_a_micro_batch_the_gradient_of_stock_torch(tiny_policy_dir, rollout_batch,
                                                                            assert_grads_close):
    """Every backward kernel of the Triton backend inside the model at once (RMSNorm with
    its weight, rotary, SiLU-and-mul, attention through the padded batch's permutations,
    the fused log-probs and entropy in the loss; the tied embedding's LM head): the loss
    and every parameter's gradient of one micro-batch against stock torch, and the same
    bits twice. Run under the Triton interpreter here (tests/conftest.py), on the GPU there.
    Tolerance as assert_grads_close (1e-5 of each tensor's largest entry, float32: the
    kernels sum in other orders), the loss within rel 1e-5."""
    from kernel_backends import BACKENDS, backend_and_device

    if "triton" not in BACKENDS:
        pytest.skip("triton is not installed, or neither a GPU nor its interpreter is here")
    kernels, device = backend_and_device("triton")
    from reprorl.kernels import TorchKernels

    model = load_policy(tiny_policy_dir, trainable=True)
    batch = rollout_batch(3, 6, 5, seed=4)
    batch["old_log_probs"] = micro_batch_log_probs(model, [batch], temperature=0.7)[0]
    batch["ref_log_probs"] = batch["old_log_probs"] - 0.1
    model.to(device)
    batch = batch.to(device)

    def loss_and_grads(backend):
        model.kernels = backend
        model.zero_grad(set_to_none=True)
        total, _ = micro_batch_loss(model, batch, mini_batch_norms(batch, None), loss=LOSS, temperature=0.7)
        total.backward()
        return total.detach(), [p.grad.clone() for p in model.parameters()]

    loss, grads = loss_and_grads(kernels)
    loss_again, grads_again = loss_and_grads(kernels)
    plain_loss, plain = loss_and_grads(TorchKernels)
    assert torch.equal(loss, loss_again) and all(torch.equal(a, b) for a, b in zip(grads, grads_again))
    assert loss.item() == pytest.approx(plain_loss.item(), rel=1e-5)
    for name, got, expected in zip([n for n, _ in model.named_parameters()], grads, plain):
        assert expected.abs().sum() > 0, name
        assert_grads_close(got.cpu(), expected.cpu())
