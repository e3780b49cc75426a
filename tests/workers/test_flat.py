"""The pieces of world-size invariance, one at a time, in this process (no Ray)."""

import pytest
import torch

from reprorl.workers.flat import (
    CHUNK,
    EMPTY_GRADIENT,
    FlatLayout,
    bind_params,
    tree_leaves,
    rank_block,
    tree_reduce,
    tree_sum,
)
from reprorl.workers.optim import OptimArgs, make_adamw, step_in_chunks


def test_tree_sum_groups_as_halves_by_index():
    # float32, where 2**24 + 1 rounds back to 2**24: the tree (big + 1) + (1 - big) gives 1,
    # the left-to-right sum ((big + 1) + 1) - big gives 0.
    big, one = 2.0**24, 1.0
    values = [torch.tensor([v], dtype=torch.float32) for v in (big, one, one, -big)]
    assert float(tree_sum(values)) == 1.0
    assert float(((values[0] + values[1]) + values[2]) + values[3]) == 0.0
    # Three leaves: [0, 1) + [1, 3).
    assert torch.equal(tree_sum(values[:3]), values[0] + (values[1] + values[2]))
    assert [float(v) for v in values] == [big, one, one, -big]  # the inputs are left as they were


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_rank_blocks_are_subtrees_of_the_micro_batch_tree(world_size):
    """Each rank sums its block, then the block sums go through the tree over ranks: the
    same bits as one worker's tree over all 8 micro-batches (the rule for trainer.num_workers)."""
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(1000, generator=g) * 10.0 ** float(torch.randint(-3, 4, (1,), generator=g))
             for _ in range(8)]
    per_rank = 8 // world_size
    blocks = [tree_sum(grads[r * per_rank:(r + 1) * per_rank]) for r in range(world_size)]
    assert torch.equal(tree_sum(blocks), tree_sum(grads))


def _bits(t):
    return t.view(torch.int32)  # torch.equal calls -0.0 and +0.0 equal; the bits do not


def _ranked_tree_sum(grads, leaves, world_size, empty=EMPTY_GRADIENT):
    """As ShardWorker._step: each rank's block of `leaves` summed by `tree_reduce` (empty
    leaves skipped, an all-empty block sent as `empty`), then the tree over ranks."""
    per_rank = len(leaves) // world_size
    blocks = []
    for r in range(world_size):
        block = tree_reduce(r * per_rank, (r + 1) * per_rank,
                            lambda s: None if leaves[s] is None else grads[leaves[s]].clone())
        blocks.append(torch.full_like(grads[0], empty) if block is None else block)
    return tree_sum(blocks)


@pytest.mark.parametrize("count", [1, 2, 3, 5, 6, 7, 8, 9, 13])
def test_tree_leaves_give_the_same_bits_at_every_power_of_two_world_size(count):
    """Any micro-batch count (a token budget's, or a config's): the same gradient bits at N = 1 .. 16,
    -0.0 entries included (some ranks hold only empty leaves at large N)."""
    g = torch.Generator().manual_seed(count)
    grads = [torch.randn(1000, generator=g) * 10.0 ** float(torch.randint(-3, 4, (1,), generator=g))
             for _ in range(count)]
    for grad in grads:
        grad[:10] = -0.0  # a gradient entry no micro-batch moves, with its sign
    expected = _ranked_tree_sum(grads, tree_leaves(count, 1), 1)
    assert _bits(expected)[:10].eq(_bits(torch.tensor(-0.0))).all()
    for world_size in (2, 4, 8, 16):
        leaves = tree_leaves(count, world_size)
        assert sorted(k for k in leaves if k is not None) == list(range(count)) and len(leaves) % world_size == 0
        assert torch.equal(_bits(_ranked_tree_sum(grads, leaves, world_size)), _bits(expected)), world_size


def test_an_empty_rank_sending_plus_zero_would_flip_a_minus_zero():
    grads = [torch.full((4,), -0.0)]  # one micro-batch, 2 ranks: rank 1's only leaf is empty
    assert _bits(_ranked_tree_sum(grads, tree_leaves(1, 2), 2)).eq(_bits(torch.tensor(-0.0))).all()
    assert _bits(_ranked_tree_sum(grads, tree_leaves(1, 2), 2, empty=0.0)).eq(0).all()


def test_tree_leaves_share_the_micro_batches_evenly_at_every_world_size():
    # 5 micro-batches on P = 8 leaves: leaf s holds one where bit_reverse(s) < 5.
    assert tree_leaves(5, 1) == [0, 1, 2, None, 3, None, 4, None]
    assert tree_leaves(5, 16) == [0, 1, 2, None, 3, None, 4, None] + [None] * 8
    assert tree_leaves(8, 2) == list(range(8)) and tree_leaves(1, 1) == [0]
    for count in range(1, 40):
        for world_size in (1, 2, 4, 8):
            leaves = tree_leaves(count, world_size)
            per_rank = len(leaves) // world_size
            held = [sum(k is not None for k in leaves[r * per_rank:(r + 1) * per_rank]) for r in range(world_size)]
            assert max(held) - min(held) <= 1, (count, world_size, held)
            # Each rank's micro-batches are a contiguous run of micro-batch indices, in order.
            order = [k for k in leaves if k is not None]
            assert order == list(range(count))
    with pytest.raises(ValueError, match="power-of-two world_size"):
        tree_leaves(4, 3)


def test_a_world_size_that_is_not_a_power_of_two_would_regroup_the_sum():
    # 6 micro-batches on 3 ranks: blocks [0, 2) [2, 4) [4, 6), but the tree cuts [0, 3) [3, 6).
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(4096, generator=g) for _ in range(6)]
    blocks = [tree_sum(grads[i:i + 2]) for i in (0, 2, 4)]
    assert not torch.equal(tree_sum(blocks), tree_sum(grads))


def test_layout_shards_cover_the_padded_vector_in_whole_chunks():
    params = [("a", torch.zeros(3, 1000)), ("b", torch.zeros(5000)), ("c", torch.zeros(7))]
    layout = FlatLayout.of(params, world_size=4)
    assert layout.numel == 8007 and layout.num_chunks == 2
    assert layout.shard_size == CHUNK and layout.padded == 4 * CHUNK  # ranks 2 and 3 own padding only
    assert [layout.shard_range(r) for r in range(4)] == [(i * CHUNK, (i + 1) * CHUNK) for i in range(4)]
    assert layout.offsets() == [0, 3000, 8000]
    assert rank_block(5, 0, 4) == (0, 2) and rank_block(5, 2, 4) == (4, 5) and rank_block(5, 3, 4) == (5, 5)


def test_bound_parameters_are_views_of_the_flat_vector():
    model = torch.nn.Linear(3, 2)
    before = [p.detach().clone() for p in model.parameters()]
    layout = FlatLayout.of(model.named_parameters(), world_size=2)
    flat = bind_params(list(model.parameters()), layout)
    assert [torch.equal(p, b) for p, b in zip(model.parameters(), before)] == [True, True]
    assert flat.shape == (layout.padded,) and torch.equal(flat[8:], torch.zeros(layout.padded - 8))
    flat[0] = 5.0
    assert model.weight[0, 0].item() == 5.0


def test_adamw_on_shards_equals_adamw_on_the_whole_vector():
    """AdamW is elementwise: cutting the vector anywhere changes no bit of any element."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    n = 3 * CHUNK + 123
    start, grads = torch.randn(n, generator=g), [torch.randn(n, generator=g) for _ in range(3)]

    def train(cuts):
        pieces = [torch.nn.Parameter(start[a:b].clone()) for a, b in zip(cuts[:-1], cuts[1:])]
        opt = make_adamw(pieces, OptimArgs(lr=1e-3, weight_decay=0.01))
        for grad in grads:
            for p, a, b in zip(pieces, cuts[:-1], cuts[1:]):
                p.grad = grad[a:b].clone()
                step_in_chunks(opt, p)
        return torch.cat([p.detach() for p in pieces])

    whole = train([0, n])
    for cuts in ([0, CHUNK, n], [0, 1, 17, 2 * CHUNK + 5, n], [0, CHUNK, 2 * CHUNK, 3 * CHUNK, n]):
        assert torch.equal(train(cuts), whole), cuts


def test_chunk_sums_of_squares_do_not_depend_on_how_many_chunks_are_summed_at_once():
    torch.set_num_threads(1)
    x = torch.randn(8 * CHUNK, generator=torch.Generator().manual_seed(0))
    every = x.view(-1, CHUNK).square().sum(dim=-1)
    for lo, hi in ((0, 1), (3, 5), (4, 8), (1, 8)):
        assert torch.equal(x[lo * CHUNK:hi * CHUNK].view(-1, CHUNK).square().sum(dim=-1), every[lo:hi])
