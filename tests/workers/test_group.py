"""Worker groups of 1, 2 and 4 processes on a tiny model: the same bits, and the same bits
as a plain one-process reference (the loss function and AdamW on the whole flat vector,
written out here); sharded checkpoints across worker counts; failures."""

import math
import os
import signal

import pytest
import torch

from reprorl.kernels import pinned
from reprorl.models.lora import LoraSpec
from reprorl.workers.flat import CHUNK, FlatLayout, flatten, tree_sum
from reprorl.workers.group import WorkerError, WorkerGroup
from reprorl.workers.micro_batches import token_budget_micro_batches
from reprorl.workers.optim import NonFiniteError, OptimArgs, make_adamw, step_in_chunks
from reprorl.workers.policy import (
    PolicyLossArgs,
    load_policy,
    micro_batch_log_probs,
    micro_batch_loss,
    mini_batch_norms,
)

pytestmark = pytest.mark.slow

OPTIM = OptimArgs(lr=1e-2, weight_decay=0.01, grad_clip=0.5)  # large enough that clipping acts
LOSS = PolicyLossArgs(entropy_coeff=0.01)
# 16 samples, mini-batches of 8, micro-batches of 2: 4 micro-batches per mini-batch, 2 optimizer steps.
STEP = {"ppo_epochs": 1, "mini_batch_size": 8, "micro_batch_size": 2, "max_response_length": 5}


@pytest.fixture(scope="module")
def batch():
    from conftest import _rollout_batch  # tests/conftest.py: the shared batch maker

    return _rollout_batch(16, 6, 5, seed=0)


# A token budget of 30 cuts the batch's two mini-batches into 4 and 3 micro-batches (length
# order): 3 fits no N by itself, so at N = 4 one rank holds an empty leaf only
# (flat.tree_leaves); the log-prob pass's 6 micro-batches leave rank 3 of 4 without any.
BUDGET = 30


def run_actor(num_workers, policy_dir, batch, save_to=None, max_token_len=None, shard_params=False, lora=None,
              optimizer_offload=False):
    """Log-probs, then the metrics and weights after each of 2 updates of a fresh actor
    group; with `save_to`, its shards are saved there after update 1."""
    group = WorkerGroup("actor", num_workers, policy_dir, optim=OPTIM, seed=1, full_determinism=True,
                        shard_params=shard_params, lora=lora, optimizer_offload=optimizer_offload)
    try:
        b = batch.slice(0, len(batch))
        b["old_log_probs"] = group.compute_log_probs(b, temperature=1.0, micro_batch_size=2,
                                                     max_token_len=max_token_len)
        metrics, weights = [], []
        for update in range(2):
            metrics.append(group.update(b, **STEP, loss=LOSS, temperature=1.0, max_token_len=max_token_len))
            weights.append(dict(group.named_weights()))
            if update == 0 and save_to is not None:
                group.save(save_to)
        return b["old_log_probs"], metrics, weights
    finally:
        group.shutdown()


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return tmp_path_factory.mktemp("shards")


@pytest.fixture(scope="module")
def runs(tiny_policy_dir, batch, ray_local, shards):
    return {n: run_actor(n, tiny_policy_dir, batch, save_to=shards if n == 2 else None) for n in (1, 2, 4)}


@pytest.mark.parametrize("num_workers", [2, 4])
def test_log_probs_metrics_and_weights_equal_one_workers(runs, num_workers):
    assert_same_run(runs[num_workers], runs[1])


def assert_same_run(got, want):
    """Two `run_actor` results are the same bits: log-probs, every metric, every weight."""
    (log_probs, metrics, weights), (got_log_probs, got_metrics, got_weights) = want, got
    assert torch.equal(got_log_probs, log_probs)
    assert got_metrics == metrics  # every float, exactly
    for update in range(2):
        assert weights[update].keys() == got_weights[update].keys()
        assert [k for k in weights[update] if not torch.equal(weights[update][k], got_weights[update][k])] == []


@pytest.fixture(scope="module")
def budget_runs(tiny_policy_dir, batch, ray_local):
    return {n: run_actor(n, tiny_policy_dir, batch, max_token_len=BUDGET) for n in (1, 2, 4)}


def test_the_budget_cuts_micro_batch_counts_no_worker_count_divides(batch):
    counts = [len(token_budget_micro_batches(mini, BUDGET)) for mini in batch.split(STEP["mini_batch_size"])]
    assert counts == [4, 3] and len(token_budget_micro_batches(batch, BUDGET)) == 6


@pytest.mark.parametrize("num_workers", [2, 4])
def test_a_token_budget_gives_the_same_bits_at_every_worker_count(budget_runs, num_workers):
    log_probs, metrics, weights = budget_runs[1]
    got_log_probs, got_metrics, got_weights = budget_runs[num_workers]
    assert torch.equal(got_log_probs, log_probs)
    assert got_metrics == metrics  # every float, exactly
    for update in range(2):
        assert [k for k in weights[update] if not torch.equal(weights[update][k], got_weights[update][k])] == []


@pytest.mark.parametrize(("num_workers", "budget"), [(2, None), (4, None), (4, BUDGET)])
def test_parameters_sharded_at_rest_give_the_whole_parameters_bits(tiny_policy_dir, batch, runs, budget_runs,
                                                                    num_workers, budget):
    """`shard_params` (workers/units.py): each rank keeps its shard of the weights and gathers
    a layer at a time. By samples and by the token budget, whose mini-batch of 3 micro-batches
    leaves rank 3 of 4 an empty leaf in every round (it only takes part in the collectives)
    and whose log-prob pass gives rank 3 no micro-batch: the bits of one rank's whole weights."""
    log_probs, metrics, weights = (runs if budget is None else budget_runs)[1]
    got_log_probs, got_metrics, got_weights = run_actor(num_workers, tiny_policy_dir, batch, max_token_len=budget,
                                                        shard_params=True)
    assert torch.equal(got_log_probs, log_probs)
    assert got_metrics == metrics  # every float, exactly
    for update in range(2):
        assert [k for k in weights[update] if not torch.equal(weights[update][k], got_weights[update][k])] == []


@pytest.mark.parametrize("shard_params", [False, True])
def test_an_offloaded_optimizer_on_two_ranks_gives_one_ranks_bits(tiny_policy_dir, batch, runs, shard_params):
    """Master, moments and gradient sums on the host (workers/offload.py), the gradient
    reduce-scattered (or, sharded at rest, exchanged) between two ranks: one rank's bits."""
    assert_same_run(run_actor(2, tiny_policy_dir, batch, shard_params=shard_params, optimizer_offload=True), runs[1])


def test_a_lora_actor_sharded_at_rest_on_four_ranks_gives_one_whole_ranks_bits(tiny_policy_dir, batch, ray_local):
    """LoRA with the frozen base sharded too (gathered with the adapters, unit by unit):
    4 ranks by the token budget (rank 3 replays) against one rank's whole weights."""
    lora = LoraSpec(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"), seed=7)
    log_probs, metrics, weights = run_actor(1, tiny_policy_dir, batch, max_token_len=BUDGET, lora=lora)
    got_log_probs, got_metrics, got_weights = run_actor(4, tiny_policy_dir, batch, max_token_len=BUDGET, lora=lora,
                                                        shard_params=True)
    assert torch.equal(got_log_probs, log_probs)
    assert got_metrics == metrics
    for update in range(2):
        assert weights[update].keys() == got_weights[update].keys()
        assert [k for k in weights[update] if not torch.equal(weights[update][k], got_weights[update][k])] == []


def test_log_probs_by_token_budget_are_those_by_sample_count(budget_runs, tiny_policy_dir, batch, in_process_group,
                                                             monkeypatch):
    # Batch-invariant kernels: the rows' bits whatever micro-batch they sit in, back in sample order
    # (here: the Ray group's by budget against one rank's in this process by sample count; the
    # Ray ranks run full determinism, so this process takes its CPU math, RoPE tables included).
    monkeypatch.setattr(pinned, "_pinned", True)
    worker = in_process_group("ref", tiny_policy_dir, batch_invariant=True)
    assert torch.equal(budget_runs[1][0], worker.compute_log_probs(batch, temperature=1.0, micro_batch_size=2))


def test_the_update_moved_every_weight(runs, tiny_policy_dir):
    start = dict(load_policy(tiny_policy_dir, trainable=False).named_parameters())
    weights = runs[1][2][0]
    assert [k for k in weights if torch.equal(weights[k], start[k].detach())] == []


def test_one_update_equals_a_plain_unsharded_reference(runs, tiny_policy_dir, batch, assert_grads_close,
                                                       monkeypatch):
    """In this process, one thread: each micro-batch's gradient alone, the tree over them,
    the norm over fixed chunks, clipping and AdamW on the whole flat vector; the group's
    weights after its first update must be these bits. The tree's gradient also equals the
    usual accumulation (autograd adding each micro-batch's gradient into `.grad`) up to rounding.
    The group's ranks run full determinism, so this process takes its CPU math too
    (`pinned`), and AdamW's step is theirs (`step_in_chunks`, tested against torch's)."""
    monkeypatch.setattr(pinned, "_pinned", True)
    torch.set_num_threads(1)
    model = load_policy(tiny_policy_dir, trainable=True, batch_invariant=True)
    named = [(n, p) for n, p in model.named_parameters()]
    params = [p for _, p in named]
    layout = FlatLayout.of(named, world_size=1)
    b = batch.slice(0, len(batch))
    b["old_log_probs"] = torch.cat(micro_batch_log_probs(model, b.split(2), temperature=1.0))  # sample order
    flat = torch.nn.Parameter(flatten([p.detach() for p in params], layout))
    optimizer = make_adamw([flat], OPTIM)
    for mini in b.split(STEP["mini_batch_size"]):
        norms = mini_batch_norms(mini, STEP["max_response_length"])
        grads = []
        for micro in mini.split(STEP["micro_batch_size"]):
            model.zero_grad(set_to_none=True)
            loss, _ = micro_batch_loss(model, micro, norms, loss=LOSS, temperature=1.0)
            loss.backward()
            grads.append(flatten([p.grad for p in params], layout))
        grad = tree_sum(grads)
        model.zero_grad(set_to_none=True)
        for micro in mini.split(STEP["micro_batch_size"]):
            micro_batch_loss(model, micro, norms, loss=LOSS, temperature=1.0)[0].backward()
        assert_grads_close(grad[: layout.numel], flatten([p.grad for p in params], layout)[: layout.numel])
        norm = math.sqrt(float(grad.view(-1, CHUNK).float().square().sum(-1).double().sum()))
        grad.mul_(OPTIM.grad_clip / (norm + 1e-6))
        flat.grad = grad
        step_in_chunks(optimizer, flat)
        with torch.no_grad():
            for p, offset in zip(params, layout.offsets()):
                p.copy_(flat[offset:offset + p.numel()].view(p.shape))
    one_update = runs[1][2][0]
    assert [n for n, p in named if not torch.equal(one_update[n], p.detach())] == []


def test_a_checkpoint_saved_by_two_workers_resumes_on_one_and_on_four(tiny_policy_dir, batch, runs, shards):
    """Shards saved after update 1 with 2 workers, loaded into 1 and 4, update 2: the bits
    of the uninterrupted run."""
    expected_metrics, expected_weights = runs[1][1][1], runs[1][2][1]
    assert sorted(p.name for p in shards.iterdir()) == ["shard_0.pt", "shard_1.pt"]
    b = batch.slice(0, len(batch))
    b["old_log_probs"] = runs[1][0]
    for num_workers in (1, 4):
        group = WorkerGroup("actor", num_workers, tiny_policy_dir, optim=OPTIM, seed=1, full_determinism=True)
        try:
            group.load(shards, {**group.state_dict(), "num_shards": 2})  # the saver's: 2 shards, this layout
            assert group.update(b, **STEP, loss=LOSS, temperature=1.0) == expected_metrics
            weights = dict(group.named_weights())
        finally:
            group.shutdown()
        assert [k for k in weights if not torch.equal(weights[k], expected_weights[k])] == [], num_workers


def test_a_nan_loss_on_one_rank_stops_every_rank_then_a_killed_worker_is_named(tiny_policy_dir, batch, ray_local):
    group = WorkerGroup("actor", 2, tiny_policy_dir, optim=OPTIM, seed=1, full_determinism=True)
    try:
        b = batch.slice(0, len(batch))
        b["old_log_probs"] = group.compute_log_probs(b, temperature=1.0, micro_batch_size=2)
        before = dict(group.named_weights())
        poisoned = b.slice(0, len(b))
        poisoned["advantages"] = b["advantages"].clone()
        poisoned["advantages"][14:16] = float("nan")  # mini-batch 1's micro-batch 3: on rank 1
        with pytest.raises(NonFiniteError) as info:
            group.update(poisoned, **STEP, loss=LOSS, temperature=1.0)
        assert str(info.value) == ("actor update 1 (epoch 0, mini-batch 1), micro-batch 3: loss is nan; "
                                   "optimizer not stepped")
        # Mini-batch 0 was stepped (every weight moved) before mini-batch 1 failed; the group still works.
        after = dict(group.named_weights())
        assert all(not torch.equal(after[k], before[k]) for k in before)
        group.update(b, **STEP, loss=LOSS, temperature=1.0)

        pid = group.pids[1]
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerError, match=rf"^actor worker 1 \(pid {pid}\) died during update; the actor "
                                              r"group is stopped$"):
            group.update(b, **STEP, loss=LOSS, temperature=1.0)
        assert group.workers == []
    finally:
        group.shutdown()  # a no-op after the failure


def test_a_hung_worker_is_named_after_the_limit_and_the_group_stopped(tiny_policy_dir, ray_local, actor_dead):
    """A rank that is alive but silent (SIGSTOP): without a limit the call would wait forever."""
    group = WorkerGroup("ref", 1, tiny_policy_dir, optim=None, seed=1, full_determinism=True, part_timeout_s=3.0)
    workers, pid = list(group.workers), group.pids[0]
    try:
        os.kill(pid, signal.SIGSTOP)
        with pytest.raises(WorkerError, match=rf"^ref worker 0 \(pid {pid}\) gave no answer within 3 s during "
                                              r"weight_digests \(hung; trainer.part_timeout_s\); the ref group is "
                                              r"stopped$"):
            group.weight_digests()
        assert group.workers == [] and actor_dead(workers[0], within_s=30.0)
    finally:
        group.shutdown()


class _FailingWorker:
    """A `ShardWorker` stand-in whose constructor fails on rank 1 only."""

    def __init__(self, role: str, rank: int, world_size: int, model_path: str, **options) -> None:
        if rank == 1:
            raise ValueError(f"rank {rank} cannot load {model_path}")

    def ready(self) -> int:
        return 0


def test_a_rank_that_fails_to_start_is_named_and_its_peers_are_killed(ray_local, actor_dead, monkeypatch):
    """Started as the trainer starts it (wait=False): rank 1's constructor fails, `wait_ready`
    names it, and rank 0, which started fine, does not outlive the group."""
    monkeypatch.setattr("reprorl.workers.group.ShardWorker", _FailingWorker)
    group = WorkerGroup("actor", 2, "no-model", optim=None, seed=1, full_determinism=True, wait=False)
    workers = list(group.workers)
    with pytest.raises(WorkerError, match=r"^actor worker 1 died during start-up; the actor group is stopped$"):
        group.wait_ready()
    assert [actor_dead(w) for w in workers] == [True, True]
    assert group.workers == []


def test_a_rank_ray_cannot_place_fails_after_the_timeout_and_no_rank_outlives_it(ray_local, actor_dead, monkeypatch):
    """Ranks asking for a GPU that this Ray does not have stay pending: `wait_ready` names
    them and the GPUs asked and free after READY_TIMEOUT_S, instead of waiting forever."""
    monkeypatch.setattr("reprorl.workers.group.ShardWorker", _FailingWorker)
    monkeypatch.setattr("reprorl.actors.pool.READY_TIMEOUT_S", 1.0)
    group = WorkerGroup("critic", 2, "no-model", optim=None, seed=1, full_determinism=True, num_gpus=1, wait=False)
    workers = list(group.workers)
    with pytest.raises(WorkerError, match=r"^critic workers 0, 1 of 2 not started after 1 s \(not placed by Ray, or "
                                          r"still loading\); each asks Ray for 1 GPU and 0 are free"):
        group.wait_ready()
    assert [actor_dead(w) for w in workers] == [True, True]
    assert group.workers == []


def test_weight_digests_on_rank_0_are_the_drivers(tiny_policy_dir, ray_local, tmp_path):
    """The fingerprint's digests computed by rank 0 (bf16 weights, as on the GPU) are the
    ones the driver computes from `named_weights`, in the same order: the same record."""
    from reprorl.fingerprint import FINGERPRINTS_FILE, FingerprintWriter, tensor_digests

    group = WorkerGroup("actor", 1, tiny_policy_dir, optim=OPTIM, seed=1, full_determinism=True, dtype="bfloat16")
    try:
        weights, digests, uuid = group.named_weights(), group.weight_digests(), group.gpu_uuid()
    finally:
        group.shutdown()
    assert uuid is None  # on the CPU: the replicas take the host path
    assert all(t.dtype == torch.bfloat16 for _, t in weights)
    assert list(digests.items()) == list(tensor_digests(weights).items())
    for name, how in (("driver", {"params": weights}), ("rank0", {"param_digests": digests})):
        with FingerprintWriter(tmp_path / name) as writer:
            writer.write(1, {}, **how)
    assert (tmp_path / "driver" / FINGERPRINTS_FILE).read_bytes() == (tmp_path / "rank0" / FINGERPRINTS_FILE).read_bytes()


def test_a_rank_in_this_process_is_freed_at_shutdown(tiny_policy_dir, in_process_group):
    """Its gradient hooks held it through autograd's hook table, a cycle Python's collector
    cannot see: a bench that ran one mode after another in one process kept every earlier
    mode's weights, master and AdamW moments on the GPU (16 GiB at a Llama-3.2-1B shape)."""
    import gc
    import weakref

    group = in_process_group("actor", tiny_policy_dir, optim=OptimArgs(lr=1e-3, total_steps=1))
    rank = weakref.ref(group.workers[0])
    shard = weakref.ref(group.workers[0].shard)
    group.shutdown()
    gc.collect()
    assert rank() is None and shard() is None
