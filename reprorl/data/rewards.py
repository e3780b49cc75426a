"""Rule rewards: plain functions with verl's `compute_score` signature.

    fn(data_source, solution_str, ground_truth, extra_info=None) -> float

`solution_str` is the decoded response (without the prompt). Every function here returns
1.0 or 0.0 (no partial format credit, so the mean reward is the accuracy), except
`math_dapo_score`, which keeps verl's DAPO rewards: 1.0 or -1.0.
`compute_score` picks the function from the row's `data_source` through `REWARD_FNS`.

Each source also has an answer extractor (`ANSWER_FNS`): the final answer its scorer
reads from a response, normalised as the scorer compares it, or None. `score_and_answer`
(the rule reward a run uses when `reward.fn` is null) gives both, as verl's
`{"score": ..., "pred": ...}`, so validation can take the majority answer (maj@n).
"""

from __future__ import annotations

import re
import threading
from decimal import Decimal

from reprorl.data.code import CODE_SOURCES, check_code_ground_truth, code_answer, code_score
from reprorl.errors import DataError

# A bare integer, then only end tokens (if the decoder kept special tokens) and whitespace.
_ARITHMETIC_ANSWER = re.compile(r"\s*(-?\d+)\s*(?:(?:<\|im_end\|>|<\|endoftext\|>)\s*)*")


def arithmetic_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """The synthetic arithmetic task (`reprorl/arithmetic`): 1.0 iff the response is the answer.

    The response, less surrounding whitespace and trailing end tokens, must be exactly
    the integer `ground_truth` as written (no `+` sign, no leading zeros). Anything after
    the number scores 0, so the policy has to learn to stop.

    >>> arithmetic_score("reprorl/arithmetic", "19", "19")
    1.0
    >>> arithmetic_score("reprorl/arithmetic", " 19<|im_end|>", "19")
    1.0
    >>> arithmetic_score("reprorl/arithmetic", "-3\\n", "-3")
    1.0
    >>> arithmetic_score("reprorl/arithmetic", "20", "19")
    0.0
    >>> arithmetic_score("reprorl/arithmetic", "19 19 19", "19")
    0.0
    >>> arithmetic_score("reprorl/arithmetic", "019", "19")
    0.0
    """
    answer = arithmetic_answer(solution_str)
    return 1.0 if answer is not None and answer == ground_truth.strip() else 0.0


def arithmetic_answer(solution_str: str) -> str | None:
    """The integer an arithmetic response is, as written, or None (`arithmetic_score`)."""
    match = _ARITHMETIC_ANSWER.fullmatch(solution_str)
    return None if match is None else match.group(1)


# GSM8K: the number after the last "#### ", as in the dataset's own solutions: digits with
# optional thousands commas ("1,000") and decimals, or a bare decimal (".5"), and then an
# end: whitespace, the end of the text, a special token, or a sentence's "." before one.
_NUMBER = r"-?(?:(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?|\.[0-9]+)"
_GSM8K_ANSWER = re.compile(rf"####\s*\$?\s*({_NUMBER})(?=\.?(?:\s|$|<\|))")
_GSM8K_TRUTH = re.compile(rf"\s*\$?\s*({_NUMBER})\s*")


def _gsm8k_number(text: str) -> Decimal | None:
    """The number of the last `####` of `text` when it ends cleanly (see _GSM8K_ANSWER), else None."""
    markers = [m.start() for m in re.finditer("####", text)]
    if not markers:
        return None
    match = _GSM8K_ANSWER.match(text, markers[-1])
    return Decimal(match.group(1).replace(",", "")) if match else None


def gsm8k_truth(ground_truth: str) -> Decimal:
    """The number a GSM8K ground truth holds: a bare answer, or a whole solution ending in
    `#### answer`. Raises ValueError for anything else (a fraction, a word, `1.2.3`)."""
    if "####" in ground_truth:
        number = _gsm8k_number(ground_truth)
    else:
        match = _GSM8K_TRUTH.fullmatch(ground_truth)
        number = Decimal(match.group(1).replace(",", "")) if match else None
    if number is None:
        raise ValueError(f"GSM8K ground truth {ground_truth!r} is not a number (expected e.g. '72', '1,000' or '-3.5')")
    return number


def gsm8k_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """GSM8K (`openai/gsm8k`): 1.0 iff the number after the last `####` equals the answer.

    Commas and a `$` are stripped and the numbers compared as decimals (`1,000` == `1000`,
    `3.50` == `3.5`). The number must end there (whitespace, the end, a special token, or a
    sentence's `.` before one): `#### 1.2.3` or `#### 3/4` is no answer. `ground_truth` is
    the bare answer (verl's preprocessing) or a whole GSM8K solution ending in `#### answer`;
    one that is not a number raises ValueError (`gsm8k_truth`). There is no last-number
    fallback: it would reward any text that happens to end in the right number, and a
    policy learns to list numbers; the prompt asks for `####`, so the reward checks for it
    (verl's "strict" mode).

    >>> gsm8k_score("openai/gsm8k", "3 + 4 = 7 apples.\\n#### 7", "7")
    1.0
    >>> gsm8k_score("openai/gsm8k", "#### $1,000.", "1000")
    1.0
    >>> gsm8k_score("openai/gsm8k", "#### 5 wait, no: #### -2", "-2")
    1.0
    >>> gsm8k_score("openai/gsm8k", "The answer is 7.", "7")
    0.0
    >>> gsm8k_score("openai/gsm8k", "#### 8", "He has 7.\\n#### 7")
    0.0
    >>> gsm8k_score("openai/gsm8k", "#### 1.2.3", "1.2")
    0.0
    """
    truth = gsm8k_truth(ground_truth)
    answer = _gsm8k_number(solution_str)
    return 1.0 if answer is not None and answer == truth else 0.0


def gsm8k_answer(solution_str: str) -> str | None:
    """The number after a GSM8K response's last `####`, as a plain decimal (`1,000.50` ->
    `1000.5`: numbers `gsm8k_score` takes as equal are one answer), or None."""
    number = _gsm8k_number(solution_str)
    if number is None:
        return None
    text = format(number.normalize(), "f")
    return "0" if text == "-0" else text


# math-verify bounds each parse and comparison with signal.alarm: a sympy expression
# such as 9^{9^{9}} otherwise never finishes. The alarm is wall-clock time, so a
# response that takes about this long to parse could score differently on a loaded
# machine; nothing sane comes near it.
MATH_VERIFY_TIMEOUT_S = 5


def math_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    r"""Math answers (MATH and the like) through math-verify: 1.0 iff equivalent to the truth.

    The response's answer is what math-verify extracts (a `\boxed{}` first, else the last
    LaTeX or plain expression); `ground_truth` is a bare answer (boxed if not already).
    A response math-verify cannot parse, or a parse that times out, scores 0.0. Call it
    from a process's main thread (math-verify's timeout needs signals); elsewhere it
    raises RuntimeError rather than scoring everything 0.

    This is NOT verl's default for these datasets: verl scores the string in the LAST
    `\boxed{}` against the truth after normalising both (`math_reward.compute_score`).
    math-verify compares mathematical values, so `\boxed{0.5}` against `\frac{1}{2}`
    scores 1.0 here and 0.0 in verl; and it takes a response with several boxed answers
    as a set, so `\boxed{5} and \boxed{6}` against 6 scores 0.0 here and 1.0 in verl (a
    policy cannot hedge by boxing every candidate).

    >>> math_score("lighteval/MATH", "So $x = \\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}")
    1.0
    >>> math_score("lighteval/MATH", "\\boxed{0.5}", "\\frac{1}{2}")
    1.0
    >>> math_score("lighteval/MATH", "\\boxed{1+x^2}", "x^2+1")
    1.0
    >>> math_score("lighteval/MATH", "\\boxed{3}", "\\frac{1}{2}")
    0.0
    >>> math_score("lighteval/MATH", "I don't know", "\\frac{1}{2}")
    0.0
    >>> math_score("lighteval/MATH", "\\boxed{5} and \\boxed{6}", "6")
    0.0
    """
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("math_score must run in a main thread: math-verify's timeout uses signal.alarm")
    from math_verify import parse, verify  # sympy is slow to import; only math rows need it

    gold_text = ground_truth if "\\boxed" in ground_truth else "\\boxed{" + ground_truth + "}"
    try:
        gold = parse(gold_text, parsing_timeout=MATH_VERIFY_TIMEOUT_S)
        answer = parse(solution_str, parsing_timeout=MATH_VERIFY_TIMEOUT_S)
        return 1.0 if gold and answer and verify(gold, answer, timeout_seconds=MATH_VERIFY_TIMEOUT_S) else 0.0
    except Exception:  # an unparsable response is a wrong answer, not a crashed run
        return 0.0


def math_answer(solution_str: str) -> str | None:
    r"""The content of a math response's last `\boxed{}`, spaces removed, or None. A vote
    on strings: `0.5` and `\frac{1}{2}` count as two answers, though `math_score` takes
    both as right (math-verify's parse is too slow to run on every sample twice)."""
    boxed = _last_boxed(solution_str)
    return None if boxed is None else "".join(boxed.split())


# DAPO's scorer (verl's `reward_score/math_dapo.py`, after lm-evaluation-harness's Minerva
# MATH normalisation): the answer is the text after the last "Answer:", both sides normalised
# and compared as strings. The tables are verl's, in verl's order (the order matters: "an "
# goes before " " is dropped).
_DAPO_SUBSTITUTIONS = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), (r"\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)
_DAPO_REMOVED = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue", "points",
    "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals", "edges", "students",
    "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3",
    "\\text{\n}", "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;", r",\!", "{,}", '"', "\\dots",
)
_DAPO_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_DAPO_TAIL_CHARS = 300  # verl scores the response's last 300 characters (MATH-500's longest answer: 159)
_DAPO_BOX_TAIL_CHARS = 100  # and looks for the \boxed{} fallback in the last 100 of those


def dapo_normalize(answer: str) -> str:
    r"""A final answer as DAPO compares it: the part after the last `=`, units, spaces, `$`
    and `\text{}` wrappers dropped, TeX shorthand (`\frac12`, `\sqrt2`) spelled out, and
    the commas of a text of digits and commas removed (`1,000`).

    >>> dapo_normalize("x = 1,000 dollars")
    '1000'
    >>> dapo_normalize("$\\frac12$")
    '\\frac{1}{2}'
    >>> dapo_normalize("\\text{(B)}")
    '(B)'
    """
    answer = answer.split("=")[-1]
    for before, after in _DAPO_SUBSTITUTIONS:
        answer = answer.replace(before, after)
    for expression in _DAPO_REMOVED:
        answer = answer.replace(expression, "")
    answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", answer)
    answer = re.sub(r"(\\text\{)(.*?)(\})", "\\2", answer)
    answer = re.sub(r"(\\textbf\{)(.*?)(\})", "\\2", answer)
    answer = re.sub(r"(\\overline\{)(.*?)(\})", "\\2", answer)
    answer = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", answer)
    answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", answer)
    answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def _last_boxed(text: str) -> str | None:
    r"""The content of the last `\boxed{...}` of `text` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for i in range(start + len("\\boxed"), len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + len("\\boxed{") : i]
    return None


def math_dapo_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    r"""DAPO's math reward (`math_dapo`, verl's `math_dapo.compute_score`): 1.0 if right, -1.0 if not.

    The answer is the text after the last `Answer:` (any case) in the response's last
    300 characters, up to the end of its line; without one, the last `\boxed{}` of the
    last 100 characters. Answer and `ground_truth` are compared as strings after
    `dapo_normalize`. A response with no answer at all is wrong (-1.0): DAPO gives no
    0 for a missing format.

    >>> math_dapo_score("math_dapo", "2 + 2 is four.\nAnswer: 4", "4")
    1.0
    >>> math_dapo_score("math_dapo", "answer: $1,000$ dollars", "1000")
    1.0
    >>> math_dapo_score("math_dapo", "Answer: 5", "4")
    -1.0
    >>> math_dapo_score("math_dapo", "so it is \\boxed{\\frac12}", "\\frac{1}{2}")
    1.0
    >>> math_dapo_score("math_dapo", "I think 4", "4")
    -1.0
    """
    answer = math_dapo_answer(solution_str)
    return 1.0 if answer is not None and answer == dapo_normalize(ground_truth) else -1.0


def math_dapo_answer(solution_str: str) -> str | None:
    r"""The answer `math_dapo_score` reads (after the last `Answer:` of the last 300
    characters, else the last `\boxed{}` of the last 100), normalised, or None."""
    tail = solution_str[-_DAPO_TAIL_CHARS:]
    found = _DAPO_ANSWER.findall(tail)
    answer = found[-1] if found else _last_boxed(tail[-_DAPO_BOX_TAIL_CHARS:])
    return None if answer is None else dapo_normalize(answer)


# data_source -> reward function, by the names verl's preprocessing gives the public
# datasets; the MATH ones are scored by math-verify, not verl's last-\boxed string match
# (see math_score).
REWARD_FNS = {
    "reprorl/arithmetic": arithmetic_score,
    "openai/gsm8k": gsm8k_score,
    "lighteval/MATH": math_score,
    "DigitalLearningGmbH/MATH-lighteval": math_score,
    "HuggingFaceH4/MATH-500": math_score,
    "math": math_score,
    "math_dapo": math_dapo_score,  # DAPO-Math-17k's data_source in verl's recipe
    **dict.fromkeys(CODE_SOURCES, code_score),  # programs run against tests in the sandbox (data/code.py)
}
_ANSWER_BY_SCORER = {arithmetic_score: arithmetic_answer, gsm8k_score: gsm8k_answer, math_score: math_answer,
                     math_dapo_score: math_dapo_answer, code_score: code_answer}
ANSWER_FNS = {source: _ANSWER_BY_SCORER[fn] for source, fn in REWARD_FNS.items()}
"""data_source -> the final answer its scorer reads from a response (or None)."""


def check_ground_truth(data_source: str, ground_truth: str) -> None:
    """Raise ValueError if the rule reward of `data_source` could never match `ground_truth`
    (a GSM8K answer that is not a number, an arithmetic answer that is not an integer, code
    tests that are not verl's test JSON): every response to such a row would score 0 without
    a word. Other sources pass. A code row also checks, once, that the sandbox can isolate a
    program here (`SandboxError` if not).

    >>> check_ground_truth("openai/gsm8k", "3/4")
    Traceback (most recent call last):
    ...
    ValueError: GSM8K ground truth '3/4' is not a number (expected e.g. '72', '1,000' or '-3.5')
    """
    if data_source == "openai/gsm8k":
        gsm8k_truth(ground_truth)
    elif data_source == "reprorl/arithmetic" and not re.fullmatch(r"-?[0-9]+", ground_truth.strip()):
        raise ValueError(f"arithmetic ground truth {ground_truth!r} is not an integer")
    elif data_source in CODE_SOURCES:
        check_code_ground_truth(ground_truth)


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """The rule reward of one response, chosen by `data_source`.

    >>> compute_score("reprorl/arithmetic", "12", "12")
    1.0
    >>> compute_score("openai/gsm8k", "#### 12", "13")
    0.0
    """
    fn = REWARD_FNS.get(data_source)
    if fn is None:
        raise DataError(f"data_source {data_source!r} has no rule reward; known: {', '.join(REWARD_FNS)}")
    return fn(data_source, solution_str, ground_truth, extra_info)


def score_and_answer(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None
                     ) -> dict[str, float | str | None]:
    """`compute_score`'s score and the response's final answer (`ANSWER_FNS`), as verl's
    `{"score": ..., "pred": ...}`: the rule reward of a run whose `reward.fn` is null.

    >>> score_and_answer("openai/gsm8k", "#### 1,000", "1000")
    {'score': 1.0, 'pred': '1000'}
    """
    return {"score": compute_score(data_source, solution_str, ground_truth, extra_info),
            "pred": ANSWER_FNS[data_source](solution_str)}
