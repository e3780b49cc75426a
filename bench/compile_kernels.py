"""How long the row kernels take to compile for a Hopper GPU, on a machine without one.

A user's first step pays every kernel's compile (Triton caches them on disk after). The row
kernels (softmax, entropy, the log-softmax's backward, the tokens' log-probs and their
backward, the sampler) walk a vocabulary row in 4096-wide blocks and combine the lanes with
a fixed tree (`softmax._tree_sum`); written with `tl.split`, that tree took triton 3.6 two
to six minutes to compile per kernel. This compiles each kernel at a vocabulary's launch
constants (`softmax.row_launch`, as the launches use them) for sm_90 with the installed
Triton, through its compiler alone (no driver, no GPU), and prints and saves the seconds and
the size of the PTX (its float adds: the tree's 4,095 additions shared over the threads
should be a few hundred a thread at most).

    python bench/compile_kernels.py [--vocab 151936] [--out bench/results/compile_kernels.json]

Run it with another Triton on the path (PYTHONPATH=/some/triton-3.6) to check a version the
GPU machine uses. Each kernel compiles in a fresh cache directory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def kernels(vocab: int) -> dict:
    """name: (jitted kernel, types of its runtime arguments, its constexprs, num_warps)."""
    import triton

    from reprorl.kernels.gpu import log_probs, sampling, softmax

    launch = softmax.row_launch(vocab)
    rows = {k: launch[k] for k in ("BLOCK", "LOG2_BLOCK")}
    warps = launch["num_warps"]
    return {
        "log_softmax": (softmax._softmax_kernel, dict(x_ptr="*fp32", out_ptr="*fp32", stride_x="i32",
                                                      stride_out="i32", V="i32"), dict(LOG=True, **rows), warps),
        "entropy": (softmax._entropy_kernel, dict(y_ptr="*fp32", out_ptr="*fp32", stride_y="i32", V="i32"),
                    dict(rows), warps),
        "log_softmax_backward": (softmax._log_softmax_backward_kernel,
                                 dict(y_ptr="*fp32", g_ptr="*fp32", dx_ptr="*fp32", stride_y="i32", stride_g="i32",
                                      stride_dx="i32", V="i32"), dict(rows), warps),
        "token_log_probs": (log_probs._token_log_probs_kernel,
                            dict(x_ptr="*bf16", tokens_ptr="*i64", out_ptr="*fp32", log_z_ptr="*fp32",
                                 entropy_ptr="*fp32", stride="i32", V="i32", temperature="fp32"),
                            dict(WITH_ENTROPY=True, **rows), warps),
        "token_log_probs_backward": (log_probs._token_log_probs_backward_kernel,
                                     dict(x_ptr="*bf16", tokens_ptr="*i64", log_z_ptr="*fp32", entropy_ptr="*fp32",
                                          g_lp_ptr="*fp32", g_h_ptr="*fp32", dx_ptr="*bf16", stride="i32",
                                          stride_dx="i32", V="i32", temperature="fp32"),
                                     dict(HAS_LP=True, HAS_H=True, BLOCK=rows["BLOCK"]), warps),
        "sample": (sampling._sample_kernel,
                   dict(logits_ptr="*bf16", params_ptr="*fp64", tokens_ptr="*i64", log_probs_ptr="*fp32",
                        log_z_ptr="*fp32", stride="i32", B="i32", V="i32"),
                   dict(NUM_BLOCKS=triton.next_power_of_2(triton.cdiv(vocab, rows["BLOCK"])), **rows), warps),
    }


def compile_one(kernel, types: dict, constants: dict, num_warps: int) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    missing = [a for a in names if a not in types and a not in constants]
    if missing:
        raise SystemExit(f"{kernel.__name__}: no type or constant for {missing} (the kernel's arguments changed)")
    signature = {a: types.get(a, "constexpr") for a in names}
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(names.index(c),): v for c, v in constants.items()})
    start = time.perf_counter()
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "enable_fp_fusion": True})
    ptx = compiled.asm["ptx"]
    return {"seconds": round(time.perf_counter() - start, 2), "ptx_lines": ptx.count("\n"),
            "ptx_f32_adds": ptx.count("add.f32") + ptx.count("add.rn.f32")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=151936, help="the row width (Qwen2.5's vocabulary)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "compile_kernels.json"))
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("compile_kernels.py compiles for a GPU: unset TRITON_INTERPRET")
    import triton

    result = {"triton": triton.__version__, "target": "cuda sm_90", "vocab": args.vocab, "kernels": {}}
    print(f"compiling the row kernels for sm_90 with triton {triton.__version__}, rows of {args.vocab}")
    for name, (kernel, types, constants, warps) in kernels(args.vocab).items():
        with tempfile.TemporaryDirectory() as cache:
            os.environ["TRITON_CACHE_DIR"] = cache  # a fresh cache: the compile, not a lookup
            row = result["kernels"][name] = compile_one(kernel, types, constants, warps)
        print(f"  {name:26s} {row['seconds']:7.2f} s  {row['ptx_lines']:6d} PTX lines, {row['ptx_f32_adds']} f32 adds")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")  # rewritten after each kernel
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
