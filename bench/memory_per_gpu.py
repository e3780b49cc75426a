"""The memory check's per-GPU estimate (`reprorl config ... --memory`) for large shapes on
several GPUs, full fine-tuning and LoRA: what `reprorl.resources.memory` says each GPU of a
node would hold, before any run. No GPU is needed; it reads config.json only.

    python3 bench/memory_per_gpu.py --out bench/results/memory_per_gpu.json

Shapes from bench/shapes.py (Qwen2.5-7B, 14B and 32B widths); the run: GRPO with a KL
loss (so full fine-tuning has a reference group), 32 prompts x 8, 128 + 256 tokens,
micro-batch 4, gradient checkpointing, bf16, the rollout replicas colocated (one a GPU),
on 1 and 8 GPUs (one trainer rank a GPU). On several GPUs both ways: weights whole on every
rank with float32 master weights and AdamW moments sharded over the ranks (ZeRO-2), and
with the parameters sharded at rest too (`model.shard_params=true`, ZeRO-3: workers/units.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from shapes import SHAPES, shape_args

from reprorl.config import load_config
from reprorl.resources.memory import GIB, estimate_memory

RUN = ["actor.use_kl_loss=true", "data.train_batch_size=32", "rollout.n=8", "data.max_prompt_length=128",
       "data.max_response_length=256", "actor.ppo_mini_batch_size=32", "actor.ppo_micro_batch_size=4",
       "model.gradient_checkpointing=true", "model.dtype=bfloat16", "resources.device=cuda"]


def estimate(model_dir: Path, gpus: int, lora_rank: int, shard_params: bool) -> dict:
    cfg = load_config(None, [f"model.path={model_dir}", f"trainer.num_workers={gpus}", f"rollout.num_replicas={gpus}",
                             f"model.lora_rank={lora_rank}", "model.lora_alpha=128",
                             f"model.shard_params={str(shard_params).lower()}", *RUN])
    est = estimate_memory(cfg)
    return {"peak_gib": round(est.peak / GIB, 2), "peak_phase": est.peak_phase,
            "resident_gib": {k: round(v / GIB, 2) for k, v in est.resident.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["7b", "14b", "32b"], choices=sorted(SHAPES))
    ap.add_argument("--gpus", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for shape in args.shapes:
            model_dir = Path(scratch) / shape
            model_dir.mkdir()
            (model_dir / "config.json").write_text(json.dumps(shape_args(SHAPES[shape]).to_hf_config()))
            for lora_rank in (0, 64):
                for gpus in args.gpus:
                    for sharded in (False, True) if gpus > 1 else (False,):
                        row = {"shape": shape, "gpus": gpus, "lora_rank": lora_rank, "shard_params": sharded,
                               **estimate(model_dir, gpus, lora_rank, sharded)}
                        results.append(row)
                        print(f"{shape:>4} {'LoRA r64' if lora_rank else 'full FT':>8} {gpus} GPU(s)"
                              f"{', sharded at rest' if sharded else '':<18}: "
                              f"{row['peak_gib']:7.1f} GiB a GPU at its peak ({row['peak_phase']})", flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"run": RUN, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
