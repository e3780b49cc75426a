"""The synthetic arithmetic task and the `reprorl make-data` command."""

import re
from collections import Counter

import pytest

from reprorl.cli import main
from reprorl.data.dataset import PromptDataset, read_rows
from reprorl.data.synthetic import arithmetic_problems, make_arithmetic_rows, write_arithmetic_dataset
from reprorl.errors import ConfigError


def _problem(row):
    return row["prompt"][0]["content"]


def test_rows_by_hand():
    rows = make_arithmetic_rows(3, seed=0, split="train")
    assert rows[0] == {
        "data_source": "reprorl/arithmetic",
        "prompt": [{"role": "user", "content": "7+15="}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": "22"},
        "extra_info": {"split": "train", "index": 0},
    }
    assert [r["extra_info"]["index"] for r in rows] == [0, 1, 2]


@pytest.mark.parametrize("split", ["train", "val"])
def test_answers_are_right_and_within_range(split):
    for row in make_arithmetic_rows(300, seed=1, split=split, max_operand=9):
        a, op, b = re.fullmatch(r"(\d+)([+-])(\d+)=", _problem(row)).groups()
        a, b = int(a), int(b)
        assert 0 <= a <= 9 and 0 <= b <= 9
        answer = a + b if op == "+" else a - b
        assert answer >= 0
        assert row["reward_model"]["ground_truth"] == str(answer)
        assert row["extra_info"]["split"] == split


def test_problem_space_by_hand():
    assert len(arithmetic_problems(20)) == 21 * 21 + 21 * 22 // 2  # all sums, differences with a >= b
    differences = [(0, "-", 0), (1, "-", 0), (1, "-", 1), (2, "-", 0), (2, "-", 1), (2, "-", 2)]
    assert arithmetic_problems(2, ops=("-",)) == differences


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("max_operand, ops", [(20, ("+", "-")), (5, ("+",)), (3, ("-",))])
def test_splits_are_disjoint_and_cover_the_problems(seed, max_operand, ops):
    n = len(arithmetic_problems(max_operand, ops))
    train = {_problem(r) for r in make_arithmetic_rows(2 * n, seed, "train", max_operand, ops)}
    val = {_problem(r) for r in make_arithmetic_rows(2 * n, seed, "val", max_operand, ops)}
    assert not train & val
    assert len(train | val) == n
    assert len(val) == min(max(1, round(0.2 * n)), n - 1)


def test_each_problem_once_before_any_twice():
    n_val = round(0.2 * 672)
    rows = make_arithmetic_rows(n_val + 10, seed=4, split="val")
    counts = Counter(_problem(r) for r in rows)
    assert len(counts) == n_val
    assert sorted(counts.values()) == [1] * (n_val - 10) + [2] * 10


def test_rows_are_a_pure_function_of_the_arguments():
    assert make_arithmetic_rows(100, 3, "train") == make_arithmetic_rows(100, 3, "train")
    assert make_arithmetic_rows(100, 3, "train") != make_arithmetic_rows(100, 4, "train")
    # A prefix: asking for fewer rows gives the first ones.
    assert make_arithmetic_rows(40, 3, "train") == make_arithmetic_rows(100, 3, "train")[:40]


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_same_seed_same_bytes(tmp_path, fmt):
    a = write_arithmetic_dataset(tmp_path / "a", num_train=64, num_val=16, seed=9, fmt=fmt)
    b = write_arithmetic_dataset(tmp_path / "b", num_train=64, num_val=16, seed=9, fmt=fmt)
    c = write_arithmetic_dataset(tmp_path / "c", num_train=64, num_val=16, seed=10, fmt=fmt)
    assert set(a) == {"train", "val"}
    for split in ("train", "val"):
        assert a[split].name == f"{split}.{fmt}"
        assert a[split].read_bytes() == b[split].read_bytes()
        assert a[split].read_bytes() != c[split].read_bytes()


def test_both_formats_hold_the_same_rows(tmp_path):
    pq = write_arithmetic_dataset(tmp_path / "p", 50, 10, seed=2, fmt="parquet")
    js = write_arithmetic_dataset(tmp_path / "j", 50, 10, seed=2, fmt="jsonl")
    for split, n in (("train", 50), ("val", 10)):
        expected = make_arithmetic_rows(n, 2, split)
        assert read_rows(pq[split]) == expected
        assert read_rows(js[split]) == expected


def test_zero_rows_write_and_read(tmp_path):
    paths = write_arithmetic_dataset(tmp_path, 0, 0, seed=0)
    assert read_rows(paths["train"]) == []


def test_bad_arguments(tmp_path):
    with pytest.raises(ConfigError, match="split='test'"):
        make_arithmetic_rows(1, 0, "test")
    with pytest.raises(ConfigError, match="num_rows=-1"):
        make_arithmetic_rows(-1, 0, "train")
    with pytest.raises(ConfigError, match="seed=-2"):
        make_arithmetic_rows(1, -2, "train")
    with pytest.raises(ConfigError, match="max_operand=0"):
        make_arithmetic_rows(1, 0, "train", max_operand=0)
    with pytest.raises(ConfigError, match=r"ops=\('\*',\)"):
        make_arithmetic_rows(1, 0, "train", ops=("*",))
    with pytest.raises(ConfigError, match="val_fraction=1.0"):
        make_arithmetic_rows(1, 0, "train", val_fraction=1.0)
    with pytest.raises(ConfigError, match="format='csv'"):
        write_arithmetic_dataset(tmp_path, 1, 1, seed=0, fmt="csv")


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_make_data_command(tmp_path, char_tokenizer, capsys, fmt):
    out = tmp_path / "data"
    rc = main(["make-data", str(out), "--num-train", "64", "--num-val", "16", "--seed", "3", "--format", fmt])
    assert rc == 0
    printed = capsys.readouterr().out
    assert f"wrote train split to {out / f'train.{fmt}'}" in printed

    train = PromptDataset(out / f"train.{fmt}", char_tokenizer, max_prompt_length=32)
    val = PromptDataset(out / f"val.{fmt}", char_tokenizer, max_prompt_length=32)
    assert (len(train), len(val)) == (64, 16)
    assert train.stats["overlong"] == 0
    assert [r.messages for r in train.rows] == [r["prompt"] for r in make_arithmetic_rows(64, 3, "train")]
    assert not {r.messages[0]["content"] for r in train.rows} & {r.messages[0]["content"] for r in val.rows}
    assert all(r.data_source == "reprorl/arithmetic" and r.reward_style == "rule" for r in train.rows)


def test_make_data_command_bad_value_is_one_line(tmp_path, capsys):
    assert main(["make-data", str(tmp_path), "--num-train", "-5"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "error: num_train=-5: expected a non-negative integer"
