"""The fixed-order reduce-scatter across real processes (gloo, torch.multiprocessing, no Ray):
each rank's shard is the rank-index tree sum of every rank's piece, whichever way the
pieces travel. The processes run as if on torch 2.11, whose gloo has no all-to-all."""

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from reprorl.workers.flat import FlatLayout, exchange_pieces, fixed_order_reduce_scatter, tree_sum


def full_gradient(rank: int, layout: FlatLayout) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(layout.padded, generator=g) * 10.0 ** torch.randint(-3, 4, (layout.padded,), generator=g)


def _gloo_without_all_to_all(*args, **kwargs):
    raise RuntimeError("Backend gloo does not support alltoall")  # torch 2.11's gloo


def _rank(rank: int, world: int, port: int, layout: FlatLayout, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    dist.all_to_all = _gloo_without_all_to_all  # as on the GPU machine, whatever this torch's gloo has
    try:
        shard = fixed_order_reduce_scatter(full_gradient(rank, layout), layout, dist.group.WORLD)
        send = [torch.full((3,), float(10 * rank + q)) for q in range(world)]
        received = [torch.empty(3) for _ in range(world)]
        exchange_pieces(received, send, dist.group.WORLD)
        results[rank] = (shard, torch.stack(received))
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world", [1, 3])
def test_each_rank_gets_the_rank_ordered_tree_sum_of_its_piece(world):
    layout = FlatLayout(names=("w",), shapes=((5000,),), numel=5000, world_size=world)
    with mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_rank, args=(world, free_port(), layout, results), nprocs=world, start_method="spawn")
        results = dict(results)
    fulls = [full_gradient(r, layout).view(world, layout.shard_size) for r in range(world)]
    for rank in range(world):
        shard, received = results[rank]
        assert torch.equal(shard, tree_sum([f[rank] for f in fulls]))
        assert torch.equal(received[:, 0], torch.tensor([float(10 * r + rank) for r in range(world)]))
