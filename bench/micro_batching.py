"""Micro-batches by sample count (padded) vs by token budget, on mixed-length responses.

    python3 bench/micro_batching.py --quick --out /tmp/micro_batching.json         # CPU, small model
    timeout 580 python3 bench/micro_batching.py --out bench/results/micro_batching.json   # one GPU

One rank of the trainer (`reprorl.workers.worker.ShardWorker`, in this process) computes
the actor's log-probs and one update (one optimizer step on the whole batch) of a random
policy on a synthetic batch whose lengths vary as RL rollouts' do: prompt lengths uniform
in [P/4, P], response lengths R * u^2 for u uniform (many short, a few long). Two ways:
`padded`, micro-batches of `--micro-batch` samples in sample order (each trimmed to its
own longest sample, as always), and `budget`, `max_token_len` = micro-batch x (P + R),
the most a padded micro-batch can hold, so both have the same memory bound
(reprorl/workers/micro_batches.py). Each runs once untimed (warm-up), then `--repeats`
times (each an update of its own), the fastest reported.

Reported per way and determinism mode: seconds of log-probs and of the update, the
micro-batch count, the tokens computed (rows x trimmed width, summed over micro-batches)
against the real ones, peak GPU memory; and whether the two ways' log-probs are bitwise
equal before the update (they must be with full determinism: batch-invariant kernels). Shapes: `--quick` a
width-128 model on the CPU (64 samples, 16 + 64 tokens); else Qwen2.5-0.5B's (bf16, 256
samples, 128 + 1024 tokens) on the GPU.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_step import (  # noqa: E402  (sets CUBLAS_WORKSPACE_CONFIG)
    QWEN_05B,
    SEED,
    enter_mode,
    make_model_dir,
    start_rank,
    sync,
    training_batch,
    write,
)

import torch  # noqa: E402

CPU_SHAPE = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 128, "max_position_embeddings": 512}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--quick", action="store_true", help="a small model on the CPU")
    p.add_argument("--samples", type=int, default=None, help="samples in the batch (256; quick: 64)")
    p.add_argument("--prompt-len", type=int, default=None, help="longest prompt (128; quick: 16)")
    p.add_argument("--response-len", type=int, default=None, help="longest response (1024; quick: 64)")
    p.add_argument("--micro-batch", type=int, default=None, help="samples per padded micro-batch (16; quick: 8)")
    p.add_argument("--modes", default=None, help="determinism modes: off,on (quick: on)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs after the warm-up; the fastest is reported")
    args = p.parse_args(argv)
    defaults = (64, 16, 64, 8, "on") if args.quick else (256, 128, 1024, 16, "off,on")
    for name, value in zip(("samples", "prompt_len", "response_len", "micro_batch", "modes"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.device = "cpu" if args.quick or not torch.cuda.is_available() else "cuda"
    return args


def mixed_batch(samples: int, prompt_len: int, response_len: int, vocab: int):
    """Left-padded prompts and right-padded responses of RL-like mixed lengths (module doc)."""
    g = torch.Generator().manual_seed(SEED)
    prompts = torch.zeros(samples, prompt_len, dtype=torch.long)
    responses = torch.zeros(samples, response_len, dtype=torch.long)
    prompt_mask, response_mask = torch.zeros_like(prompts), torch.zeros_like(responses)
    for b in range(samples):
        p = int(torch.randint(max(prompt_len // 4, 1), prompt_len + 1, (1,), generator=g))
        r = max(1, round(response_len * float(torch.rand(1, generator=g)) ** 2))
        prompts[b, prompt_len - p:] = torch.randint(3, vocab, (p,), generator=g)
        prompt_mask[b, prompt_len - p:] = 1
        responses[b, :r] = torch.randint(3, vocab, (r,), generator=g)
        response_mask[b, :r] = 1
    return training_batch(prompts, prompt_mask, responses, response_mask, g)


def computed_tokens(batch, micro_batch_size: int, max_token_len: int | None) -> tuple[int, int]:
    """(micro-batches, rows x trimmed width summed over them)."""
    from reprorl.workers.micro_batches import micro_batch_rows, row_spans, trimmed_width

    prompt, response = row_spans(batch)
    micros = micro_batch_rows(batch, micro_batch_size, max_token_len)
    return len(micros), sum(len(rows) * trimmed_width(max(prompt[i] for i in rows), max(response[i] for i in rows))
                            for rows in micros)


def run_mode(args: argparse.Namespace, model_dir: Path, batch, full_determinism: bool) -> dict:
    from reprorl.workers.micro_batches import in_sample_order
    from reprorl.workers.policy import PolicyLossArgs

    env = enter_mode(full_determinism)
    budget = args.micro_batch * (args.prompt_len + args.response_len)
    record: dict = {"max_token_len": budget}
    log_probs = {}
    for way, max_token_len in (("padded", None), ("budget", budget)):
        worker = start_rank(model_dir, env, dtype="bfloat16" if args.device == "cuda" else "float32",
                            batch_invariant=full_determinism, device=args.device, total_steps=1 + args.repeats)
        micro = {"micro_batch_size": args.micro_batch, "max_token_len": max_token_len}
        try:
            times = []
            for repeat in range(1 + args.repeats):  # a warm-up, then the timed ones
                timed = repeat > 0
                b = batch.slice(0, len(batch))
                if args.device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                sync(args.device)
                t0 = time.perf_counter()
                rows, out = worker.compute_log_probs(b, temperature=1.0, **micro)
                b["old_log_probs"] = in_sample_order(out, rows)
                if not timed:  # before any update: the two ways' weights are the same only then
                    log_probs[way] = b["old_log_probs"]
                sync(args.device)
                t1 = time.perf_counter()
                worker.update(b, ppo_epochs=1, mini_batch_size=len(b), max_response_length=args.response_len,
                              loss=PolicyLossArgs(), temperature=1.0, **micro)
                sync(args.device)
                if timed:
                    times.append((t1 - t0, time.perf_counter() - t1))
        finally:
            worker.shutdown()
        count, tokens = computed_tokens(batch, **micro)
        record[way] = {"log_probs_s": min(t for t, _ in times), "update_s": min(t for _, t in times),
                       "micro_batches": count,
                       "computed_tokens": tokens,
                       "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else None}
        print(f"  {'on ' if full_determinism else 'off'} {way}: " + ", ".join(
            f"{k} {v:.4g}" for k, v in record[way].items() if v is not None), flush=True)
        del worker
        if args.device == "cuda":
            torch.cuda.empty_cache()
    record["log_probs_bitwise_equal"] = torch.equal(log_probs["padded"], log_probs["budget"])
    record["update_speedup"] = record["padded"]["update_s"] / record["budget"]["update_s"]
    record["log_probs_speedup"] = record["padded"]["log_probs_s"] / record["budget"]["log_probs_s"]
    return record


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    shape = dict(CPU_SHAPE if args.quick else QWEN_05B)
    if not args.quick and args.device == "cpu":
        raise SystemExit("no GPU: run with --quick on the CPU")
    if args.quick:
        torch.set_num_threads(1)  # as a worker rank runs (WORKER_THREADS)
    batch = mixed_batch(args.samples, args.prompt_len, args.response_len, shape["vocab_size"])
    real = int(batch["attention_mask"].sum())
    result: dict = {"args": vars(args), "shape": shape, "torch": torch.__version__, "real_tokens": real,
                    "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None, "modes": {}}
    print(f"{args.samples} samples, prompts <= {args.prompt_len}, responses <= {args.response_len} "
          f"({real} real tokens), on {args.device}", flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = make_model_dir(Path(scratch), shape, "bfloat16" if args.device == "cuda" else "float32")
        for mode in args.modes.split(","):
            result["modes"][mode] = run_mode(args, model_dir, batch, full_determinism=mode == "on")
            write(args.out, result)
    for mode, rec in result["modes"].items():
        print(f"determinism {mode}: update {rec['padded']['update_s']:.3f} s padded -> "
              f"{rec['budget']['update_s']:.3f} s budgeted (x{rec['update_speedup']:.2f}), log-probs x{rec['log_probs_speedup']:.2f}; tokens computed "
              f"{rec['padded']['computed_tokens']} -> {rec['budget']['computed_tokens']} ({real} real); log-probs "
              f"bitwise equal: {rec['log_probs_bitwise_equal']}")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
