"""The synthetic arithmetic task, `reprorl/arithmetic`: "12+7=" -> "19".

It is what the default training run teaches a tiny character-level model on a CPU in a
few minutes, so prompts and answers are a few characters: the user message is the
problem (`"12+7="`), the answer the integer (`"19"`), scored 0/1 by
`rewards.arithmetic_score` (the response must be the integer, then stop).

Problems: `a+b` and `a-b` with operands in [0, max_operand]; subtraction only with
a >= b, so answers are never negative and stay short. Train and validation are disjoint:
the set of distinct problems is split once, by the seed, into a validation pool
(`val_fraction` of it) and a train pool, and each split draws only from its own pool.
A split's rows go through its pool in a seeded order, then through a fresh order, and so
on, so each problem appears once before any appears twice.

For a supervised warm start, a row's `reward_model.ground_truth` is exactly the target
response: train on (row["prompt"], ground_truth + eos), the only form the reward accepts.
"""

from __future__ import annotations

import json
from pathlib import Path

from reprorl.data.dataset import stable_permutation
from reprorl.errors import ConfigError

DATA_SOURCE = "reprorl/arithmetic"
SPLITS = ("train", "val")
OPS = ("+", "-")
FORMATS = ("parquet", "jsonl")
_KEY = 2718  # leads every permutation key here, keeping them apart from the sampler's (seed, epoch)


def arithmetic_problems(max_operand: int = 20, ops: tuple[str, ...] = OPS) -> list[tuple[int, str, int]]:
    """All distinct problems (a, op, b), in a fixed order.

    >>> arithmetic_problems(1)
    [(0, '+', 0), (0, '+', 1), (1, '+', 0), (1, '+', 1), (0, '-', 0), (1, '-', 0), (1, '-', 1)]
    """
    if not isinstance(max_operand, int) or max_operand < 1:
        raise ConfigError(f"max_operand={max_operand!r}: expected an integer >= 1")
    if not ops or any(op not in OPS for op in ops) or len(set(ops)) != len(ops):
        raise ConfigError(f"ops={ops!r}: expected distinct operations from {OPS}")
    problems = []
    for op in ops:
        for a in range(max_operand + 1):
            for b in range(max_operand + 1):
                if op == "+" or a >= b:
                    problems.append((a, op, b))
    return problems


def make_arithmetic_rows(
    num_rows: int,
    seed: int,
    split: str,
    max_operand: int = 20,
    ops: tuple[str, ...] = OPS,
    val_fraction: float = 0.2,
) -> list[dict]:
    """`num_rows` rows of the task in verl's schema, a pure function of the arguments.

    Args:
        num_rows: rows to make.
        seed: picks the train/validation split of the problems and the order of rows.
        split: "train" or "val"; for the same (seed, max_operand, ops, val_fraction) the
            two never share a problem.
        max_operand: operands are 0..max_operand (difficulty).
        ops: operations, from "+" and "-".
        val_fraction: the share of distinct problems kept for validation.
    """
    if split not in SPLITS:
        raise ConfigError(f"split={split!r}: expected one of {SPLITS}")
    if not isinstance(num_rows, int) or num_rows < 0:
        raise ConfigError(f"num_rows={num_rows!r}: expected a non-negative integer")
    if not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"seed={seed!r}: expected a non-negative integer")
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"val_fraction={val_fraction!r}: expected a number between 0 and 1")
    problems = arithmetic_problems(max_operand, ops)
    if len(problems) < 2:
        raise ConfigError(f"max_operand={max_operand}, ops={ops}: too few problems to split")

    order = stable_permutation(len(problems), _KEY, seed, 0)
    num_val = min(max(1, round(val_fraction * len(problems))), len(problems) - 1)
    pool = order[:num_val] if split == "val" else order[num_val:]  # positions in `problems`

    rows = []
    cycle = 0
    while len(rows) < num_rows:
        for k in stable_permutation(len(pool), _KEY, seed, 1 + SPLITS.index(split), cycle):
            if len(rows) == num_rows:
                break
            a, op, b = problems[pool[k]]
            answer = a + b if op == "+" else a - b
            rows.append(
                {
                    "data_source": DATA_SOURCE,
                    "prompt": [{"role": "user", "content": f"{a}{op}{b}="}],
                    "ability": "arithmetic",
                    "reward_model": {"style": "rule", "ground_truth": str(answer)},
                    "extra_info": {"split": split, "index": len(rows)},
                }
            )
        cycle += 1
    return rows


def write_rows(rows: list[dict], path: str | Path) -> Path:
    """Write rows of the task's schema to `.parquet` or `.jsonl`; same rows, same bytes."""
    path = Path(path)
    if path.suffix == ".jsonl":
        with open(path, "w", encoding="utf-8", newline="\n") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=True) + "\n")
        return path
    if path.suffix != ".parquet":
        raise ConfigError(f"{path}: expected a .parquet or .jsonl file name")
    import pyarrow as pa
    import pyarrow.parquet as pq

    # An explicit schema: inferring it would fail on zero rows and could vary with content.
    schema = pa.schema(
        [
            ("data_source", pa.string()),
            ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
            ("ability", pa.string()),
            ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
            ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64())])),
        ]
    )
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


def write_arithmetic_dataset(
    out_dir: str | Path,
    num_train: int,
    num_val: int,
    seed: int,
    fmt: str = "parquet",
    max_operand: int = 20,
    ops: tuple[str, ...] = OPS,
    val_fraction: float = 0.2,
) -> dict[str, Path]:
    """Write `train.<fmt>` and `val.<fmt>` into `out_dir` (created); returns {split: path}."""
    if fmt not in FORMATS:
        raise ConfigError(f"format={fmt!r}: expected one of {FORMATS}")
    for name, n in (("num_train", num_train), ("num_val", num_val)):
        if not isinstance(n, int) or n < 0:
            raise ConfigError(f"{name}={n!r}: expected a non-negative integer")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, num_rows in (("train", num_train), ("val", num_val)):
        rows = make_arithmetic_rows(num_rows, seed, split, max_operand, ops, val_fraction)
        paths[split] = write_rows(rows, out_dir / f"{split}.{fmt}")
    return paths
