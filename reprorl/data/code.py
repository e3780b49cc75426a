"""Code rewards: the response's program run against the row's tests in the sandbox.

    code_score(data_source, solution_str, ground_truth, extra_info=None) -> 1.0 or 0.0

The ground truth is verl's JSON of tests (its `codecontests`, `apps`, `taco`, `codeforces`
rows), one of two kinds:

    {"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]}                 stdin -> stdout
    {"fn_name": "add", "inputs": [[1, 2], ...], "outputs": [3, ...]}    a call -> its value

A stdin test passes when the program exits 0 and its output equals the expected one, line
by line, trailing whitespace ignored. A call test calls `fn_name` (a function of the
program, or a method of its `class Solution`, LeetCode's form) with the input's items as
arguments; its value, through JSON, must equal the output (or the output's one item: APPS
and TACO wrap each value in a list). The program is the last fenced code block of the
response (```python, ```py or bare ```), or without a fence the whole response, as verl's
`prime_code` takes it. All or nothing by default (the tests run in order, the first failure
ends them); `code_partial_score` gives the share of tests passed instead (`reward.fn=
reprorl.data.code:code_partial_score`). The verdict counts CPU time only (docs/code.md).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from reprorl.sandbox import Limits, require_isolation, run_python

CODE_SOURCES = ("reprorl/code", "codecontests", "apps", "taco", "codeforces")
"""data_source names scored by running code: the project's task and verl's code sets."""

_FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)

# Appended to a call test's program: the arguments come on stdin, the value goes to stdout as JSON.
_CALL_DRIVER = """

import json as _json, sys as _sys
_args = _json.loads(_sys.stdin.read())
_fn = globals().get({fn!r}) or getattr(globals()["Solution"](), {fn!r})
_sys.stdout.write("\\n" + _json.dumps(_fn(*_args)) + "\\n")
"""


@dataclass(frozen=True)
class Tests:
    """A row's tests: stdin texts and expected stdouts, or a function's arguments and values."""

    inputs: list[Any]
    outputs: list[Any]
    fn_name: str | None = None


def parse_tests(ground_truth: str) -> Tests:
    """A ground truth's `Tests`; ValueError (one line: what is wrong) if it is not verl's test JSON.

    >>> parse_tests('{"inputs": ["1\\\\n"], "outputs": ["2\\\\n"]}').outputs
    ['2\\n']
    >>> parse_tests('{"inputs": ["1"]}')
    Traceback (most recent call last):
    ...
    ValueError: code tests: expected a JSON object with lists "inputs" and "outputs", got keys ['inputs']
    """
    try:
        tests = json.loads(ground_truth)
    except (json.JSONDecodeError, TypeError) as err:
        raise ValueError(f"code tests are not valid JSON ({err})") from None
    if not isinstance(tests, dict) or not all(isinstance(tests.get(k), list) for k in ("inputs", "outputs")):
        keys = sorted(tests) if isinstance(tests, dict) else type(tests).__name__
        raise ValueError(f'code tests: expected a JSON object with lists "inputs" and "outputs", got keys {keys}')
    inputs, outputs, fn_name = tests["inputs"], tests["outputs"], tests.get("fn_name")
    if not inputs or len(inputs) != len(outputs):
        raise ValueError(f"code tests: {len(inputs)} inputs and {len(outputs)} outputs; expected as many, at least 1")
    if fn_name is not None and (not isinstance(fn_name, str) or not fn_name.isidentifier()):
        raise ValueError(f"code tests: fn_name {fn_name!r} is not a Python name")
    if fn_name is None and not all(isinstance(x, str) for x in inputs + outputs):
        raise ValueError("code tests: stdin tests need string inputs and outputs (or an fn_name for call tests)")
    if fn_name is not None and not all(isinstance(x, list) for x in inputs):
        raise ValueError(f"code tests: the inputs of fn_name {fn_name!r} must be lists of arguments")
    return Tests(inputs, outputs, fn_name)


def extract_code(solution_str: str) -> str:
    """The program of a response: its last fenced block, else the whole response.

    >>> extract_code("Here:\\n```python\\nprint(1)\\n```\\nDone.")
    'print(1)\\n'
    >>> extract_code("print(2)")
    'print(2)'
    """
    blocks = _FENCE.findall(solution_str)
    return blocks[-1] if blocks else solution_str


def same_output(got: str, expected: str) -> bool:
    """Whether two stdouts match line by line, trailing whitespace and blank end lines ignored.

    >>> same_output("3  \\n\\n", "3"), same_output("3\\n4", "3 4")
    (True, False)
    """
    lines = lambda text: [line.rstrip() for line in text.rstrip().splitlines()]  # noqa: E731
    return lines(got) == lines(expected)


def passes(program: str, tests: Tests, k: int, limits: Limits = Limits()) -> bool:
    """Whether `program` passes test `k` of `tests`."""
    if tests.fn_name is None:
        result = run_python(program, tests.inputs[k], limits)
        return result.status == "ok" and same_output(result.stdout, tests.outputs[k])
    source = program + _CALL_DRIVER.format(fn=tests.fn_name)
    result = run_python(source, json.dumps(tests.inputs[k]), limits)
    if result.status != "ok" or not result.stdout.strip():
        return False
    try:
        value = json.loads(result.stdout.strip().splitlines()[-1])
    except json.JSONDecodeError:
        return False
    expected = json.loads(json.dumps(tests.outputs[k]))  # tuples as lists, as the value went through JSON
    return value == expected or [value] == expected


def verdicts(solution_str: str, ground_truth: str, stop_at_failure: bool) -> list[bool]:
    """Each test's verdict in order (cut after the first failure with `stop_at_failure`)."""
    tests, program = parse_tests(ground_truth), extract_code(solution_str)
    results = []
    for k in range(len(tests.inputs)):
        results.append(passes(program, tests, k))
        if stop_at_failure and not results[-1]:
            break
    return results


def code_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """1.0 iff the response's program passes every test of `ground_truth` (see the module docstring).

    >>> code_score("reprorl/code", "```python\\nprint(int(input()) * 2)\\n```", '{"inputs": ["4\\\\n"], "outputs": ["8"]}')
    1.0
    >>> code_score("apps", "def add(a, b):\\n    return a - b", '{"fn_name": "add", "inputs": [[1, 2]], "outputs": [3]}')
    0.0
    """
    results = verdicts(solution_str, ground_truth, stop_at_failure=True)
    return 1.0 if all(results) and len(results) == len(parse_tests(ground_truth).inputs) else 0.0


def code_partial_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None
                       ) -> float:
    """The share of the tests the response's program passes, every test run (partial credit).

    >>> code_partial_score("taco", "print(1)", '{"inputs": ["", ""], "outputs": ["1", "2"]}')
    0.5
    """
    results = verdicts(solution_str, ground_truth, stop_at_failure=False)
    return sum(results) / len(results)


def code_answer(solution_str: str) -> None:
    """Programs are not voted on (maj@n): no answer."""
    return None


def check_code_ground_truth(ground_truth: str) -> None:
    """ValueError if `ground_truth` is not verl's test JSON; `SandboxError` if no program can
    be isolated on this machine (checked once, before a run with code rows starts)."""
    parse_tests(ground_truth)
    require_isolation()
