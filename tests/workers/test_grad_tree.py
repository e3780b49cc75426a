"""GradTree (workers/grad_tree.py) against the plain tree_reduce of flattened leaves: the same bits."""

from __future__ import annotations

import random

import pytest
import torch

from reprorl.workers.flat import CHUNK, FlatLayout, flatten, tree_reduce
from reprorl.workers.grad_tree import GradTree, Parts, gpu_vectors_held, max_pending, on_host, pushed_spans, tree_pops

SHAPES = [(3, 5), (7,), (CHUNK + 11,), (2, 2)]  # padding after the last one


def leaf_grads(leaf: int, dtype: torch.dtype) -> list[torch.Tensor | None]:
    """One micro-batch's gradients: magnitudes from 1e-8 to 1e8 (so the order of the sum
    shows in the bits), signed zeros, and parameter 3 unreached (None) on odd leaves."""
    g = torch.Generator().manual_seed(leaf)
    grads: list[torch.Tensor | None] = []
    for shape in SHAPES:
        t = torch.randn(shape, generator=g) * 10.0 ** torch.randint(-8, 9, shape, generator=g)
        t.view(-1)[:3] = torch.tensor([-0.0, 0.0, -0.0])
        grads.append(t.to(dtype))
    if leaf % 2:
        grads[3] = None
    return grads


def plain_sum(lo: int, hi: int, leaves: list[int | None], layout: FlatLayout, dtype: torch.dtype):
    """As ShardWorker._step did: each leaf flattened to a new float32 vector, then tree_reduce."""
    def leaf(i: int) -> torch.Tensor | None:
        if leaves[i] is None:
            return None
        grads = leaf_grads(leaves[i], dtype)
        grads = [torch.zeros(s, dtype=dtype) if t is None else t for s, t in zip(SHAPES, grads)]
        return flatten(grads, layout, torch.float32)

    return tree_reduce(lo, hi, leaf)


def streamed_sum(lo: int, hi: int, leaves: list[int | None], layout: FlatLayout, dtype: torch.dtype):
    """GradTree fed each leaf's parameters in a shuffled order, unreached ones never added."""
    tree = GradTree(lo, hi, Parts.of(layout), torch.device("cpu"))
    order = random.Random(lo * 100 + hi)
    for i in range(lo, hi):
        tree.start_leaf(empty=leaves[i] is None)
        if leaves[i] is not None:
            grads = leaf_grads(leaves[i], dtype)
            for index in order.sample(range(len(grads)), len(grads)):
                if grads[index] is not None:
                    tree.add(index, grads[index])
        tree.finish_leaf()
    return tree.result()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lo,hi", [(0, 1), (0, 2), (0, 3), (2, 7), (0, 8), (3, 12)])
def test_streamed_tree_gives_the_bits_of_tree_reduce(lo, hi, dtype):
    layout = FlatLayout.of([(f"p{i}", torch.empty(s)) for i, s in enumerate(SHAPES)], world_size=2)
    leaves = [None if i % 5 == 4 else i for i in range(hi)]  # some empty leaves
    expected = plain_sum(lo, hi, leaves, layout, dtype)
    got = streamed_sum(lo, hi, leaves, layout, dtype)
    assert got.dtype == torch.float32 and got.shape == (layout.padded,)
    assert torch.equal(got, expected)
    assert torch.equal(torch.signbit(got), torch.signbit(expected))  # equal treats -0.0 == 0.0
    if hi - lo >= 3:  # the data tells orders apart: a running sum has other bits
        running = sum(flatten([torch.zeros(s) if t is None else t.float() for s, t in
                               zip(SHAPES, leaf_grads(k, dtype))], layout) for k in leaves[lo:hi] if k is not None)
        assert not torch.equal(running, expected)


def test_all_empty_leaves_sum_to_none():
    layout = FlatLayout.of([("p", torch.empty(5))], world_size=1)
    tree = GradTree(0, 3, Parts.of(layout), torch.device("cpu"))
    for _ in range(3):
        tree.start_leaf(empty=True)
        tree.finish_leaf()
    assert tree.result() is None


def test_pops_and_pending_vectors_of_small_trees():
    # [0, 4): leaf 1 closes [0, 2); leaf 3 closes [2, 4) then [0, 4).
    assert tree_pops(0, 4) == [0, 1, 0, 2]
    # [0, 3) = [0, 1) + [1, 3): leaf 2 closes [1, 3) then [0, 3).
    assert tree_pops(0, 3) == [0, 0, 2]
    assert [max_pending(m) for m in (1, 2, 3, 4, 7, 8, 16)] == [1, 1, 2, 2, 3, 3, 4]


@pytest.mark.parametrize("count", [1, 3, 8, 13])
def test_a_tree_never_holds_more_vectors_than_max_pending(count):
    layout = FlatLayout.of([("p", torch.empty(5))], world_size=1)
    tree = GradTree(0, count, Parts.of(layout), torch.device("cpu"))
    peak = 0
    for i in range(count):
        tree.start_leaf(empty=False)
        tree.add(0, torch.full((5,), float(i)))
        alive = {t.data_ptr() for t in tree.stack + tree.taken + [tree.target] if t is not None}
        peak = max(peak, len(alive))
        tree.finish_leaf()
    assert peak == max_pending(count)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_hooks_on_a_tied_model_give_the_bits_of_flattened_leaves(checkpointing):
    """As ShardWorker feeds it: post-accumulate-grad hooks fold each parameter's gradient
    (the tied embedding gets both uses' sum before its hook runs) and free it."""
    from reprorl.models.tiny import init_weights, tiny_args
    from reprorl.models.transformer import CausalLM

    model = CausalLM(tiny_args("policy"))
    init_weights(model, seed=0)
    model.model.gradient_checkpointing = checkpointing
    params = [p for p in model.parameters() if p.requires_grad]
    layout = FlatLayout.of([(str(i), p) for i, p in enumerate(params)], world_size=1)
    g = torch.Generator().manual_seed(0)
    micros = [torch.randint(0, model.args.vocab_size, (2, 7), generator=g) for _ in range(5)]

    def loss(ids: torch.Tensor) -> torch.Tensor:
        return model(ids).float().log_softmax(-1)[..., 3].mean()

    def flat_leaf(i: int) -> torch.Tensor:
        for p in params:
            p.grad = None
        loss(micros[i]).backward()
        return flatten([p.grad if p.grad is not None else torch.zeros_like(p) for p in params], layout, torch.float32)

    expected = tree_reduce(0, len(micros), flat_leaf)
    for p in params:
        p.grad = None
    tree = GradTree(0, len(micros), Parts.of(layout), torch.device("cpu"))

    def fold(index: int, param: torch.nn.Parameter) -> None:
        tree.add(index, param.grad)
        param.grad = None

    handles = [p.register_post_accumulate_grad_hook(lambda p, i=i: fold(i, p)) for i, p in enumerate(params)]
    for ids in micros:
        tree.start_leaf(empty=False)
        loss(ids).backward()
        tree.finish_leaf()
    for h in handles:
        h.remove()
    assert all(p.grad is None for p in params)
    assert torch.equal(tree.result(), expected)


def test_sums_of_2k_leaves_wait_on_the_host_and_the_device_holds_k_vectors():
    # [0, 8): leaves 1, 3, 5 push sums of 2, 4, 2 leaves; leaf 7 is the root, on the device
    assert pushed_spans(0, 8) == [1, 2, 1, 4, 1, 2, 1, 8]
    assert on_host(0, 8, 0) == [False] * 8
    assert on_host(0, 8, 1) == [False, True, False, True, False, True, False, False]
    assert on_host(0, 8, 2) == [False, False, False, True, False, False, False, False]
    for count in (4, 8, 16, 32):  # a power of two: k vectors, each more one halving the host's sums
        assert [gpu_vectors_held(count, k) for k in range(1, 6)] == [min(k, max_pending(count)) for k in range(1, 6)]
        assert [sum(on_host(0, count, k)) for k in (1, 2)] == [count // 2 - 1, count // 4 - 1]
    for count in (3, 5, 6, 7, 12, 13):  # other widths: never more than k (at worst every sum on the host)
        for k in range(1, 5):
            assert gpu_vectors_held(count, k) <= k
    assert gpu_vectors_held(13, 0) == max_pending(13)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: host memory is the device on the CPU")
@pytest.mark.parametrize("count", [5, 8])
def test_host_sums_on_cuda_give_the_same_bits_and_hold_at_most_k_vectors(count):
    shapes = [(1 << 16,)] * 24 + [(3 << 14,)]  # small against a vector: per-parameter copies stay small
    layout = FlatLayout.of([(f"p{i}", torch.empty(s)) for i, s in enumerate(shapes)], world_size=1)
    vector = layout.padded * 4
    grads = [[torch.randn(s, generator=torch.Generator().manual_seed(10 * leaf + i)).cuda() * 10.0 ** (leaf % 7 - 3)
              for i, s in enumerate(shapes)] for leaf in range(count)]
    results, peaks = {}, {}
    for k in (0, 1, 2, 3):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        tree = GradTree(0, count, Parts.of(layout), torch.device("cuda"), gpu_vectors=k)
        for leaf in range(count):
            tree.start_leaf(empty=False)
            for index, g in enumerate(grads[leaf]):
                tree.add(index, g)
            tree.finish_leaf()
        results[k] = tree.result()
        torch.cuda.synchronize()
        peaks[k] = (torch.cuda.max_memory_allocated() - base) / vector
        del tree
    for k in (1, 2, 3):
        assert torch.equal(results[k], results[0])
    for k in (0, 1, 2, 3):  # whole vectors, plus small per-parameter copies (a piece from the host)
        assert peaks[k] < gpu_vectors_held(count, k) + 0.25, (k, peaks)
