"""Cutting a batch into micro-batches by a token budget (reprorl/workers/micro_batches.py)."""

import pytest
import torch

from reprorl.protocol import Batch
from reprorl.workers.micro_batches import (
    in_sample_order,
    micro_batch_rows,
    row_spans,
    rows_tensor,
    take,
    token_budget_micro_batches,
    trimmed_width,
)
from reprorl.workers.policy import trim_padding


def _batch(prompt_lens, response_lens, prompt_width, response_width):
    """Left-padded prompts and right-padded responses of the given lengths (token ids 5)."""
    rows = len(prompt_lens)
    prompt_mask = torch.zeros(rows, prompt_width, dtype=torch.long)
    response_mask = torch.zeros(rows, response_width, dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        prompt_mask[b, prompt_width - p:] = 1
        response_mask[b, :r] = 1
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    return Batch({"input_ids": attention_mask * 5, "attention_mask": attention_mask,
                  "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0), "responses": response_mask * 5,
                  "response_mask": response_mask, "prompts": prompt_mask * 5})


def test_a_hand_cut_example():
    # Lengths (prompt + response): 5, 5, 3, 5 -> order 2, 0, 1, 3 (ties by index). Budget 12:
    # [2] is 1 x 3; + 0: 2 x (3 + 2) = 10; + 1: 3 x (3 + 4) = 21 > 12, cut. [1] is 1 x 5;
    # + 3: 2 x (3 + 4) = 14 > 12, cut. [3]. Each micro-batch lists its rows in sample order.
    batch = _batch([3, 1, 2, 3], [2, 4, 1, 2], prompt_width=4, response_width=5)
    assert row_spans(batch) == ([3, 1, 2, 3], [2, 4, 1, 2])
    assert token_budget_micro_batches(batch, 12) == [[0, 2], [1], [3]]
    assert token_budget_micro_batches(batch, 14) == [[0, 2], [1, 3]]
    assert token_budget_micro_batches(batch, 100) == [[0, 1, 2, 3]]


def test_spans_count_padding_inside_a_row_and_an_empty_response_keeps_one_column():
    batch = _batch([2, 1], [0, 3], prompt_width=3, response_width=4)
    batch["attention_mask"][1, 3 + 1] = 0  # a hole inside row 1's response (a masked tool token)
    assert row_spans(batch) == ([2, 1], [0, 3])
    assert trimmed_width(2, 0) == 3 and trimmed_width(0, 0) == 2


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("budget", [11, 16, 30, 64])
def test_every_sample_once_within_the_budget_in_length_order(rollout_batch, seed, budget):
    batch = rollout_batch(13, 6, 5, seed)
    micros = token_budget_micro_batches(batch, budget)
    assert sorted(i for rows in micros for i in rows) == list(range(13))
    prompt, response = row_spans(batch)
    lengths = [[prompt[i] + response[i] for i in rows] for rows in micros]
    for rows, cut in zip(micros, lengths):
        assert rows == sorted(rows)
        trimmed = trim_padding(take(batch, rows))
        # The padded size the cut counts is what the micro-batch costs once trimmed.
        width = trimmed_width(max(prompt[i] for i in rows), max(response[i] for i in rows))
        assert trimmed["input_ids"].shape == (len(rows), width)
        assert trimmed["input_ids"].numel() <= budget
    # Length order: every sample of a micro-batch is no longer than any of the next one's.
    for shorter, longer in zip(lengths, lengths[1:]):
        assert max(shorter) <= min(longer)
    # Greedy: the next micro-batch's shortest sample (the next in order) would not have fit.
    for rows, following in zip(micros, micros[1:]):
        first = min(following, key=lambda i: (prompt[i] + response[i], i))
        grown = rows + [first]
        width = trimmed_width(max(prompt[i] for i in grown), max(response[i] for i in grown))
        assert len(grown) * width > budget
    assert token_budget_micro_batches(batch, budget) == micros  # a pure function


def test_the_cut_does_not_depend_on_tensors_other_than_the_masks(rollout_batch):
    batch = rollout_batch(9, 6, 5, seed=3)
    other = batch.slice(0, len(batch))
    other["advantages"] = -batch["advantages"]
    other["input_ids"] = batch["input_ids"].flip(0)
    assert token_budget_micro_batches(other, 20) == token_budget_micro_batches(batch, 20)


def test_a_sample_wider_than_the_budget_is_an_error_naming_it():
    batch = _batch([1, 3], [1, 4], prompt_width=3, response_width=4)
    with pytest.raises(ValueError, match=r"^max_token_len=6: sample 1 alone is 7 tokens wide \(3 of prompt, 4 of "
                                         r"response\); a micro-batch's token budget must hold the longest sample$"):
        token_budget_micro_batches(batch, 6)
    assert token_budget_micro_batches(batch, 7) == [[0], [1]]
    with pytest.raises(ValueError, match="max_token_len must be >= 1 or None, got 0"):
        micro_batch_rows(batch, 1, 0)


def test_without_a_budget_the_micro_batches_are_batch_split(rollout_batch):
    batch = rollout_batch(10, 6, 5, seed=0)
    rows = micro_batch_rows(batch, 4, None)
    assert rows == [range(0, 4), range(4, 8), range(8, 10)]
    assert all(take(batch, r).equal(part) for r, part in zip(rows, batch.split(4)))
    assert torch.equal(rows_tensor(rows), torch.arange(10))


def test_in_sample_order_undoes_the_micro_batch_order(rollout_batch):
    batch = rollout_batch(11, 6, 5, seed=4)
    micros = token_budget_micro_batches(batch, 16)
    rows = rows_tensor(micros)
    assert not torch.equal(rows, torch.arange(11))  # the cut did reorder
    stacked = torch.cat([take(batch, r)["advantages"] for r in micros])
    assert torch.equal(in_sample_order(stacked, rows), batch["advantages"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_the_gpu_log_probs_and_values_by_budget_are_the_bits_by_count(tiny_policy_dir, rollout_batch,
                                                                         in_process_group):
    """bf16 on the GPU's batch-invariant kernels: length-sorted micro-batches of a token
    budget give every sample the bits it gets in micro-batches of 4, in sample order (the
    reference and the critic as the fit loop reaches them: groups, here of one rank in this
    process, taking the batch from the host)."""
    from reprorl.workers.optim import OptimArgs

    batch = rollout_batch(24, 12, 16, seed=7)
    on_gpu = dict(batch_invariant=True, device="cuda", dtype="bfloat16")
    worker = in_process_group("ref", tiny_policy_dir, **on_gpu)
    critic = in_process_group("critic", tiny_policy_dir, optim=OptimArgs(lr=1e-5), **on_gpu)
    log_probs = worker.compute_log_probs(batch, temperature=0.7, micro_batch_size=4)
    values = critic.compute_values(batch, micro_batch_size=4)
    for max_token_len in (28, 64, 200):  # 28: the widest sample (12 + 16)
        assert torch.equal(worker.compute_log_probs(batch, temperature=0.7, micro_batch_size=4,
                                                    max_token_len=max_token_len), log_probs), max_token_len
        assert torch.equal(critic.compute_values(batch, micro_batch_size=4, max_token_len=max_token_len),
                           values), max_token_len


def test_a_trimmed_micro_batch_carries_its_width_and_largest_position_and_is_not_trimmed_again():
    batch = _batch([3, 1], [2, 4], prompt_width=6, response_width=7)
    trimmed = trim_padding(batch)
    assert trimmed["input_ids"].shape == (2, 3 + 4)
    assert trimmed.meta == {"response_width": 7, "max_position": 4}  # 5 real tokens in each row
    assert trim_padding(trimmed) is trimmed
    whole = trim_padding(_batch([2], [3], prompt_width=2, response_width=3))  # nothing to cut
    assert whole["input_ids"].shape == (1, 5) and whole.meta == {"response_width": 3, "max_position": 4}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_the_gpu_a_micro_batch_trimmed_on_the_host_never_waits_for_the_gpu(tiny_policy_dir, rollout_batch):
    """Trimmed on the host and copied through pinned memory (what the workers do), a
    micro-batch's log-probs, its loss and the loss's backward read nothing from the GPU:
    torch's sync debug mode raises at any read. (Each read lets the GPU's queue run dry
    while the host waits.)"""
    from reprorl.workers.policy import (
        PolicyLossArgs,
        load_policy,
        micro_batch_log_probs,
        micro_batch_loss,
        mini_batch_norms,
    )

    batch = rollout_batch(8, 12, 16, seed=3)
    model = load_policy(tiny_policy_dir, trainable=True, batch_invariant=True, device="cuda", dtype="bfloat16")
    loss = PolicyLossArgs(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, loss_agg_mode="token-mean",
                          entropy_coeff=0.01, use_kl_loss=False, kl_loss_type="k3", kl_loss_coef=0.0)

    def on_gpu(b):
        return trim_padding(take(b, range(len(b)))).to("cuda", non_blocking=True)

    warm = micro_batch_log_probs(model, [on_gpu(batch)], temperature=0.7)[0]  # compiles the kernels
    batch["old_log_probs"] = warm.cpu()
    norms = {k: v.to("cuda") if isinstance(v, torch.Tensor) else v for k, v in mini_batch_norms(batch, None).items()}
    micro_batch_loss(model, on_gpu(batch), norms, loss=loss, temperature=0.7)[0].backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        log_probs = micro_batch_log_probs(model, [on_gpu(batch)], temperature=0.7)[0]
        total, _ = micro_batch_loss(model, on_gpu(batch), norms, loss=loss, temperature=0.7)
        total.backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(log_probs.cpu(), warm.cpu())
