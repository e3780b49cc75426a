"""The Triton linear's tile table and its candidates, without a GPU.

The table (`matmul.tile_for`) may only pick a bf16 tile from `CANDIDATE_TILES`: those are
the tiles checked for equal bits on the GPU (bench/tile_bits.py, since removed: its result
is in docs/performance.md), so a tile added to the table without that check fails here.
Each candidate's arithmetic (its masks at edges that no block divides) is checked under
the interpreter against float64."""

import pytest
import torch

from reprorl.kernels.gpu import matmul

# (hidden, intermediate, heads, kv heads, head_dim, vocab): the models the kernels issue names.
MODELS = {
    "qwen2.5-0.5b": (896, 4864, 14, 2, 64, 151936),
    "qwen2.5-1.5b": (1536, 8960, 12, 2, 128, 151936),
    "qwen2.5-7b": (3584, 18944, 28, 4, 128, 152064),
    "qwen3-8b": (4096, 12288, 32, 8, 128, 151936),
}
# Each bucket's edges and the row counts between them.
ROWS = (1, 64, matmul.ROW_BUCKETS[0], matmul.ROW_BUCKETS[0] + 1, 256, matmul.ROW_BUCKETS[1],
        matmul.ROW_BUCKETS[1] + 1, 4096)


def shapes():
    for hidden, inter, heads, kv, hd, vocab in MODELS.values():
        yield from ((hidden, heads * hd), (hidden, kv * hd), (heads * hd, hidden), (hidden, inter),
                    (inter, hidden), (hidden, vocab))


def test_the_table_picks_only_candidate_tiles():
    chosen = {matmul.tile_for(n, k, torch.bfloat16, m) for k, n in shapes() for m in ROWS}
    assert chosen <= set(matmul.CANDIDATE_TILES), f"not a candidate: {chosen - set(matmul.CANDIDATE_TILES)}"


def test_candidates_are_distinct_and_cover_both_kernels():
    assert len(set(matmul.CANDIDATE_TILES)) == len(matmul.CANDIDATE_TILES)
    assert {t.tma for t in matmul.CANDIDATE_TILES} == {True, False}


@pytest.mark.parametrize("tile", matmul.CANDIDATE_TILES,
                         ids=lambda t: f"{t.block_m}x{t.block_n}x{t.block_k}-{'tma' if t.tma else 'ptr'}")
def test_each_candidate_computes_the_product(tile, monkeypatch):
    """Under the interpreter, at edges no block divides (M 5, N 40, K 272 with a bias)."""
    if not matmul.INTERPRETED:
        pytest.skip("arithmetic under TRITON_INTERPRET=1 (the GPU tests cover the GPU)")
    monkeypatch.setattr(matmul, "tile_for", lambda n, k, dtype, m: tile)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 272, generator=g).to(torch.bfloat16)
    w = (torch.randn(40, 272, generator=g) * 0.05).to(torch.bfloat16)
    bias = torch.randn(40, generator=g).to(torch.bfloat16)
    out = matmul.matmul(x, w, bias)
    ref = x.double() @ w.double().T + bias.double()
    # One bf16 rounding of a float32 sum of 272 products: within 2^-8 of the value's size.
    assert out.dtype == torch.bfloat16 and out.shape == (5, 40)
    assert ((out.double() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-2).all()
