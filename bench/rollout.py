"""Rollout throughput: reprorl's engine vs transformers' `generate`, on the CPU.

Generated tokens per second for a tiny model (width 128) and a wider one (width 512,
random weights), at batches 1, 16 and 64, 128 new tokens each (eos ignored, so every
row has the same length), for:
  - `hf`: `AutoModelForCausalLM.generate` on the same HF directory, sampling at T=1,
  - `engine`: `Engine` with determinism off (`batch_invariant=False`),
  - `engine-det`: `Engine` with determinism on (`batch_invariant=True`).
Every measurement runs in a fresh Python process that does nothing else (as a replica
does): in-process, whichever backend ran second would find the first one's OpenMP thread
team still on the cores and lose up to 2x (see reprorl/rollout/engine.py, Threading).
Each row also records the process CPU seconds, steadier than wall time when other work
shares the cores; `--repeats N` alternates the three backends N times and keeps each
one's best. Prints a table (ratios by wall and by CPU time) and writes
bench/results/rollout.json.

Targets (CPU): at batch 64 the engine >= 2x `hf`; determinism costs <= 25% of the
engine's throughput. Run it on an otherwise idle machine; `--quick` only checks that
the script works (small sizes; its figures mean little).

    python bench/rollout.py                        # the real figures
    python bench/rollout.py --quick                # smoke run
    python bench/rollout.py --threads 1 --batches 64 --models wide --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time

import torch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "rollout.json")


def make_wide(out_dir: str, hidden: int = 512, layers: int = 4, seed: int = 0) -> str:
    """A Qwen2 of width `hidden` with random weights and the char tokenizer, saved as HF."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from reprorl.models.tokenizer import make_char_tokenizer

    tok = make_char_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


def prompts(batch: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 128) for _ in range(prompt_len)] for _ in range(batch)]


class Timer:
    """Wall and process CPU seconds of a block (CPU time is steadier on a shared machine)."""

    def __enter__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu


def bench_hf(path: str, batch: int, prompt_len: int, new_tokens: int) -> Timer:
    """Time `generate` of `batch` equal-length prompts, sampling, no early stop."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor(prompts(batch, prompt_len))
    kwargs = dict(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=0,
    )
    with torch.inference_mode():
        model.generate(ids[:1, :8], **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
        with Timer() as t:
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    assert out.shape == (batch, prompt_len + new_tokens), out.shape
    return t


def bench_engine(path: str, batch: int, prompt_len: int, new_tokens: int, deterministic: bool) -> Timer:
    """Time `batch` concurrent requests through one `Engine`, no early stop."""
    from reprorl.rollout.engine import Engine
    from reprorl.rollout.sampling import SamplingParams

    engine = Engine.from_path(
        path,
        batch_invariant=deterministic,
        max_num_seqs=max(batch, 1),
        max_num_batched_tokens=max(batch * prompt_len, 512),
    )
    params = SamplingParams(temperature=1.0, max_tokens=new_tokens, ignore_eos=True)

    async def run(ps: list[list[int]], p: SamplingParams) -> list:
        return await asyncio.gather(*[engine.generate(f"r{i}", x, p, seed=i) for i, x in enumerate(ps)])

    async def main() -> Timer:
        await run(prompts(1, 8), SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        with Timer() as t:
            outs = await run(prompts(batch, prompt_len), params)
        assert all(len(o.token_ids) == new_tokens for o in outs)
        return t

    try:
        return asyncio.run(main())
    finally:
        engine.shutdown()


def measure(backend: str, path: str, batch: int, prompt_len: int, new_tokens: int, threads: int | None) -> Timer:
    """One measurement in a fresh process (see the module doc): returns its Timer."""
    cmd = [sys.executable, os.path.abspath(__file__), "--one", backend, path, str(batch), str(prompt_len), str(new_tokens)]
    if threads:
        cmd += ["--threads", str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    out = proc.stdout
    t = Timer()
    t.wall, t.cpu = json.loads(out.strip().splitlines()[-1])
    return t


def run_one(argv: list[str]) -> None:
    """The child side of `measure`: time one backend, print [wall, cpu] as JSON."""
    backend, path, batch, prompt_len, new_tokens = argv[0], argv[1], *map(int, argv[2:5])
    import transformers

    transformers.logging.set_verbosity_error()
    if backend == "hf":
        t = bench_hf(path, batch, prompt_len, new_tokens)
    else:
        t = bench_engine(path, batch, prompt_len, new_tokens, deterministic=backend == "engine-det")
    print(json.dumps([t.wall, t.cpu]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: checks the script works")
    parser.add_argument("--batches", type=int, nargs="*", default=None, help="batch sizes (default 1 16 64)")
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens generated per request (default 128)")
    parser.add_argument("--prompt-len", type=int, default=None, help="prompt tokens per request (default 32)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--models", nargs="*", default=["tiny", "wide"], help="which of: tiny wide")
    parser.add_argument("--repeats", type=int, default=1, help="alternating measurements per backend (best kept)")
    parser.add_argument("--out", default=RESULTS, help="where the JSON goes")
    parser.add_argument("--one", nargs=5, metavar="ARG", help=argparse.SUPPRESS)  # a child of `measure`
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.one:
        run_one(args.one)
        return
    batches = args.batches or ([1, 8] if args.quick else [1, 16, 64])
    new_tokens = args.new_tokens or (16 if args.quick else 128)
    prompt_len = args.prompt_len or (8 if args.quick else 32)

    import transformers

    from reprorl.models.tiny import make_tiny

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        models = {}
        if "tiny" in args.models:
            models["tiny (w128)"] = str(make_tiny(os.path.join(tmp, "tiny"), kind="policy", seed=0))
        if "wide" in args.models:
            models["wide (w512)"] = make_wide(os.path.join(tmp, "wide"))
        for name, path in models.items():
            for batch in batches:
                # Backends alternate within each repeat and the best time of each is kept, so
                # load from other work on the machine hits all three alike.
                best = {}
                for _ in range(args.repeats):
                    for backend in ("hf", "engine", "engine-det"):
                        t = measure(backend, path, batch, prompt_len, new_tokens, args.threads)
                        if backend not in best or t.wall < best[backend].wall:
                            best[backend] = t
                for backend, t in best.items():
                    row = {
                        "model": name,
                        "batch": batch,
                        "backend": backend,
                        "new_tokens": new_tokens,
                        "prompt_len": prompt_len,
                        "seconds": round(t.wall, 4),
                        "cpu_seconds": round(t.cpu, 4),
                        "tokens_per_s": round(batch * new_tokens / t.wall, 1),
                        "tokens_per_cpu_s": round(batch * new_tokens / t.cpu, 1),
                    }
                    rows.append(row)
                    print(
                        f"{name:12} batch {batch:4} {backend:11} {row['tokens_per_s']:10.1f} tok/s"
                        f"  ({t.wall:.2f} s wall, {t.cpu:.2f} s cpu)",
                        flush=True,
                    )

    summary = []
    for name in models:
        for batch in batches:
            tps = {r["backend"]: r["tokens_per_s"] for r in rows if r["model"] == name and r["batch"] == batch}
            cps = {r["backend"]: r["tokens_per_cpu_s"] for r in rows if r["model"] == name and r["batch"] == batch}
            summary.append(
                {
                    "model": name,
                    "batch": batch,
                    "engine_vs_hf": round(tps["engine"] / tps["hf"], 2),
                    "engine_det_vs_hf": round(tps["engine-det"] / tps["hf"], 2),
                    "determinism_cost": round(1 - tps["engine-det"] / tps["engine"], 3),
                    "engine_vs_hf_cpu": round(cps["engine"] / cps["hf"], 2),
                    "determinism_cost_cpu": round(1 - cps["engine-det"] / cps["engine"], 3),
                }
            )
    print()
    print(f"{'model':12} {'batch':>5} {'engine/hf':>10} {'det/hf':>8} {'det cost':>9}   by cpu time: {'engine/hf':>9} {'det cost':>9}")
    for s in summary:
        print(
            f"{s['model']:12} {s['batch']:5} {s['engine_vs_hf']:10.2f} {s['engine_det_vs_hf']:8.2f} "
            f"{s['determinism_cost']:9.1%}   {'':13}{s['engine_vs_hf_cpu']:9.2f} {s['determinism_cost_cpu']:9.1%}"
        )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {
                "quick": args.quick,
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "cpu": platform.processor() or platform.machine(),
                "rows": rows,
                "summary": summary,
            },
            f,
            indent=2,
        )
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
