"""The code reward (its parsing and scoring) and the project's code task."""

import json

import pytest

from reprorl.data.code import code_partial_score, code_score, extract_code, parse_tests
from reprorl.data.code_tasks import code_problems, make_code_rows
from reprorl.data.dataset import PromptDataset
from reprorl.data.rewards import REWARD_FNS, check_ground_truth, score_and_answer
from reprorl.data.synthetic import write_rows
from reprorl.errors import DataError

SUM = json.dumps({"inputs": ["1 2\n", "5 5\n"], "outputs": ["3\n", "10\n"]})


def test_the_last_fenced_block_is_the_program():
    text = "First:\n```python\nprint(0)\n```\nBetter:\n```\nprint(sum(map(int, input().split())))\n```\n"
    assert extract_code(text) == "print(sum(map(int, input().split())))\n"
    assert code_score("codecontests", text, SUM) == 1.0


def test_partial_credit_counts_the_tests_passed():
    half = "a, b = map(int, input().split())\nprint(a + b if a == 1 else 0)"
    assert code_score("taco", half, SUM) == 0.0
    assert code_partial_score("taco", half, SUM) == 0.5


def test_verl_code_sources_are_scored_and_give_no_answer():
    for source in ("codecontests", "apps", "taco", "codeforces", "reprorl/code"):
        assert REWARD_FNS[source] is code_score
    assert score_and_answer("apps", "print(3)\nprint(10)", SUM) == {"score": 0.0, "pred": None}


@pytest.mark.parametrize("truth, message", [
    ("not json", "code tests are not valid JSON"),
    ('{"inputs": ["1"], "outputs": []}', "1 inputs and 0 outputs"),
    ('{"inputs": [1], "outputs": ["1"]}', "stdin tests need string inputs"),
    ('{"fn_name": "1x", "inputs": [[1]], "outputs": [1]}', "fn_name '1x' is not a Python name"),
])
def test_bad_tests_are_one_line_errors(truth, message):
    with pytest.raises(ValueError, match=message):
        parse_tests(truth)


def test_a_bad_ground_truth_stops_naming_the_row(tmp_path, char_tokenizer):
    rows = make_code_rows(0, "val")[:3]
    rows[2]["reward_model"]["ground_truth"] = '{"inputs": ["1"]}'
    path = write_rows(rows, tmp_path / "bad.jsonl")
    with pytest.raises(DataError) as err:
        PromptDataset(path, char_tokenizer, None, check_ground_truth=check_ground_truth, known_sources=REWARD_FNS)
    assert str(err.value).startswith(f"{path}: row 2: field 'reward_model.ground_truth': code tests: expected")
    assert "\n" not in str(err.value)


def test_the_task_is_a_few_hundred_problems_its_tests_valid_and_its_splits_apart():
    train, val = make_code_rows(0, "train"), make_code_rows(0, "val")
    assert len(train) + len(val) == len(code_problems()) >= 200
    assert not {r["prompt"][0]["content"] for r in train} & {r["prompt"][0]["content"] for r in val}
    assert make_code_rows(0, "val") == val
    for row in train + val:
        parse_tests(row["reward_model"]["ground_truth"])


def test_a_reference_solution_passes_its_problem():
    row = next(r for r in make_code_rows(0, "val") if "fn_name" not in r["reward_model"]["ground_truth"])
    truth = json.loads(row["reward_model"]["ground_truth"])
    echo = "import sys\nanswers = " + repr(dict(zip(truth["inputs"], truth["outputs"]))) + \
        "\nprint(answers[sys.stdin.read()], end='')"
    assert code_score("reprorl/code", echo, row["reward_model"]["ground_truth"]) == 1.0
