"""The project's code task, `reprorl/code`: small programming problems with tests, made from a seed.

Each problem is a template (read integers and print their sum times k, count a letter,
write a function `f(a, b)`, ...) with its parameters; its tests are inputs drawn from the
seed and the outputs of the template's reference solution. The ground truth is verl's test
JSON (`reprorl.data.code`): stdin tests `{"inputs": [...], "outputs": [...]}` or call
tests with an `fn_name`. Train and validation split the distinct problems once, by the
seed, as the arithmetic task does (`synthetic.py`). Prompts are short: the tiny models read
characters. A pure function of the arguments: the same seed writes the same bytes.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

from reprorl.data.dataset import stable_permutation
from reprorl.data.synthetic import write_rows
from reprorl.errors import ConfigError

DATA_SOURCE = "reprorl/code"
TESTS_PER_PROBLEM = 3
_KEY = 3141  # leads the split's permutation key, apart from the arithmetic task's and the sampler's


def _ints_line(rng: random.Random) -> str:
    return " ".join(str(rng.randint(-20, 20)) for _ in range(rng.randint(1, 6))) + "\n"


def _word(rng: random.Random) -> str:
    return "".join(rng.choice("abcdeiou") for _ in range(rng.randint(1, 10))) + "\n"


def _stdin_templates() -> list[tuple[str, Callable[[random.Random], str], Callable[[str], str]]]:
    """(prompt, input maker, reference: stdin -> stdout) of every stdin problem."""
    made = []
    for k in range(1, 20):
        made.append((f"Read integers on one line. Print their sum times {k}.", _ints_line,
                     lambda s, k=k: str(k * sum(map(int, s.split())))))
        made.append((f"Read integers on one line. Print the largest plus {k}.", _ints_line,
                     lambda s, k=k: str(max(map(int, s.split())) + k)))
        made.append((f"Read an integer n. Print n mod {k + 1}.", lambda r: f"{r.randint(0, 999)}\n",
                     lambda s, k=k: str(int(s) % (k + 1))))
        made.append((f"Read integers on one line. Print how many are above {k}.", _ints_line,
                     lambda s, k=k: str(sum(int(x) > k for x in s.split()))))
        made.append((f"Read an integer n. Print n squared plus {k}.", lambda r: f"{r.randint(-99, 99)}\n",
                     lambda s, k=k: str(int(s) ** 2 + k)))
    for c in "abcdeiou":
        made.append((f"Read a word. Print how many '{c}' it has.", _word, lambda s, c=c: str(s.strip().count(c))))
        made.append((f"Read a word. Print it with '{c}' removed.", _word, lambda s, c=c: s.strip().replace(c, "")))
    made.append(("Read a word. Print it reversed.", _word, lambda s: s.strip()[::-1]))
    made.append(("Read integers on one line. Print them sorted.", _ints_line,
                 lambda s: " ".join(map(str, sorted(map(int, s.split()))))))
    return made


def _call_templates() -> list[tuple[str, Callable[[int, int], int]]]:
    """(prompt, reference f(a, b)) of every function problem."""
    made = []
    for k in range(1, 20):
        for name, op in (("plus", lambda a, b: a + b), ("minus", lambda a, b: a - b), ("times", lambda a, b: a * b)):
            made.append((f"Write def f(a, b): return (a {name} b) times {k}.", lambda a, b, k=k, op=op: k * op(a, b)))
        made.append((f"Write def f(a, b): return the larger minus {k}.", lambda a, b, k=k: max(a, b) - k))
        made.append((f"Write def f(a, b): return a * {k} + b.", lambda a, b, k=k: a * k + b))
    return made


def code_problems() -> list[tuple[str, Callable[[random.Random], tuple[list, list, str | None]]]]:
    """Every problem: (prompt, tests maker: rng -> (inputs, outputs, fn_name)), in a fixed order."""
    problems = []
    for prompt, make_input, reference in _stdin_templates():
        def tests(rng, make_input=make_input, reference=reference):
            inputs = [make_input(rng) for _ in range(TESTS_PER_PROBLEM)]
            return inputs, [reference(x) + "\n" for x in inputs], None
        problems.append((prompt, tests))
    for prompt, reference in _call_templates():
        def tests(rng, reference=reference):
            inputs = [[rng.randint(-9, 9), rng.randint(-9, 9)] for _ in range(TESTS_PER_PROBLEM)]
            return inputs, [reference(*x) for x in inputs], "f"
        problems.append((prompt, tests))
    return problems


def make_code_rows(seed: int, split: str, val_fraction: float = 0.15) -> list[dict]:
    """The split's rows in verl's schema, one per problem of its pool, in a seeded order."""
    if split not in ("train", "val"):
        raise ConfigError(f"split={split!r}: expected 'train' or 'val'")
    problems = code_problems()
    order = stable_permutation(len(problems), _KEY, seed, 0)
    num_val = max(1, round(val_fraction * len(problems)))
    pool = order[:num_val] if split == "val" else order[num_val:]
    rows = []
    for k in pool:
        prompt, tests = problems[k]
        inputs, outputs, fn_name = tests(random.Random(seed * 100_003 + int(k)))  # the problem's own draws
        truth = {"inputs": inputs, "outputs": outputs, **({"fn_name": fn_name} if fn_name else {})}
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": prompt}],
            "ability": "code",
            "reward_model": {"style": "rule", "ground_truth": json.dumps(truth)},
            "extra_info": {"split": split, "index": len(rows)},
        })
    return rows


def write_code_dataset(out_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write `train.parquet` and `val.parquet` of the code task into `out_dir`; returns {split: path}."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return {split: write_rows(make_code_rows(seed, split), out_dir / f"{split}.parquet") for split in ("train", "val")}
