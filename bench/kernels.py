"""Batch-invariant kernels against the stock torch ops, and whole forwards, on one device.

CUDA (default when there is a GPU): random weights, bf16, M = 1, 64, 256, 4096 tokens.
Each invariant Triton kernel against the stock op (cuBLAS for linears, torch's fused
norms/softmaxes, SDPA for attention), then a whole padded forward (the trainer's path)
of Qwen2.5-0.5B- and 7B-shaped models with each backend. Times are medians of CUDA-graph
replays (`triton.testing.do_bench_cudagraph`: GPU time, no launch overhead); whole
forwards also eagerly (`do_bench`, launches included).

CPU (`--device cpu`), at the machine's thread count, float32: each linear of a width-512
model and of Qwen2.5-0.5B (its LM head left out) with our matmul against F.linear (MKL),
with GFLOPS, then the cost of determinism on a forward of the width-512 model and a
Qwen2.5-0.5B-shaped one of 2 layers, at 16, 64 and 256 rows.

`--sweep`: time candidate Triton tiles per linear shape (the table in
`reprorl/kernels/gpu/matmul.py` was chosen from it).

    python bench/kernels.py [--device cuda|cpu] [--sweep] [--out bench/results/kernels.json]

Prints a table and writes every figure as JSON.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from reprorl.kernels import TorchKernels, rope_tables, select_kernels
from reprorl.models.arch import ModelArgs
from reprorl.models.transformer import CausalLM

QWEN = {  # hidden, intermediate, layers, heads, kv heads, head_dim, vocab, tied
    "qwen2.5-0.5b": (896, 4864, 24, 14, 2, 64, 151936, True),
    "qwen2.5-7b": (3584, 18944, 28, 28, 4, 128, 152064, False),
}
WIDE = {"width-512": (512, 1408, 4, 8, 2, 64, 4096, True)}  # bench/rollout.py's CPU model
ROWS = (1, 64, 256, 4096)


def model_args(name: str, layers: int | None = None) -> ModelArgs:
    h, i, n, heads, kv, hd, vocab, tied = {**QWEN, **WIDE}[name]
    return ModelArgs(model_type="qwen2", vocab_size=vocab, hidden_size=h, intermediate_size=i,
                     num_hidden_layers=layers or n, num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd,
                     qkv_bias=True, tie_word_embeddings=tied, max_position_embeddings=8192)


def gpu_time_ms(fn, rep: int = 100) -> float:
    """Median GPU time of fn, replayed from a CUDA graph: launch overheads (Triton's host
    side costs more than cuBLAS's) stay out, as in the engine's graphed decode steps."""
    import triton

    fn()  # compile before capture
    torch.cuda.synchronize()
    return float(triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median"))


def gpu_eager_ms(fn) -> float:
    """Median time of fn launched eagerly (CUDA events): host launch costs included."""
    import triton

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def cpu_times_ms(fns, repeats: int = 5, min_s: float = 0.5) -> list[float]:
    """The median time of each of `fns`, timed in rounds that call each once in turn (stock,
    ours, stock, ours, ...), at least `repeats` rounds and about `min_s` seconds of each:
    a change of the machine's state (its clock, another process on the host) weighs on
    both sides alike. Timed back to back, 15 calls a side, the same two forwards of 16
    tokens on the Xeon gave 1.54x in one run and 0.97x in the next."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    start_all = time.perf_counter()
    while len(times[0]) < repeats or time.perf_counter() - start_all < min_s * len(fns):
        for t, fn in zip(times, fns):
            start = time.perf_counter()
            fn()
            t.append((time.perf_counter() - start) * 1e3)
    return [statistics.median(t) for t in times]


def gpu_times_ms(fns) -> list[float]:
    return [gpu_time_ms(fn) for fn in fns]


def linear_shapes(name: str) -> dict[str, tuple[int, int]]:
    h, i, _, heads, kv, hd, vocab, _ = QWEN[name]
    # The linears the model runs (q, k and v, and gate and up, are separate projections).
    return {"q": (h, heads * hd), "k/v": (h, kv * hd), "o": (heads * hd, h), "gate/up": (h, i), "down": (i, h),
            "lm_head": (h, vocab)}


def bench_ops_cuda(results: dict) -> None:
    inv = select_kernels("cuda", True)
    dt = torch.bfloat16
    rows = []
    for model, shapes in ((m, linear_shapes(m)) for m in QWEN):
        for name, (k, n) in shapes.items():
            w = torch.randn(n, k, device="cuda", dtype=dt) * 0.02
            for m in ROWS:
                x = torch.randn(m, k, device="cuda", dtype=dt)
                stock, ours = gpu_time_ms(lambda: F.linear(x, w)), gpu_time_ms(lambda: inv.linear(x, w))
                rows.append({"op": f"linear {model} {name} {k}->{n}", "M": m, "stock_ms": stock, "invariant_ms": ours,
                             "ratio": ours / stock})
    for width in (896, 3584):
        wn = torch.ones(width, device="cuda", dtype=dt)
        for m in ROWS:
            x = torch.randn(m, width, device="cuda", dtype=dt)
            rows.append(_pair(f"rms_norm {width}", m, lambda: TorchKernels.rms_norm(x, wn, 1e-6),
                              lambda: inv.rms_norm(x, wn, 1e-6)))
    for m in ROWS:
        logits = torch.randn(m, 151936, device="cuda")
        rows.append(_pair("log_softmax 151936", m, lambda: torch.log_softmax(logits, -1), lambda: inv.log_softmax(logits)))
        g, u = (torch.randn(m, 4864, device="cuda", dtype=dt) for _ in range(2))
        rows.append(_pair("swiglu 4864", m, lambda: F.silu(g) * u, lambda: inv.swiglu(g, u)))
        cos, sin = (t.cuda()[:m] for t in rope_tables(64, 1e6, max(ROWS)))
        qh = torch.randn(m, 14, 64, device="cuda", dtype=dt)
        rows.append(_pair("rotary 14x64", m, lambda: TorchKernels.apply_rotary(qh, cos, sin),
                          lambda: inv.apply_rotary(qh, cos, sin)))
    # attention: decode of B sequences over 384 cached keys; prefill of one 4096-token batch
    for label, b, tq, tk in (("decode B=64 L=384", 64, 1, 384), ("decode B=256 L=384", 256, 1, 384),
                             ("prefill 8x512", 8, 512, 512)):
        q = torch.randn(b, 14, tq, 64, device="cuda", dtype=dt)
        kk, vv = (torch.randn(b, 2, tk, 64, device="cuda", dtype=dt) for _ in range(2))
        start = torch.full((b,), tk - tq, device="cuda")
        allowed = torch.arange(tk, device="cuda") <= (start[:, None] + torch.arange(tq, device="cuda"))[:, None, :, None]
        rows.append(_pair(f"attention {label}", b * tq,
                          lambda: F.scaled_dot_product_attention(q, kk, vv, attn_mask=allowed, enable_gqa=True),
                          lambda: inv.batched_attention(q, kk, vv, start)))
    results["ops"] = rows


def cpu_linear_shapes() -> dict[str, tuple[int, int]]:
    """(K, N) of the linears the CPU benches time: the ones the width-512 model's forward runs
    (q, k and v, and gate and up, are separate projections), Qwen2.5-0.5B's but its LM head."""
    h, i, _, heads, kv, hd, vocab, _ = WIDE["width-512"]
    return {"width-512 q": (h, heads * hd), "width-512 k/v": (h, kv * hd), "width-512 o": (heads * hd, h),
            "width-512 gate/up": (h, i), "width-512 down": (i, h), "width-512 lm_head": (h, vocab),
            **{f"qwen2.5-0.5b {n}": ks for n, ks in linear_shapes("qwen2.5-0.5b").items() if n != "lm_head"}}


def bench_ops_cpu(results: dict, repeats: int = 5) -> None:
    inv = select_kernels("cpu", True)
    rows = []
    for name, (k, n) in cpu_linear_shapes().items():
        w = torch.randn(n, k) * 0.02
        for m in (16, 64, 256):
            x = torch.randn(m, k)
            stock, ours = cpu_times_ms([lambda: F.linear(x, w), lambda: inv.linear(x, w)], repeats)
            flops = 2 * m * k * n
            rows.append({"op": f"linear {name} {k}->{n}", "M": m, "stock_ms": stock, "invariant_ms": ours,
                         "ratio": ours / stock, "stock_gflops": flops / stock / 1e6, "invariant_gflops": flops / ours / 1e6})
            print(f"  linear {name} {k}->{n} M={m}: MKL {flops / stock / 1e6:.1f} GFLOPS, ours {flops / ours / 1e6:.1f}",
                  flush=True)
    results["ops"] = rows


def _pair(op: str, m: int, stock, ours) -> dict:
    s, o = gpu_time_ms(stock), gpu_time_ms(ours)
    return {"op": op, "M": m, "stock_ms": s, "invariant_ms": o, "ratio": o / s}


def profile_forward(forward, title: str, device: str, calls: int = 5) -> dict:
    """The forward under torch.profiler, per forward. CUDA: its kernels by group (eager: the
    GPU-busy share counts launch gaps that a CUDA graph does not have; the kernel times are
    the graph's). CPU: the ops by their own time, where a slow forward spends it."""
    from torch.profiler import ProfilerActivity, profile

    from profiling import host_summary, kernel_summary, print_summary

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch.no_grad(), profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(calls):
            forward()
        if device == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    if device == "cuda":
        summary = kernel_summary(prof, wall, per=calls, top=12)
        print_summary(title, summary, lines=12)
        return summary
    ops = host_summary(prof, per=calls, top=12)
    torch_ms = sum(e.self_cpu_time_total for e in prof.key_averages()) / calls / 1e3
    # The CPU extension's calls (matmuls, attention) are not torch ops: they are the rest.
    print(f"\n{title}: {wall / calls * 1e3:.3f} ms a forward under the profiler, torch's ops {torch_ms:.3f} ms "
          "(the rest: the CPU extension's calls and Python)")
    for h in ops:
        print(f"  {h['self_cpu_ms']:9.3f} ms  x{h['calls']:<6g} {h['op']}")
    return {"wall_ms": wall / calls * 1e3, "torch_ops_ms": torch_ms, "ops": ops}


def whole_forward(name: str, layers: int | None, device: str, dtype: torch.dtype, row_counts, timer,
                  profile_tokens=()) -> list[dict]:
    args = model_args(name, layers)
    with torch.device(device):
        model = CausalLM(args, dtype).eval()
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02, generator=g)
    out = []
    for tokens in row_counts:
        b = 1 if tokens <= 256 else tokens // 512
        ids = torch.randint(0, args.vocab_size, (b, tokens // b), device=device)
        kernels = {invariant: select_kernels(device, invariant) for invariant in (False, True)}

        def forward_with(invariant: bool):
            def forward():
                model.kernels = kernels[invariant]
                return model(ids)
            return forward

        with torch.no_grad():
            times = dict(zip((False, True), timer([forward_with(False), forward_with(True)])))
        eager, profiles = {}, {}
        for invariant in (False, True):
            model.kernels = kernels[invariant]
            with torch.no_grad():
                if device == "cuda":
                    eager[invariant] = gpu_eager_ms(lambda: model(ids))
                if tokens in profile_tokens:
                    profiles["invariant" if invariant else "stock"] = profile_forward(
                        lambda: model(ids), f"{name} forward, {tokens} tokens, {'invariant' if invariant else 'stock'}",
                        device)
        out.append({"model": name, "layers": args.num_hidden_layers, "tokens": tokens, "batch": b,
                    "stock_ms": times[False], "invariant_ms": times[True], "ratio": times[True] / times[False],
                    **({"eager_stock_ms": eager[False], "eager_invariant_ms": eager[True]} if eager else {}),
                    **({"profile": profiles} if profiles else {})})
        print(f"  forward {name} x{args.num_hidden_layers} layers, {tokens} tokens: stock {times[False]:.2f} ms, "
              f"invariant {times[True]:.2f} ms ({times[True] / times[False]:.2f}x)", flush=True)
    return out


def sweep_tiles(results: dict, row_counts=(64, 256, 4096)) -> None:
    """Time the candidate tiles (`matmul.CANDIDATE_TILES`) for each bf16 linear shape at each
    row count (over cuBLAS's time): the data behind `matmul.tile_for`, which takes the fastest
    per row bucket."""
    import triton

    from reprorl.kernels.gpu import matmul as tl_matmul

    candidates = tl_matmul.CANDIDATE_TILES
    rows = []
    original = tl_matmul.tile_for
    try:
        for model in QWEN:
            for name, (k, n) in linear_shapes(model).items():
                w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                xs = {m: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m in row_counts}
                stock = {m: gpu_time_ms(lambda: F.linear(x, w)) for m, x in xs.items()}
                for tile in candidates:
                    tl_matmul.tile_for = lambda n_, k_, d_, m_, tile=tile: tile
                    try:
                        ratios = [gpu_time_ms(lambda: tl_matmul.matmul(x, w), rep=25) / stock[m]
                                  for m, x in xs.items()]
                    except (triton.runtime.errors.OutOfResources, triton.compiler.errors.CompilationError):
                        continue
                    rows.append({"shape": f"{model} {name} {k}->{n}", "tile": tile.__dict__, "ratios": ratios,
                                 "score": statistics.geometric_mean(ratios)})
                shape_rows = [r for r in rows if r["shape"] == f"{model} {name} {k}->{n}"]
                per_m = []
                for i, m in enumerate(xs):  # the table's data: the fastest tile at each M
                    r = min(shape_rows, key=lambda r: r["ratios"][i])
                    per_m.append(f"M={m} {r['ratios'][i]:.2f}x {tuple(r['tile'].values())}")
                print(f"  sweep {model} {name} {k}->{n}: " + "; ".join(per_m), flush=True)
    finally:
        tl_matmul.tile_for = original
    results["sweep"] = rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--sweep", action="store_true", help="time candidate Triton tiles per linear shape")
    parser.add_argument("--sweep-rows", type=int, nargs="+", default=[64, 256, 4096], help="row counts the sweep times")
    parser.add_argument("--skip-ops", action="store_true", help="only the whole forwards")
    parser.add_argument("--profile-tokens", type=int, nargs="*", default=[],
                        help="profile the whole forwards at these token counts (CUDA: kernels by group; CPU: ops)")
    parser.add_argument("--repeats", type=int, default=5, help="CPU: rounds at least (stock and ours timed in turn, about 0.5 s each; the medians are kept)")
    parser.add_argument("--out", default=None, help="JSON file (default bench/results/kernels_<device>.json)")
    args = parser.parse_args()
    out = Path(args.out or Path(__file__).parent / "results" / f"kernels_{args.device}.json")
    results: dict = {"device": args.device, "torch": torch.__version__, "machine": platform.processor(),
                     "threads": torch.get_num_threads()}
    if args.device == "cuda":
        import triton

        results.update(gpu=torch.cuda.get_device_name(), triton=triton.__version__)
        torch.backends.cuda.matmul.allow_tf32 = False
        if args.sweep:
            sweep_tiles(results, args.sweep_rows)
        if not args.skip_ops:
            bench_ops_cuda(results)
        results["forward"] = [row for model in ("qwen2.5-0.5b", "qwen2.5-7b")
                              for row in whole_forward(model, None, "cuda", torch.bfloat16, (64, 256, 4096), gpu_times_ms,
                                                       args.profile_tokens)]
    else:
        from reprorl.kernels.check import device_name

        results["cpu"] = device_name(torch.device("cpu"))
        if not args.skip_ops:
            bench_ops_cpu(results, args.repeats)
        timer = functools.partial(cpu_times_ms, repeats=args.repeats)
        results["forward"] = [row for name, layers in (("width-512", None), ("qwen2.5-0.5b", 2))
                              for row in whole_forward(name, layers, "cpu", torch.float32, (16, 64, 256), timer,
                                                       args.profile_tokens)]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"\n{'op':48s} {'M':>6s} {'stock ms':>10s} {'invariant ms':>13s} {'ratio':>7s}")
    for row in results.get("ops", []):
        print(f"{row['op']:48s} {row['M']:6d} {row['stock_ms']:10.4f} {row['invariant_ms']:13.4f} {row['ratio']:7.2f}")
    for row in results["forward"]:
        print(f"{'forward ' + row['model'] + ' x' + str(row['layers']):48s} {row['tokens']:6d} {row['stock_ms']:10.3f} "
              f"{row['invariant_ms']:13.3f} {row['ratio']:7.2f}")
    print(f"saved {out}")


if __name__ == "__main__":
    main()
