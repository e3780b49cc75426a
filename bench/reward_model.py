"""Reward-model scoring throughput: batched and batch-invariant vs one sequence at a time.

verl's determinism mode serialises its reward model (`max_num_seqs=1`), so a score
cannot depend on its batch. reprorl batches instead, under the op layer's batch-invariant
mode, which gives the same guarantee. This script measures both on the same model and
inputs in one run, for the tiny reward model (`make_tiny --kind reward`) and a wider one
(random weights, made in a temp dir), on short pairs (the arithmetic task's size, ~45
tokens with the template) and long ones (~280 tokens), and checks the batched scores are
bitwise equal to the one-at-a-time ones.

    python bench/reward_model.py            # the real figures (several minutes)
    python bench/reward_model.py --quick    # a smoke run (about a minute): 16 sequences, one repeat

Rows: `verl (1 at a time)` is max_num_seqs=1 on the plain kernels; `1 at a time,
batch-inv.` is the same under batch invariance; `batched, batch-inv.` is reprorl's
determinism mode (`--batch` sequences and at most 2048 tokens per forward, the scorer's
default); `batched, plain` is the fastest non-deterministic path (the cost of
batch invariance is its ratio to the row above). Prints a table and writes
`bench/results/reward_model.json`. Target: batched batch-invariant >= 5x verl's mode.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import tempfile
import time
from pathlib import Path

import torch

from reprorl.models.tiny import make_tiny
from reprorl.models.tokenizer import make_char_tokenizer
from reprorl.reward.reward_model import RewardModelScorer

RESULTS = Path(__file__).parent / "results" / "reward_model.json"


def make_wide_reward_model(out_dir: Path, hidden: int, layers: int, seed: int) -> Path:
    """A Qwen2 sequence classifier of width `hidden`, random weights, the char tokenizer."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    torch.manual_seed(seed)
    heads = hidden // 64
    config = Qwen2Config(
        vocab_size=128, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), max_position_embeddings=2048,
        num_labels=1, pad_token_id=0, tie_word_embeddings=False, torch_dtype="float32",
    )
    Qwen2ForSequenceClassification(config).save_pretrained(out_dir)
    make_char_tokenizer().save_pretrained(out_dir)
    return out_dir


def make_pairs(num: int, seed: int, min_len: int, max_len: int) -> tuple[list[list[dict]], list[str]]:
    """`num` (prompt messages, response) pairs of random printable text, lengths in [min_len, max_len]."""
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789 +-*/=?."

    def text(lo: int, hi: int) -> str:
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(lo, hi)))

    prompts = [[{"role": "user", "content": text(min_len // 2, max_len // 2)}] for _ in range(num)]
    responses = [text(min_len // 2, max_len // 2) for _ in range(num)]
    return prompts, responses


def time_scoring(scorer: RewardModelScorer, ids: list[list[int]], repeats: int) -> tuple[float, torch.Tensor]:
    """(best wall seconds over `repeats` after one warm-up, the scores)."""
    scores = scorer.score_ids(ids[: scorer.max_num_seqs])  # warm-up (allocator, kernels)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        scores = scorer.score_ids(ids)
        best = min(best, time.perf_counter() - t0)
    return best, scores


def bench_model(name: str, path: Path, lengths: str, prompts, responses, *, batch: int, repeats: int) -> list[dict]:
    modes = [  # (label, max_num_seqs, batch_invariant)
        ("verl (1 at a time)", 1, False),
        ("1 at a time, batch-inv.", 1, True),
        ("batched, batch-inv.", batch, True),
        ("batched, plain", batch, False),
    ]
    rows, scores = [], {}
    scorers = {label: RewardModelScorer(str(path), max_num_seqs=max_num_seqs, batch_invariant=invariant)
               for label, max_num_seqs, invariant in modes}
    ids = [scorers[modes[0][0]].input_ids(p, r) for p, r in zip(prompts, responses)]
    # The modes alternate, one measurement each per round, so load from other work on the
    # machine hits them alike; each keeps its best.
    best = {label: float("inf") for label, _, _ in modes}
    for _ in range(repeats):
        for label, _, _ in modes:
            seconds, scores[label] = time_scoring(scorers[label], ids, 1)
            best[label] = min(best[label], seconds)
    for label, max_num_seqs, invariant in modes:
        scorer, seconds = scorers[label], best[label]
        rows.append({
            "model": name, "hidden_size": scorer.args.hidden_size, "lengths": lengths, "mode": label,
            "max_num_seqs": max_num_seqs, "max_num_batched_tokens": scorer.max_num_batched_tokens,
            "batch_invariant": invariant, "num_seqs": len(ids),
            "tokens": sum(map(len, ids)), "seconds": seconds, "seqs_per_s": len(ids) / seconds,
        })
    base = rows[0]["seqs_per_s"]
    for row in rows:
        row["speedup_vs_verl"] = row["seqs_per_s"] / base
    # The determinism claim, checked on the benchmark's own inputs.
    rows[2]["bitwise_equal_to_1_at_a_time"] = torch.equal(scores["batched, batch-inv."],
                                                          scores["1 at a time, batch-inv."])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: 16 sequences, one repeat")
    parser.add_argument("--num-seqs", type=int, default=128, help="sequences scored per measurement")
    parser.add_argument("--batch", type=int, default=64, help="max_num_seqs of the batched modes")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per mode (the best is kept)")
    parser.add_argument("--wide-hidden", type=int, default=512, help="hidden size of the wide model (>= 512)")
    parser.add_argument("--wide-layers", type=int, default=4, help="layers of the wide model")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--models", nargs="*", default=["tiny", "wide"], help="which of: tiny wide")
    parser.add_argument("--lengths", nargs="*", default=["short", "long"], help="which of: short long")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where to write the JSON results")
    args = parser.parse_args()
    if args.quick:
        args.num_seqs, args.batch, args.repeats = 16, 16, 1
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    # Prompt + response characters (the char tokenizer: one token each, plus ~30 of template).
    # "short" is the arithmetic task's size; "long" a few sentences each side.
    regimes = {"short": (8, 40), "long": (100, 400)}
    pairs = {name: make_pairs(args.num_seqs, seed=0, min_len=lo, max_len=hi)
             for name, (lo, hi) in regimes.items() if name in args.lengths}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        models = {}
        if "tiny" in args.models:
            models["tiny"] = make_tiny(Path(tmp) / "tiny", kind="reward", seed=0)
        if "wide" in args.models:
            models[f"wide-{args.wide_hidden}"] = make_wide_reward_model(Path(tmp) / "wide", args.wide_hidden,
                                                                       args.wide_layers, seed=0)
        for name, path in models.items():
            for lengths, (prompts, responses) in pairs.items():
                rows += bench_model(name, Path(path), lengths, prompts, responses, batch=args.batch,
                                    repeats=args.repeats)

    header = (f"{'model':<10} {'lengths':<7} {'mode':<24} {'seqs':>5} {'tokens':>7} {'seqs/s':>9} "
              f"{'vs verl':>8}  bitwise")
    print(header)
    print("-" * len(header))
    for r in rows:
        bitwise = {True: "yes", False: "NO"}.get(r.get("bitwise_equal_to_1_at_a_time"), "")
        print(f"{r['model']:<10} {r['lengths']:<7} {r['mode']:<24} {r['num_seqs']:>5} {r['tokens']:>7} "
              f"{r['seqs_per_s']:>9.1f} {r['speedup_vs_verl']:>7.2f}x  {bitwise}")
    result = {
        "quick": args.quick, "torch": torch.__version__, "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(), "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
