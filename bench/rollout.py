"""Rollout throughput: reprorl's engine vs transformers' `generate`, on the CPU or a GPU.

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

GPU (`--device cuda`, one process, about 4-5 minutes on an H200): Qwen2.5-0.5B- and
1.5B-shaped models with random weights, bf16, prompt 128 + 256 new tokens, batches 64 and
256, every sample from the full distribution (T=1, top_k off, top_p 1) on both sides:
  - `engine` / `engine-det`: the engine with determinism off / on, as a replica runs it (CUDA
    graphs, device sampling, lookahead: step t+1 launched before step t is read; "on" with
    torch's deterministic algorithms, as `full_determinism` sets them),
  - `engine-n8` / `engine-n8-noshare`: 32 prompts x 8 samples with and without prefix sharing,
  - `engine-sync`: `engine` at batch 256 without lookahead (each step read before the next),
  - `hf` / `hf-topk50`: `generate` on the full distribution / with its default top-k of 50.
Each engine row also gives `gpu_busy`: the steps' device span over the run's wall time
(see `Engine._timed_step`). Targets (issue 13): engine >= 40,000 tok/s at batch 256 on
0.5B, >= 10x `hf` and >= 3x `hf-topk50`; engine-det >= 0.8x engine. Rows past
`--budget-s` are skipped (listed in the JSON), and the JSON is rewritten after each row.

    python bench/rollout.py --device cuda --out bench/results/rollout_cuda.json

`--profile` (with `--device cuda`) runs no table: torch.profiler over 8 decode steps of the
first model at batch 256 (engine, engine-det, engine-sync), printing and saving the top kernels by
CUDA time, their groups (linear, attention, sampling...) in ms a step, and the share of the
window the GPU runs a kernel.

    python bench/rollout.py --device cuda --profile --out bench/results/rollout_profile.json
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time

import torch

from profiling import kernel_summary, print_summary  # bench/profiling.py (the script's folder is on sys.path)
from shapes import SHAPES, shape_args  # bench/shapes.py

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
    from reprorl.rollout.request import SamplingParams

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


GPU_MODELS = {"qwen2.5-0.5b": "0.5b", "qwen2.5-1.5b": "1.5b", "llama3.2-1b": "llama3.2-1b",
              "gemma3-1b": "gemma3-1b"}  # name here -> bench/shapes.py's
GPU_PROMPT, GPU_NEW, GPU_BATCHES = 128, 256, (64, 256)


def gpu_models(name: str):
    """(transformers model, reprorl CausalLM) of one shape on the GPU, bf16, the same random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from reprorl.models.transformer import CausalLM

    args = shape_args({**SHAPES[GPU_MODELS[name]], "max_position_embeddings": 2048}, "bfloat16")
    config = AutoConfig.for_model(**{**args.to_hf_config(), "bos_token_id": None, "eos_token_id": None,
                                     "pad_token_id": 0})
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16).eval()
        ours = CausalLM(args, dtype=torch.bfloat16)
    missing, unexpected = ours.load_state_dict(hf.state_dict(), strict=False)
    assert not missing and set(unexpected) <= {"lm_head.weight"}, (missing, unexpected)
    return hf, ours


def gpu_prompts(batch: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(GPU_PROMPT)] for _ in range(batch)]


def time_hf_cuda(hf, batch: int, top_k: int) -> dict:
    ids = torch.tensor(gpu_prompts(batch, hf.config.vocab_size), device="cuda")
    kwargs = dict(do_sample=True, temperature=1.0, top_k=top_k, top_p=1.0, max_new_tokens=GPU_NEW,
                  min_new_tokens=GPU_NEW, pad_token_id=0)
    with torch.inference_mode():
        hf.generate(ids[:, :8], attention_mask=torch.ones_like(ids[:, :8]), **{**kwargs, "max_new_tokens": 4,
                                                                                 "min_new_tokens": 4})
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    assert out.shape == (batch, GPU_PROMPT + GPU_NEW), out.shape
    return {"seconds": seconds, "tokens_per_s": batch * GPU_NEW / seconds}


def time_engine_cuda(engine, prompts: list[list[int]], seeds: list[int]) -> dict:
    from reprorl.rollout.request import SamplingParams

    params = SamplingParams(temperature=1.0, max_tokens=GPU_NEW, ignore_eos=True)

    async def run(new_tokens):
        p = SamplingParams(temperature=1.0, max_tokens=new_tokens, ignore_eos=True)
        return await asyncio.gather(*[engine.generate(f"r{i}", x, p, seed=s)
                                      for i, (x, s) in enumerate(zip(prompts, seeds))])

    asyncio.run(run(8))  # warm-up: compiles kernels, captures the graphs of this batch's buckets
    before = engine.stats()
    start = time.perf_counter()
    outs = asyncio.run(run(params.max_tokens))
    seconds = time.perf_counter() - start
    after = engine.stats()
    assert all(len(o.token_ids) == GPU_NEW for o in outs)
    busy = after["gpu_busy_s"] - before["gpu_busy_s"]
    return {"seconds": seconds, "tokens_per_s": len(prompts) * GPU_NEW / seconds, "gpu_busy": busy / seconds,
            "gpu_busy_of_step_time": busy / max(after["step_wall_s"] - before["step_wall_s"], 1e-9),
            "steps": after["steps"] - before["steps"], "graph_steps": after["graph_steps"] - before["graph_steps"],
            "prefix_shared": after["prefix_shared"] - before["prefix_shared"], "graph_error": after["graph_error"],
            "lookahead_steps": after["lookahead_steps"] - before["lookahead_steps"]}


def profile_engine_cuda(engine, prompts: list[list[int]], seeds: list[int], skip: int = 4, steps: int = 8) -> dict:
    """torch.profiler over `steps` decode steps of the engine (after the prefill step and
    `skip` decodes): the top kernels by CUDA time, their groups, and the share of the window
    the GPU runs a kernel (the union of kernel intervals over the window's wall time: the
    host's time between steps is in the window)."""
    from torch.profiler import ProfilerActivity, profile

    from reprorl.rollout.request import SamplingParams

    async def run(new_tokens):
        p = SamplingParams(temperature=1.0, max_tokens=new_tokens, ignore_eos=True)
        return await asyncio.gather(*[engine.generate(f"p{i}", x, p, seed=s)
                                      for i, (x, s) in enumerate(zip(prompts, seeds))])

    cuda = torch.cuda.is_available()  # (on the CPU only for a smoke test: no kernels to list)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    asyncio.run(run(8))  # warm-up, graph capture
    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
    state = {"n": 0}
    apply = engine._apply  # once a step on every path (lookahead steps skip _timed_step)

    def hooked(chunks, tokens, log_probs):  # step 0 is the prefill; the window: after step skip .. step skip+steps
        n = state["n"]
        state["n"] += 1
        apply(chunks, tokens, log_probs)
        if n == skip:  # no sync: a step launched ahead keeps running into the window
            prof.start()
            state["t0"] = time.perf_counter()
        if n == skip + steps:
            sync()
            state["wall"] = time.perf_counter() - state["t0"]
            prof.stop()

    engine._apply = hooked
    try:
        asyncio.run(run(skip + steps + 2))
    finally:
        del engine._apply  # back to the method
    summary = kernel_summary(prof, state["wall"], per=steps)
    return {"decode_steps": steps, "batch": len(prompts), **summary}


def main_profile(args) -> None:
    """`--profile`: the decode step of the first --gpu-models model at batch 256: engine,
    engine-det, and engine without lookahead (each step read before the next is launched)."""
    import transformers

    from reprorl.determinism import use_deterministic_algorithms
    from reprorl.rollout.engine import Engine

    transformers.logging.set_verbosity_error()
    name, batch = args.gpu_models[0], max(GPU_BATCHES)
    _, ours = gpu_models(name)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": name, "profiles": {}}
    for label, det, ahead in (("engine", False, True), ("engine-det", True, True), ("engine-sync", False, False)):
        use_deterministic_algorithms(det)  # as a replica under full determinism runs
        engine = Engine(ours, batch_invariant=det, eos_token_id=None, max_num_seqs=batch,
                        max_num_batched_tokens=batch * GPU_PROMPT, max_model_len=GPU_PROMPT + GPU_NEW + 8,
                        gpu_memory_utilization=0.3, lookahead=ahead)
        r = profile_engine_cuda(engine, gpu_prompts(batch, ours.args.vocab_size), list(range(batch)))
        out["profiles"][label] = r
        print_summary(f"{name} {label} batch {batch}, a decode step", r)
        engine.shutdown()
        engine = None
        gc.collect()
        torch.cuda.empty_cache()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    print(f"\nwrote {args.out}")


def main_cuda(args) -> None:
    """The GPU table (see the module doc)."""
    import transformers

    from reprorl.determinism import use_deterministic_algorithms
    from reprorl.rollout.engine import Engine

    transformers.logging.set_verbosity_error()
    t0 = time.perf_counter()
    rows, skipped = [], []

    def save():
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "prompt_len": GPU_PROMPT,
                       "new_tokens": GPU_NEW, "rows": rows, "skipped": skipped,
                       "summary": gpu_summary(rows)}, f, indent=2)

    def record(model, backend, batch, fn):
        if time.perf_counter() - t0 > args.budget_s:
            skipped.append(f"{model} {backend} batch {batch}")
            print(f"{model:13} {backend:17} batch {batch:4}   skipped (past --budget-s)", flush=True)
            return
        try:
            r = fn()
        except Exception as e:  # one failing row must not lose the others
            skipped.append(f"{model} {backend} batch {batch}: {type(e).__name__}: {e}")
            print(f"{model:13} {backend:17} batch {batch:4}   FAILED {type(e).__name__}: {e}", flush=True)
            return
        rows.append({"model": model, "backend": backend, "batch": batch, **{k: round(v, 4) if isinstance(v, float)
                                                                             else v for k, v in r.items()}})
        extra = f"  gpu busy {r['gpu_busy']:.0%}, {r['graph_steps']}/{r['steps']} steps graphed" if "gpu_busy" in r else ""
        if r.get("lookahead_steps"):
            extra += f", {r['lookahead_steps']} launched ahead"
        if r.get("graph_error"):
            extra += f"  GRAPH ERROR {r['graph_error']}"
        print(f"{model:13} {backend:17} batch {batch:4} {r['tokens_per_s']:11.0f} tok/s  ({r['seconds']:.2f} s){extra}",
              flush=True)
        save()

    for name in args.gpu_models:
        hf, ours = gpu_models(name)
        vocab = ours.args.vocab_size
        for det in (False, True):
            label = "engine-det" if det else "engine"
            use_deterministic_algorithms(det)  # as a replica under full determinism runs
            engine = Engine(ours, batch_invariant=det, eos_token_id=None, max_num_seqs=max(GPU_BATCHES),
                            max_num_batched_tokens=max(GPU_BATCHES) * GPU_PROMPT, max_model_len=GPU_PROMPT + GPU_NEW + 8,
                            gpu_memory_utilization=0.3)
            for batch in GPU_BATCHES:
                prompts = gpu_prompts(batch, vocab)
                record(name, label, batch, lambda: time_engine_cuda(engine, prompts, list(range(batch))))
            if not det:  # n = 8 samples of 32 prompts: prefix sharing on, then off
                prompts = [p for p in gpu_prompts(32, vocab, seed=1) for _ in range(8)]
                record(name, "engine-n8", 256, lambda: time_engine_cuda(engine, prompts, list(range(256))))
                engine.scheduler.prefix_sharing = False
                record(name, "engine-n8-noshare", 256, lambda: time_engine_cuda(engine, prompts, list(range(256))))
                engine.scheduler.prefix_sharing, engine.lookahead = True, False  # each step read before the next
                prompts = gpu_prompts(max(GPU_BATCHES), vocab)
                record(name, "engine-sync", 256, lambda: time_engine_cuda(engine, prompts, list(range(256))))
            engine.shutdown()
            engine = None  # frees its KV cache and graphs before the next one (its step task holds a cycle)
            gc.collect()
            torch.cuda.empty_cache()
        torch.use_deterministic_algorithms(False)  # transformers' generate as its users run it
        for top_k, label in ((0, "hf"), (50, "hf-topk50")):
            for batch in GPU_BATCHES[::-1]:  # 256 first: the headline comparison
                record(name, label, batch, lambda: time_hf_cuda(hf, batch, top_k))
        hf = ours = None
        gc.collect()
        torch.cuda.empty_cache()
    save()
    print(f"\n{'model':13} {'batch':>5} {'engine':>9} {'det':>9} {'det/eng':>8} {'eng/hf':>7} {'eng/hf-k50':>10} "
          f"{'n8 share':>9} {'n8 no':>9}")
    for s in gpu_summary(rows):
        print(f"{s['model']:13} {s['batch']:5} " + " ".join(
            f"{s.get(k, float('nan')):{w}.{p}f}" for k, w, p in (
                ("engine", 9, 0), ("engine-det", 9, 0), ("det_vs_engine", 8, 2), ("engine_vs_hf", 7, 1),
                ("engine_vs_hf_topk50", 10, 1), ("engine-n8", 9, 0), ("engine-n8-noshare", 9, 0))))
    print(f"\nwrote {args.out} ({time.perf_counter() - t0:.0f} s)")


def gpu_summary(rows: list[dict]) -> list[dict]:
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        for batch in GPU_BATCHES:
            tps = {r["backend"]: r["tokens_per_s"] for r in rows if r["model"] == model and r["batch"] == batch}
            s = {"model": model, "batch": batch, **{k: round(v) for k, v in tps.items()}}
            if "engine" in tps:
                for key, other in (("det_vs_engine", "engine-det"), ("engine_vs_hf", "hf"),
                                   ("engine_vs_hf_topk50", "hf-topk50")):
                    if other in tps:
                        s[key] = round(tps[other] / tps["engine"] if key == "det_vs_engine" else
                                       tps["engine"] / tps[other], 2)
            out.append(s)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cpu: the CPU table; cuda: the GPU one")
    parser.add_argument("--gpu-models", nargs="*", default=["qwen2.5-0.5b", "qwen2.5-1.5b"],
                        help="--device cuda: which of " + " ".join(GPU_MODELS))
    parser.add_argument("--budget-s", type=float, default=330, help="--device cuda: skip rows started past this")
    parser.add_argument("--profile", action="store_true",
                        help="--device cuda: profile decode steps (torch.profiler) instead of the table")
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
    if args.device == "cuda":
        # Before CUDA starts: the determinism rows turn on torch's deterministic algorithms,
        # which need cuBLAS's fixed workspace (as `enable_full_determinism` in a replica).
        from reprorl.determinism import CUBLAS_WORKSPACE_CONFIG

        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG)
        main_profile(args) if args.profile else main_cuda(args)
        return
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
