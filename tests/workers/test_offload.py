"""Optimizer offload (workers/offload.py): the master, moments and gradient sums in host
memory give the bits of a rank that keeps them on its device, and checkpoints move between
the two. On the CPU the host is the device, so these check the path (host sums, the host's
threads, the publish) and its bits; tests/kernels/test_optim_math.py and the gpu tests
below check the host against a GPU."""

import pytest
import torch

from reprorl.workers.flat import FlatLayout
from reprorl.workers.grad_tree import GradTree, Parts, max_pending
from reprorl.workers.offload import HostVectors, host_threads
from reprorl.workers.optim import OptimArgs
from reprorl.workers.policy import PolicyLossArgs

OPTIM = OptimArgs(lr=1e-2, weight_decay=0.01, grad_clip=0.5)
# 16 samples, mini-batches of 8, micro-batches of 2: 4 leaves per mini-batch, 2 optimizer steps.
STEP = {"ppo_epochs": 1, "mini_batch_size": 8, "micro_batch_size": 2, "max_response_length": 5,
        "loss": PolicyLossArgs(entropy_coeff=0.01), "temperature": 1.0}


def _train(in_process_group, policy_dir, batch, updates=2, save_to=None, **options):
    """Log-probs, the metrics of `updates` updates, the weights after them; with `save_to`,
    the shards saved after the first."""
    group = in_process_group("actor", policy_dir, optim=OPTIM, seed=1, full_determinism=True, **options)
    b = batch.slice(0, len(batch))
    b["old_log_probs"] = group.compute_log_probs(b, temperature=1.0, micro_batch_size=2)
    metrics = []
    for update in range(updates):
        metrics.append(group.update(b, **STEP))
        if update == 0 and save_to is not None:
            group.save(save_to)
    return group, b, metrics, dict(group.named_weights())


@pytest.mark.parametrize("options", [{}, {"dtype": "bfloat16"}, {"shard_params": True}],
                         ids=["float32", "bf16", "sharded"])
def test_an_offloaded_optimizer_gives_the_bits_of_one_on_the_device(tiny_policy_dir, in_process_group,
                                                                   rollout_batch, options):
    batch = rollout_batch(16, 6, 5, 0)
    _, _, metrics, weights = _train(in_process_group, tiny_policy_dir, batch, **options)
    group, _, got_metrics, got_weights = _train(in_process_group, tiny_policy_dir, batch, optimizer_offload=True,
                                                **options)
    assert got_metrics == metrics
    assert [k for k in weights if not torch.equal(weights[k], got_weights[k])] == []
    worker = group.workers[0]
    assert worker.offload and worker.shard.device.type == "cpu"
    assert len(worker.host_vectors.vectors) == max_pending(4)  # kept from step to step, not made anew
    assert torch.get_num_threads() == 1  # the rank's own count again after the host's step


def test_an_offloaded_checkpoint_resumes_with_and_without_offload(tiny_policy_dir, in_process_group, rollout_batch,
                                                                   tmp_path):
    batch = rollout_batch(16, 6, 5, 0)
    _, b, metrics, weights = _train(in_process_group, tiny_policy_dir, batch, save_to=tmp_path,
                                    optimizer_offload=True)
    for offload in (True, False):
        group = in_process_group("actor", tiny_policy_dir, optim=OPTIM, seed=1, full_determinism=True,
                                 optimizer_offload=offload)
        group.load(tmp_path, {**group.state_dict(), "num_shards": 1})
        assert group.update(b, **STEP) == metrics[1], offload
        got = dict(group.named_weights())
        assert [k for k in weights if not torch.equal(weights[k], got[k])] == [], offload


@pytest.mark.parametrize("count", [1, 3, 8])
def test_a_tree_with_every_sum_on_the_host_takes_back_what_it_added(count):
    """The host pool hands out `max_pending` vectors in all (each sum added into the running
    one goes back), and the result is the device tree's."""
    layout = FlatLayout.of([(f"p{i}", torch.empty(n)) for i, n in enumerate((700, 1500, 96))], world_size=1)
    parts = Parts.of(layout)
    g = torch.Generator().manual_seed(count)
    leaves = [[torch.randn(n, generator=g) * 10.0 ** (leaf % 5 - 2) for n in (700, 1500, 96)] for leaf in range(count)]
    results = []
    for host in (False, True):
        pool = HostVectors(torch.device("cpu"))
        tree = GradTree(0, count, parts, torch.device("cpu"), host_sums=host, host_vectors=pool if host else None)
        for leaf in leaves:
            tree.start_leaf(empty=False)
            for i, grad in enumerate(leaf):
                tree.add(i, grad)
            tree.finish_leaf()
        results.append(tree.result().clone())
        if host:
            assert len(pool.vectors) == max_pending(count)
    assert torch.equal(*results)


def test_host_vectors_are_reused_after_a_reset():
    pool = HostVectors(torch.device("cpu"))
    a, b = pool.take(10), pool.take(10)
    assert a.data_ptr() != b.data_ptr() and len(pool.vectors) == 2
    pool.give(a)
    assert pool.take(10) is a and len(pool.vectors) == 2
    pool.reset()
    assert {pool.take(10).data_ptr(), pool.take(10).data_ptr()} == {a.data_ptr(), b.data_ptr()}
    assert pool.take(20).numel() == 20 and len(pool.vectors) == 3


def test_host_threads_restore_the_count():
    before = torch.get_num_threads()
    with host_threads(True):
        pass
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError), host_threads(True):
        raise RuntimeError("a failed step")
    assert torch.get_num_threads() == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: on the CPU the host is the device")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_on_the_gpu_an_offloaded_optimizer_gives_the_bits_of_one_on_the_gpu(tiny_policy_dir, in_process_group,
                                                                           rollout_batch, dtype):
    batch = rollout_batch(16, 6, 5, 0)
    options = {"device": "cuda", "dtype": dtype}
    _, _, metrics, weights = _train(in_process_group, tiny_policy_dir, batch, **options)
    group, _, got_metrics, got_weights = _train(in_process_group, tiny_policy_dir, batch, optimizer_offload=True,
                                                **options)
    assert got_metrics == metrics
    assert [k for k in weights if not torch.equal(weights[k], got_weights[k])] == []
    assert group.workers[0].shard.device.type == "cpu"
