"""Sandbox throughput: programs scored per second through the code reward, on this machine's cores.

Each program is a response to one of the project's code problems (`reprorl/code`, 3 tests
each), scored by `RewardLoop` with `reward.num_workers` processes side by side, as a run
scores them; half the responses are the problem's right answer (every test runs), half
wrong (the first test fails and ends the scoring). A program here is one response scored,
its tests each a sandboxed process. Prints one line per worker count and writes
bench/results/sandbox.json.

    python bench/sandbox.py                       # 1, 2 and 4 workers, 64 responses each
    python bench/sandbox.py --workers 2 --responses 32
"""

import argparse
import json
import os
import time
from pathlib import Path

import torch

from reprorl.data.code_tasks import make_code_rows
from reprorl.models.tokenizer import make_char_tokenizer
from reprorl.protocol import Batch
from reprorl.reward.loop import RewardLoop
from reprorl.reward.user_fn import resolve_reward_fn


def responses(n: int) -> tuple[list[str], list[str]]:
    """(responses, ground truths): right answers (a table of the tests) and wrong ones, alternating."""
    rows = [r for r in make_code_rows(0, "train") if "fn_name" not in r["reward_model"]["ground_truth"]]
    texts, truths = [], []
    for i in range(n):
        truth = rows[i % len(rows)]["reward_model"]["ground_truth"]
        tests = json.loads(truth)
        table = dict(zip(tests["inputs"], tests["outputs"]))
        right = f"import sys\nprint({table!r}[sys.stdin.read()], end='')"
        texts.append(right if i % 2 == 0 else "print('no')")
        truths.append(truth)
    return texts, truths


def batch(tok, texts: list[str], truths: list[str]) -> Batch:
    rows = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    ids = torch.full((len(rows), max(map(len, rows))), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
    return Batch({"responses": ids, "response_mask": mask},
                 {"data_source": ["reprorl/code"] * len(rows), "ground_truth": truths})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--responses", type=int, default=64)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "sandbox.json"))
    args = parser.parse_args()
    tok = make_char_tokenizer()
    texts, truths = responses(args.responses)
    results = []
    for workers in args.workers:
        loop = RewardLoop(resolve_reward_fn(None), timeout_s=120.0, num_workers=workers)
        try:
            loop.compute(batch(tok, texts[:workers], truths[:workers]), tok)  # start the processes
            t0 = time.perf_counter()
            scores = loop.compute(batch(tok, texts, truths), tok).scores
            wall = time.perf_counter() - t0
        finally:
            loop.close()
        assert scores.tolist() == [1.0 if i % 2 == 0 else 0.0 for i in range(len(texts))]
        row = {"workers": workers, "responses": len(texts), "wall_s": round(wall, 3),
               "programs_per_s": round(len(texts) / wall, 2), "processes_per_s": round(2 * len(texts) / wall, 2),
               "cores": os.cpu_count()}
        print(json.dumps(row))
        results.append(row)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
