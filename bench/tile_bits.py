"""Do a linear's bits depend on its Triton tile? (H200 probe, prints and saves JSON.)

The batch-invariant linear (reprorl/kernels/gpu/matmul.py) keeps one tile per (N, K, dtype)
so that a row's arithmetic never depends on M. This probe computes the same product with
every candidate tile (`matmul.CANDIDATE_TILES`, both kernels), and groups the tiles whose outputs are
bitwise equal: the evidence for or against choosing tiles by M as well.

    python bench/tile_bits.py [--out bench/results/tile_bits.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {"0.5b q": (896, 896), "0.5b gate": (896, 4864), "7b k/v": (3584, 512), "7b down": (18944, 3584)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "tile_bits.json"))
    args = parser.parse_args()
    import triton

    from reprorl.kernels.gpu import matmul as tl_matmul

    torch.manual_seed(0)
    results = []
    original = tl_matmul.tile_for
    try:
        for label, (k, n) in SHAPES.items():
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            x = torch.randn(256, k, device="cuda", dtype=torch.bfloat16)
            groups: list[tuple[torch.Tensor, list[str]]] = []
            for tile in tl_matmul.CANDIDATE_TILES:
                tl_matmul.tile_for = lambda n_, k_, d_, m_, tile=tile: tile
                try:
                    out = tl_matmul.matmul(x, w)
                except (triton.runtime.errors.OutOfResources, triton.compiler.errors.CompilationError):
                    continue
                name = (f"{tile.block_m}x{tile.block_n}x{tile.block_k} w{tile.num_warps} s{tile.num_stages} "
                        f"{'tma' if tile.tma else 'ptr'}")
                for ref, names in groups:
                    if torch.equal(ref, out):
                        names.append(name)
                        break
                else:
                    groups.append((out, [name]))
            print(f"{label} {k}->{n}: {len(groups)} distinct results", flush=True)
            for _, names in groups:
                print(f"    {', '.join(names)}")
            results.append({"shape": label, "k": k, "n": n, "groups": [names for _, names in groups]})
    finally:
        tl_matmul.tile_for = original
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
